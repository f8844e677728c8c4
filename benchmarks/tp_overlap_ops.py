"""The sequence-parallel linears of one TP=2 block, op by op: where their communication goes.

Each column-parallel linear under sequence parallelism is an all-gather along the sequence then
a GEMM; each row-parallel one a GEMM then a reduce-scatter. This times, for the linears of the
llama-1b block (qkv, attention output, fc1, fc2) at micro-batch 4 x seq 2048:

    gemm        the GEMM alone on the gathered (or full) input: what overlap could reach
    comm        the collective alone, on a contiguous sequence-first buffer
    nccl-bf     the trainer's path today: batch-first (b, s, h) activations, so the collective
                runs on a moved copy (`mappings.all_gather(x, 1)`), then the GEMM
    nccl-sf     the same with sequence-first (s, b, h) activations: no copies
    fused-bf    `--tp-comm-overlap` today: symm_mem fused op gathering / scattering along dim 1
    fused-sf    the fused op along dim 0 (sequence-first)

Every variant's output is checked against nccl-bf's before it is timed. CUDA/NCCL for the fused
rows; `--device cpu` runs the others on gloo with small shapes (a check that the script works).

    torchrun --standalone --nproc-per-node 2 benchmarks/tp_overlap_ops.py --out tp_ops.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.services.trainer.parallel import mappings as M


def _timer(device: torch.device):
    if device.type == "cuda":

        def measure(fn, iters: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters
    else:

        def measure(fn, iters: int) -> float:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) * 1e3 / iters

    return measure


def time_ms(fn, device: torch.device, iters: int, rounds: int) -> float:
    """Median over `rounds` of the mean time of `iters` back-to-back calls, ranks in step."""
    measure = _timer(device)
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        dist.barrier()
        samples.append(measure(fn, iters))
    return statistics.median(samples)


def linears(b: int, s: int, h: int, qkv: int, ffn: int, tp: int) -> list[dict]:
    """(name, kind, in, out) of each sharded linear of a block, per rank."""
    return [
        {"name": "qkv", "kind": "column", "fan_in": h, "fan_out": qkv // tp},
        {"name": "attn-out", "kind": "row", "fan_in": h // tp, "fan_out": h},
        {"name": "fc1", "kind": "column", "fan_in": h, "fan_out": 2 * ffn // tp},
        {"name": "fc2", "kind": "row", "fan_in": ffn // tp, "fan_out": h},
    ]


def variants(lin: dict, b: int, s: int, group, device, dtype, fused: bool) -> dict:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    w = (torch.randn(lin["fan_out"], lin["fan_in"], generator=gen) * 0.02).to(device, dtype)
    name = group.group_name if fused else None
    ops = torch.ops.symm_mem if fused else None
    if lin["kind"] == "column":  # input: this rank's sequence shard
        x_bf = torch.randn(b, s // tp, lin["fan_in"], generator=gen).to(device, dtype)
        x_sf = x_bf.transpose(0, 1).contiguous()
        full_sf = M.all_gather(x_sf, 0, group)
        run = {
            "gemm": lambda: F.linear(full_sf, w),
            "comm": lambda: M.all_gather(x_sf, 0, group),
            "nccl-bf": lambda: F.linear(M.all_gather(x_bf, 1, group), w),
            "nccl-sf": lambda: F.linear(M.all_gather(x_sf, 0, group), w),
        }
        if fused:
            run["fused-bf"] = lambda: ops.fused_all_gather_matmul(x_bf, [w.t()], 1, name)[1][0]
            run["fused-sf"] = lambda: ops.fused_all_gather_matmul(x_sf, [w.t()], 0, name)[1][0]
    else:  # input: the full sequence, this rank's slice of the hidden dim
        x_bf = torch.randn(b, s, lin["fan_in"], generator=gen).to(device, dtype)
        x_sf = x_bf.transpose(0, 1).contiguous()
        y_sf = F.linear(x_sf, w)
        run = {
            "gemm": lambda: F.linear(x_sf, w),
            "comm": lambda: M.reduce_scatter(y_sf, 0, group),
            "nccl-bf": lambda: M.reduce_scatter(F.linear(x_bf, w), 1, group),
            "nccl-sf": lambda: M.reduce_scatter(F.linear(x_sf, w), 0, group),
        }
        if fused:
            run["fused-bf"] = lambda: ops.fused_matmul_reduce_scatter(x_bf, w.t(), "sum", 1, name)
            run["fused-sf"] = lambda: ops.fused_matmul_reduce_scatter(x_sf, w.t(), "sum", 0, name)
    want = run["nccl-bf"]().float()
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    for key in ("nccl-sf", "fused-bf", "fused-sf"):
        if key in run:
            got = run[key]().float()
            torch.testing.assert_close(
                got.transpose(0, 1) if key.endswith("-sf") else got,
                want,
                msg=f"{lin['name']} {key} differs from nccl-bf",
                **tol,
            )
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument(
        "--qkv", type=int, default=4096, help="fused qkv width: (heads + 2 kv groups) x head dim"
    )
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="tp_overlap_ops.json")
    args = p.parse_args(argv)

    device = (
        torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    group = dist.group.WORLD
    fused = device.type == "cuda"
    if fused:
        import torch.distributed._symmetric_memory as symm

        enable = getattr(
            symm, "enable_symm_mem_for_group", None
        )  # where this torch still asks for it
        if enable is not None:
            enable(group.group_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tp = dist.get_world_size()
    rows = []
    for lin in linears(args.micro_batch, args.seq, args.hidden, args.qkv, args.ffn, tp):
        run = variants(lin, args.micro_batch, args.seq, group, device, dtype, fused)
        times = {k: time_ms(fn, device, args.iters, args.rounds) for k, fn in run.items()}
        rows.append(dict(lin, **{f"{k}_ms": v for k, v in times.items()}))
    if dist.get_rank() == 0:
        keys = [
            k
            for k in ("gemm", "comm", "nccl-bf", "nccl-sf", "fused-bf", "fused-sf")
            if f"{k}_ms" in rows[0]
        ]
        print(
            f"tp={tp} micro-batch {args.micro_batch} x seq {args.seq}, {dtype}, {device.type}; "
            "ms per call"
        )
        print(f"{'linear':10} {'kind':7} " + " ".join(f"{k:>9}" for k in keys) + "  best/nccl-bf")
        total = {k: 0.0 for k in keys}
        for r in rows:
            for k in keys:
                total[k] += r[f"{k}_ms"]
            best = min(r[f"{k}_ms"] for k in keys if k not in ("gemm", "comm"))
            print(
                f"{r['name']:10} {r['kind']:7} "
                + " ".join(f"{r[k + '_ms']:9.3f}" for k in keys)
                + f"  {best / r['nccl-bf_ms']:.2f}"
            )
        print(f"{'block':18} " + " ".join(f"{total[k]:9.3f}" for k in keys))
        info = {
            "device": torch.cuda.get_device_name(device) if fused else "cpu",
            "torch": torch.__version__,
            "tp": tp,
            "dtype": str(dtype),
            "args": vars(args),
            "rows": rows,
            "block_total_ms": total,
        }
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
