"""Optimizer CPU offload on one GPU: tokens/s, MFU and peak GPU memory with and without it, and
the largest Llama shape that trains with it.

    python benchmarks/optimizer_offload.py --out offload.json
    python benchmarks/optimizer_offload.py --device cpu --sizes tiny --largest tiny-wide,tiny \\
        --seq 32 --steps 2 --out offload.json                                 # a CPU smoke run

Each case (a Llama shape, offload on or off) runs in a subprocess of its own, capped in time, so
that an out-of-memory or a slow case cannot take the others with it: the model built on the
device from its flags (random weights, random tokens), the trainer's single-GPU step (bf16
autocast, gradient clipping, AdamW built by `build_optimizer`: fused on the device with bf16
weight copies and fused gradient accumulation, or offloaded with optim.optimizer_cpu_offload,
optim.overlap_cpu_optimizer_d2h_h2d and optim.offload_bf16_params: bf16 device parameters
with fp32 main gradients, the fp32 masters on the host only), `--micro-batches` micro-batches of
`--micro-batch` x
`--seq` tokens per step, eager. The baseline is the same model and step without offload, in the
same run: offload's question is what moving the optimizer costs and saves, not how the model
compares with another implementation. Per case: the mean step time after `--warmup` steps,
tokens/s, MFU (the model's training FLOPs per token, `GPT.flops_per_token`: 6 x parameters
plus attention, over 989 TFLOP/s, the bf16 dense peak of an H100/H200 SXM) and the peak GPU
memory allocated (`torch.cuda.max_memory_allocated`, whole run). The `--largest` shapes come
first (the question a user of offload asks: does the 8B train on one GPU), offloaded, in
descending order until one trains, each capped at `--largest-cap-s`; then the `--sizes` pairs
with what is left of `--time-budget-s`. A shape whose offloaded state (12 bytes per parameter:
the fp32 master and two moments) does not fit in the host's available memory, or whose device
state does not fit the GPU, is skipped without starting. The JSON is rewritten after every
case, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, FLOP/s

_LLAMA = dict(
    normalization="rmsnorm",
    norm_epsilon=1e-5,
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
)
SHAPES: dict[str, dict] = {
    # deploy/configs/llama-1b.toml's model (1.27B)
    "llama-1b": dict(
        _LLAMA,
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=5632,
        vocab_size=32768,
        untie_embeddings_and_output_weights=True,
    ),
    # Llama-3.2-3B (3.2B, tied embeddings)
    "llama-3b": dict(
        _LLAMA,
        num_layers=28,
        hidden_size=3072,
        num_attention_heads=24,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=128256,
        rotary_base=500000.0,
    ),
    # Llama-3-8B (8.0B), and its first half (16 blocks, 4.5B)
    "llama-8b": dict(
        _LLAMA,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        rotary_base=500000.0,
        untie_embeddings_and_output_weights=True,
    ),
    # CPU smoke sizes
    "tiny": dict(_LLAMA, num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256),
    "tiny-wide": dict(_LLAMA, num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=256),
}
SHAPES["llama-8b-16L"] = dict(SHAPES["llama-8b"], num_layers=16)

# offloaded: fp32 master + two fp32 moments (the gradients stream through a few chunk-sized
# staging buffers); the device: offloaded, bf16 param + fp32 main grad; else fp32 param + grad
# + bf16 copy + two fp32 moments
HOST_BYTES_PER_PARAM = 12
DEVICE_BYTES_PER_PARAM = {True: 6, False: 18}


def _log(msg: str) -> None:
    print(f"[optimizer_offload] {msg}", flush=True)


def parameters(shape: str) -> tuple[int, int]:
    """(parameters, elements of the largest one) of a shape, built on the meta device."""
    import torch

    from meshtrain.services.common.model_config import ModelConfig
    from meshtrain.services.trainer.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(ModelConfig(**SHAPES[shape], seq_length=128))
    return model.num_parameters(), max(p.numel() for p in model.parameters())


def host_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def sync_all(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- one case (the subprocess)
def run_case(args: argparse.Namespace) -> dict:
    import torch

    from meshtrain.services.common.model_config import ModelConfig
    from meshtrain.services.trainer.config.sections import OptimConfig
    from meshtrain.services.trainer.model.gpt import GPT
    from meshtrain.services.trainer.optim.optimizer import build_optimizer, clip_grad_norm
    from meshtrain.services.trainer.weight_copies import WeightCopies, call_with

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = ModelConfig(**SHAPES[args.shape], seq_length=args.seq)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with device:  # initialized on the device: a CPU init of billions of weights takes minutes
        model = GPT(cfg)
    sync_all(device)
    _log(f"{args.shape}: model built on {device} in {time.perf_counter() - t0:.1f} s")
    # offloaded: bf16 parameters (the trainer's optim.offload_bf16_params under train.bf16);
    # their masters are read before the cast, so the model is built in fp32 on the device
    bf16_params = args.offload and cuda
    copies = (
        WeightCopies(model, torch.bfloat16, fuse_weight_grads=True)
        if cuda and not bf16_params
        else None
    )
    optimizer = build_optimizer(
        model,
        OptimConfig(
            lr=1e-4,
            optimizer_cpu_offload=args.offload,
            overlap_cpu_optimizer_d2h_h2d=args.offload and not args.no_overlap,
        ),
        bf16_params=bf16_params,
    )
    sync_all(device)
    build_s = time.perf_counter() - t0
    _log(f"{args.shape}: optimizer built, {build_s:.1f} s in all")
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), generator=gen).to(device)
        for _ in range(args.micro_batches)
    ]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step() -> float:
        if copies is not None:
            copies.refresh()
        total = 0.0
        for tokens in batches:
            with autocast:
                x, y = tokens[:, :-1], tokens[:, 1:]
                if copies is not None:
                    loss = call_with(model, copies.copies, x, y, None)
                else:
                    loss = model(x, y, None)
            (loss / len(batches)).backward()
            total += loss.detach()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    times = []
    for i in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        loss = step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        _log(f"{args.shape} offload={args.offload} step {i}: {time.perf_counter() - start:.3f} s")
    step_s = sum(times) / len(times)
    tokens = args.micro_batches * args.micro_batch * args.seq
    flops = model.flops_per_token()
    out = {
        "shape": args.shape,
        "offload": args.offload,
        "overlap_d2h_h2d": args.offload and not args.no_overlap,
        "bf16_params": bf16_params,
        "parameters": model.num_parameters(),
        "tokens_per_step": tokens,
        "build_s": build_s,
        "step_s": step_s,
        "step_times_s": times,
        "tokens_per_s": tokens / step_s,
        "flops_per_token": flops,
        "mfu": flops * tokens / step_s / PEAK_BF16 if cuda else None,
        "peak_gpu_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
        "loss": float(loss),
        "cpu_threads": torch.get_num_threads(),
    }
    if args.offload:
        out["host_optimizer_gb"] = optimizer.host_bytes() / 1e9
    return out


# ---------------------------------------------------------------- the driver
def spawn(args: argparse.Namespace, shape: str, offload: bool, cap: float) -> dict:
    """Run one case in a subprocess within `cap` seconds; its result, or why there is none."""
    cmd = [
        sys.executable,
        __file__,
        "--case",
        shape,
        "--device",
        args.device,
        "--seq",
        str(args.seq),
        "--micro-batch",
        str(args.micro_batch),
        "--micro-batches",
        str(args.micro_batches),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    if offload:
        cmd.append("--offload")
    if args.no_overlap:
        cmd.append("--no-overlap")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    base = {"shape": shape, "offload": offload}
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=max(cap, 1.0), check=False
        )
    except subprocess.TimeoutExpired as e:
        tail = e.stdout or b""
        tail = tail.decode() if isinstance(tail, bytes) else tail
        return {**base, "error": f"over its time cap of {cap:.0f} s", "log_tail": tail[-800:]}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    text = done.stdout + done.stderr
    why = "out of memory" if "OutOfMemoryError" in text or "out of memory" in text else "failed"
    return {**base, "error": f"{why} (exit {done.returncode})", "log_tail": text[-1200:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("optimizer_offload.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--sizes", default="llama-1b,llama-3b", help="shapes measured with and without offload"
    )
    ap.add_argument(
        "--largest",
        default="llama-8b,llama-8b-16L",
        help="shapes tried in this order (largest first) with offload until one trains",
    )
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4, help="per step (accumulated)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-overlap", action="store_true", help="offload without chunked overlap")
    ap.add_argument(
        "--host-memory-gb",
        type=float,
        help="host memory the offloaded state may take (unset: MemAvailable of /proc/meminfo)",
    )
    ap.add_argument("--case-cap-s", type=float, default=45.0, help="time cap of a --sizes case")
    ap.add_argument(
        "--largest-cap-s",
        type=float,
        default=150.0,
        help="time cap of a --largest case (the 8B's build, host allocation and steps)",
    )
    ap.add_argument("--time-budget-s", type=float, default=170.0, help="for the whole run")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for name in [args.case] if args.case else args.sizes.split(",") + args.largest.split(","):
        if name and name not in SHAPES:
            ap.error(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")

    if args.case:  # the subprocess: one case, its result on the last line
        args.shape = args.case
        print("RESULT " + json.dumps(run_case(args)), flush=True)
        return

    import torch

    deadline = time.monotonic() + args.time_budget_s
    gpu_total = (
        torch.cuda.get_device_properties(0).total_memory
        if args.device == "cuda" and torch.cuda.is_available()
        else None
    )
    report: dict = {
        "device": torch.cuda.get_device_name(0) if gpu_total else args.device,
        "gpu_memory_gb": gpu_total / 1e9 if gpu_total else None,
        "host_available_gb": (host_available() or 0) / 1e9,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "peak_flops": PEAK_BF16,
        "flops_counted": "GPT.flops_per_token: 6 x parameters + attention's 12 x layers x "
        "hidden x seq, per token",
        "settings": {
            k: getattr(args, k)
            for k in ("seq", "micro_batch", "micro_batches", "steps", "warmup", "no_overlap")
        },
        "cases": [],
        "ratios": {},
        "largest_offloaded": None,
    }

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=2))

    def fits(shape: str, offload: bool) -> str | None:
        """Why the case cannot run here (None: try it)."""
        n, largest = parameters(shape)
        host = args.host_memory_gb * 1e9 if args.host_memory_gb else host_available()
        # the masters and moments, two staging buffers of the largest chunk (a parameter is
        # never split: the vocabulary's tables), and the process itself
        need = n * HOST_BYTES_PER_PARAM + 2 * 4 * max(largest, 32 * 2**20) + 3e9
        if offload and host is not None and need > 0.95 * host:
            return (
                f"its offloaded state needs {need / 1e9:.0f} GB of host memory, "
                f"{host / 1e9:.0f} GB available"
            )
        if gpu_total and n * DEVICE_BYTES_PER_PARAM[offload] > 0.95 * gpu_total:
            return (
                f"its parameters, gradients{'' if offload else ' and moments'} need "
                f"{n * DEVICE_BYTES_PER_PARAM[offload] / 1e9:.0f} GB of the GPU's "
                f"{gpu_total / 1e9:.0f} GB"
            )
        return None

    def case(shape: str, offload: bool, cap: float | None = None) -> dict:
        for c in report["cases"]:  # a shape in both --largest and --sizes runs once
            if c["shape"] == shape and c["offload"] == offload:
                return c
        cap = args.case_cap_s if cap is None else cap
        left = deadline - time.monotonic()
        why = fits(shape, offload)
        if why is not None:
            r = {"shape": shape, "offload": offload, "skipped": why}
        elif left < 5:
            r = {"shape": shape, "offload": offload, "skipped": "out of the time budget"}
        else:
            _log(f"{shape} offload={offload} (cap {min(cap, left):.0f} s)")
            r = spawn(args, shape, offload, min(cap, left))
        _log(json.dumps({k: v for k, v in r.items() if k not in ("log_tail", "step_times_s")}))
        report["cases"].append(r)
        save()
        return r

    for shape in [s for s in args.largest.split(",") if s]:
        if "tokens_per_s" in case(shape, True, args.largest_cap_s):
            if fits(shape, False) is None:  # and without offload, where the GPU may hold it
                case(shape, False, args.largest_cap_s)
            break
    for shape in [s for s in args.sizes.split(",") if s]:
        plain = case(shape, False)
        off = case(shape, True)
        if "tokens_per_s" in plain and "tokens_per_s" in off:
            report["ratios"][shape] = {
                "tokens_per_s_offload_over_plain": off["tokens_per_s"] / plain["tokens_per_s"],
                "peak_gpu_memory_offload_over_plain": (
                    off["peak_gpu_memory_gb"] / plain["peak_gpu_memory_gb"]
                    if plain.get("peak_gpu_memory_gb")
                    else None
                ),
            }
        save()
    trained = [c for c in report["cases"] if c["offload"] and "tokens_per_s" in c]
    if trained:
        best = max(trained, key=lambda c: c["parameters"])
        report["largest_offloaded"] = {
            k: best[k] for k in ("shape", "parameters", "tokens_per_s", "peak_gpu_memory_gb")
        }
    save()
    _log(f"done: {args.out}")


if __name__ == "__main__":
    main()
