"""Long sequences: context-parallel attention arithmetic, and llama-1b training at long sequence.

    python benchmarks/long_context.py attention --seq 32768 --cp 2 4 --out attention.json
    python benchmarks/long_context.py train --config deploy/configs/llama-1b.toml \
        --seq 8192 32768 131072 --out train.json

`attention`: the blockwise attention context parallelism runs, on one device, against one
flash call over the whole sequence (the baseline, measured in the same run). For each cp the
sequence is cut into 2·cp chunks and every virtual rank's ring steps are computed exactly as
`parallel/context.py` orders them (its own block causal, a lower rank's block through its first
chunk, a higher rank's by the second half of the queries), forward with the log-sum-exp merge
and backward with the final (out, lse), on `kernels.attention_blocks` (PyTorch's flash ops on
CUDA). Reports the max abs error of out, dq, dk, dv against the flash call, and the time of all
virtual ranks' blocks (the work cp GPUs share, without the communication) against it.
bf16, llama-1b's heads (16 query heads, 8 KV groups, head_dim 128), batch 1.

`train`: the real `Trainer` on one device, llama-1b at each sequence length with full
recompute (uniform, 1 block), micro-batch 1, global batch 1, bf16, compile as the config says
(with full recompute `train.compile` compiles each block in place, the checkpoint outside);
each length in a fresh process (so one that runs out of memory is recorded as such and peak
memory is its own). The model keeps llama-1b's 32768-row vocabulary; the data is the embedded
corpus, byte-tokenized (the tokens' values do not change the step's cost). Reports tokens/s
over the timed steps after warm-up, MFU (6N + 12·L·s·h FLOPs per token, Megatron's count), and
peak allocated and reserved memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.kernels import attention_blocks as blocks  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, iters: int) -> float:
    fn()
    _sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - start) / iters


def ring_emulated(q, k, v, dout, cp: int):
    """Every virtual rank's ring steps (parallel/context.py's order), forward then backward;
    returns the full-sequence out, dq, dk, dv assembled from the ranks' chunks."""
    s = q.shape[2]
    c = s // (2 * cp)

    def idx(r):
        return torch.cat(
            [torch.arange(r * c, (r + 1) * c), torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
        )

    pos = [idx(r).to(q.device) for r in range(cp)]
    outs, grads = (
        torch.empty_like(q),
        [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)],
    )
    for r in range(cp):
        ql, dl = q[:, :, pos[r]], dout[:, :, pos[r]]
        out = torch.zeros(ql.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(ql.shape[:3], float("-inf"), device=q.device)
        parts = []
        for step in range(cp):
            src = (r - step) % cp
            kl, vl = k[:, :, pos[src]], v[:, :, pos[src]]
            if step == 0:
                part = (slice(None), slice(None), True)
            elif src < r:
                part = (slice(None), slice(0, c), False)
            else:
                part = (slice(c, None), slice(None), False)
            qs, ks, causal = part
            blocks.merge(
                out[:, :, qs],
                lse[:, :, qs],
                *blocks.attention_forward(ql[:, :, qs], kl[:, :, ks], vl[:, :, ks], causal),
            )
            parts.append((src, qs, ks, causal))
        o = out.to(q.dtype)
        outs[:, :, pos[r]] = o
        dq = torch.zeros(ql.shape, dtype=torch.float32, device=q.device)
        for src, qs, ks, causal in parts:
            kl, vl = k[:, :, pos[src]], v[:, :, pos[src]]
            gq, gk, gv = blocks.attention_backward(
                dl[:, :, qs],
                ql[:, :, qs],
                kl[:, :, ks],
                vl[:, :, ks],
                o[:, :, qs],
                lse[:, :, qs],
                causal,
            )
            dq[:, :, qs] += gq.float()
            grads[1][:, :, pos[src][ks]] += gk.float()
            grads[2][:, :, pos[src][ks]] += gv.float()
        grads[0][:, :, pos[r]] = dq
    return outs, grads


def attention(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    b, h, g, d, s = 1, args.heads, args.groups, args.head_dim, args.seq
    q, k, v = (
        torch.randn(b, n, s, d, device=device, dtype=dtype, generator=gen) for n in (h, g, g)
    )
    dout = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def one_call():
        for t in leaves:
            t.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(
            *leaves, is_causal=True, enable_gqa=True
        )
        out.backward(dout)
        return out

    ref_out = one_call().detach()
    ref_grads = [t.grad.float() for t in leaves]
    base_s = _timed(one_call, args.iters)
    rows = []
    for cp in args.cp:
        out, grads = ring_emulated(q, k, v, dout, cp)
        err = {"out": (out.float() - ref_out.float()).abs().max().item()}
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
            err[name] = (got - want).abs().max().item()
        t = _timed(lambda cp=cp: ring_emulated(q, k, v, dout, cp), args.iters)
        rows.append(
            {"cp": cp, "max_abs_error": err, "blocks_fwd_bwd_s": t, "ratio_to_one_call": t / base_s}
        )
        print(json.dumps(rows[-1]), flush=True)
    scale = {
        "ref_out_abs_max": ref_out.float().abs().max().item(),
        "ref_grad_abs_max": [g_.abs().max().item() for g_ in ref_grads],
    }
    return {
        "bench": "cp-attention-blocks",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seq": s,
        "heads": h,
        "groups": g,
        "head_dim": d,
        "dtype": str(dtype),
        "one_flash_call_fwd_bwd_s": base_s,
        "scale": scale,
        "rows": rows,
    }


def train_one(config: str, seq: int, steps: int, warmup: int, extra: list[str]) -> dict:
    """One sequence length in this process: the Trainer's steps, timed after warm-up."""
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer

    run = tempfile.mkdtemp(prefix="long-context-")
    args = [
        "--config",
        config,
        f"--model.seq_length={seq}",
        "--model.vocab_size=32768",
        "--data.tokenizer=byte",
        "--train.micro_batch_size=1",
        "--train.global_batch_size=1",
        f"--train.train_iters={warmup + steps}",
        "--train.eval_interval=0",
        "--parallel.recompute_granularity=full",
        f"--log.run_dir={run}",
        "--log.plot=false",
        *extra,
    ]
    trainer = Trainer(load_config(args))
    first = [float(trainer.train_step(i)[0]) for i in range(warmup)]
    _sync()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    losses = [trainer.train_step(warmup + i)[0] for i in range(steps)]
    _sync()
    step_s = (time.perf_counter() - start) / steps
    tokens_s = seq / step_s
    return {
        "seq": seq,
        "step_s": step_s,
        "tokens_per_s": tokens_s,
        "mfu": trainer.flops_per_token * tokens_s / (trainer.peak * 1e12) if trainer.peak else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "losses": first + [float(x) for x in losses],
        "parameters": trainer.num_parameters,
    }


def train(args) -> dict:
    rows = []
    for seq in args.seq:
        cmd = [
            sys.executable,
            __file__,
            "train-one",
            "--config",
            args.config,
            "--seq",
            str(seq),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            *[f"--extra={e}" for e in args.extra],
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode == 0 and lines:
            rows.append(json.loads(lines[-1]))
        else:
            oom = "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr
            rows.append(
                {
                    "seq": seq,
                    "error": "out of memory" if oom else proc.stderr.strip().splitlines()[-1:],
                }
            )
        print(json.dumps(rows[-1]), flush=True)
    return {
        "bench": "long-context-train",
        "config": args.config,
        "recompute": "full uniform 1",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("attention")
    a.add_argument("--seq", type=int, default=32768)
    a.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    a.add_argument("--heads", type=int, default=16)
    a.add_argument("--groups", type=int, default=8)
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--iters", type=int, default=3)
    a.add_argument("--out")
    t = sub.add_parser("train")
    t.add_argument("--config", default="deploy/configs/llama-1b.toml")
    t.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--timeout", type=float, default=900)
    t.add_argument(
        "--extra",
        action="append",
        default=[],
        help="a trainer flag for every row, e.g. --extra=--train.compile=false",
    )
    t.add_argument("--out")
    o = sub.add_parser("train-one")
    o.add_argument("--config")
    o.add_argument("--seq", type=int)
    o.add_argument("--steps", type=int)
    o.add_argument("--warmup", type=int)
    o.add_argument("--extra", action="append", default=[])
    args = ap.parse_args()
    if args.cmd == "train-one":
        print(
            json.dumps(train_one(args.config, args.seq, args.steps, args.warmup, args.extra)),
            flush=True,
        )
        return
    result = attention(args) if args.cmd == "attention" else train(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
