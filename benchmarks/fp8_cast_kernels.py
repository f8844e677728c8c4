"""The FP8 cast kernels' achieved bandwidth against a plain copy of the same tensor.

    python benchmarks/fp8_cast_kernels.py --out fp8_cast.json [--no-compile] [--time-budget-s 120]
    python benchmarks/fp8_cast_kernels.py --device cpu --tiny --out t.json   # the CPU smoke run

For each tensor an FP8 llama-1b layer casts (8,192 tokens: micro-batch 4 × 2,048; the QKV/fc1
input, the fc2 input, fc1's output gradient and fc1's weight; bf16) this times, with CUDA events
after warm-up (median of `--iters`), each kernel of `meshtrain.kernels.fp8_cast` through the
dispatch a layer uses: `amax` (fp8_amax), `cast` (FP8 copy only), `cast_transpose` (FP8 copy and
its transpose, a given scale), `cast_transpose_amax` (the same plus the amax: delayed scaling's
one pass), and `tensorwise` (amax, the scale, cast_transpose: current scaling's two kernels).
Achieved bandwidth is the bytes an ideal kernel moves (the input read once, each output written
once) over the time; `frac_of_copy` divides it by the bandwidth of `x.clone()` of the same tensor
timed in the same run (the goal: 0.85 or more). The unfused casts a layer runs with
train.fp8_fused_casts=false (torch amax, cast, transposing copy) are timed eagerly
(`unfused_eager`) and under torch.compile (`unfused_compiled`, what a compiled model ran), and
`speedup_vs_*` is their time over `tensorwise`'s. JSON is written after each tensor, so a run
cut short keeps what it measured; cases left when `--time-budget-s` is spent are listed as
skipped. Then the producers of an FP8 linear's input (RMSNorm, LayerNorm,
SwiGLU, GELU) that write their output's FP8 copy in the same kernel (kernels/norm_fp8.py,
kernels/activation_fp8.py), forward only: `plain` (the op alone), `fused_delayed` (y, q and the
amax, a given scale) against `unfused_delayed` (the op, then the cast kernel with the amax),
`fused_amax` (y and its amax: current scaling's producer) against `unfused_amax` (the op, then
fp8_amax), each with its bandwidth against a copy of the op's input; `speedup_*` are the unfused
times over the fused. The full FP8 training step, fused against unfused against bf16, is
benchmarks/train_throughput.py with `--variant` (BENCHMARKS.md, "FP8, one GPU").

Two times per kernel on CUDA: `ms`, one call between two events (what an eager layer waits,
the host's launch included: a Triton launch from Python costs tens of microseconds, as long as
the kernel itself at these sizes), and `device_ms`, `--graph-calls` calls captured in one CUDA
graph and replayed (the kernels alone, back to back, no host in between: what the kernel
achieves, and what a layer gets once the GPU runs ahead of the host). `device_frac_of_copy` is
the goal's measure; `null` where a call cannot be captured (and on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CASES = {  # name: (rows, cols) of the bf16 tensor cast, llama-1b at 8,192 tokens
    "qkv_fc1_input": (8192, 2048),
    "fc2_input": (8192, 5632),
    "fc1_grad_output": (8192, 11264),
    "fc1_weight": (11264, 2048),
}
TINY = {"tiny_input": (48, 40), "tiny_weight": (24, 40)}
PRODUCERS = {  # op: (rows, input cols) of the bf16 input, llama-1b (GPT-2 style for the others)
    "rms_norm": (8192, 2048),
    "layer_norm": (8192, 2048),
    "swiglu": (8192, 11264),  # [gate | up] of ffn 5632
    "gelu": (8192, 8192),
}
TINY_PRODUCERS = {"rms_norm": (48, 40), "swiglu": (48, 80)}


def _graph_timer(device: str, iters: int, calls: int):
    """Per-call device time of `fn` replayed from a CUDA graph of `calls` calls (None off CUDA,
    or where capture fails); `fn` has run before, so autotuning is done."""
    import torch

    def device_ms(fn) -> float | None:
        if device != "cuda" or calls < 1:
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # on the capture stream once, as torch.cuda.graph asks
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
        except Exception as e:  # noqa: BLE001 - report which call could not be captured
            print(f"  (not captured: {type(e).__name__}: {str(e)[:120]})", flush=True)
            return None
        graph.replay()
        samples = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        del graph
        return statistics.median(samples)

    return device_ms


def _stats(kernels: dict, time_ms, device_ms) -> dict:
    """Each kernel timed both ways, with bandwidth against the same run's copy."""
    out = {}
    for kernel, (fn, nbytes) in kernels.items():
        ms = time_ms(fn)
        dev = device_ms(fn)
        out[kernel] = {
            "ms": ms,
            "bytes": nbytes,
            "gbps": nbytes / ms / 1e6,
            "device_ms": dev,
            "device_gbps": None if dev is None else nbytes / dev / 1e6,
        }
    copy = out["copy"]
    for stats in out.values():
        stats["frac_of_copy"] = stats["gbps"] / copy["gbps"]
        both = stats["device_gbps"] is not None and copy["device_gbps"] is not None
        stats["device_frac_of_copy"] = stats["device_gbps"] / copy["device_gbps"] if both else None
    return out


def _print(kernels: dict) -> None:
    for kernel, st in kernels.items():
        dev = (
            f"   device {st['device_ms']:8.4f} ms {st['device_frac_of_copy']:6.1%} of copy"
            if st["device_frac_of_copy"] is not None
            else ""
        )
        print(
            f"  {kernel:22s} {st['ms']:8.4f} ms {st['gbps']:8.1f} GB/s "
            f"{st['frac_of_copy']:6.1%} of copy{dev}",
            flush=True,
        )


def _timer(device: str, iters: int, warmup: int):
    import torch

    def time_ms(fn) -> float:
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    return time_ms


def measure(
    name: str, shape, device: str, iters: int, warmup: int, use_compile: bool, calls: int
) -> dict:
    import torch

    from meshtrain.kernels import dispatch
    from meshtrain.services.trainer.fp8.scaling import amax_to_scale, cast_transpose, tensor_amax

    time_ms = _timer(device, iters, warmup)
    fmt = torch.float8_e4m3fn
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    n, e = x.numel(), x.element_size()
    scale = amax_to_scale(tensor_amax(x, False), 448.0)

    def tensorwise(fused: bool):
        s = amax_to_scale(tensor_amax(x, fused), 448.0)
        return cast_transpose(x, s, fmt, fused)

    kernels = {  # name: (call, bytes moved)
        "copy": (lambda: x.clone(), 2 * n * e),
        "amax": (lambda: dispatch.fp8_amax(x), n * e),
        "cast": (lambda: dispatch.fp8_cast_transpose(x, scale, fmt, False), n * e + n),
        "cast_transpose": (lambda: dispatch.fp8_cast_transpose(x, scale, fmt), n * e + 2 * n),
        "cast_transpose_amax": (
            lambda: dispatch.fp8_cast_transpose(x, scale, fmt, True, True),
            n * e + 2 * n,
        ),
        "tensorwise": (lambda: tensorwise(True), 2 * n * e + 2 * n),
        "unfused_eager": (lambda: tensorwise(False), 2 * n * e + 2 * n),
    }
    if use_compile:
        compiled = torch.compile(lambda: tensorwise(False))
        kernels["unfused_compiled"] = (compiled, 2 * n * e + 2 * n)
    row: dict = {"shape": list(shape), "dtype": "bfloat16", "fp8": "e4m3"}
    row["kernels"] = _stats(kernels, time_ms, _graph_timer(device, iters, calls))
    fused_ms = row["kernels"]["tensorwise"]["ms"]
    for other in ("unfused_eager", "unfused_compiled"):
        if other in row["kernels"]:
            row[f"speedup_vs_{other}"] = row["kernels"][other]["ms"] / fused_ms
    return row


def measure_producer(op: str, shape, device: str, iters: int, warmup: int, calls: int) -> dict:
    """A norm or activation that writes its output's FP8 copy (kernels/norm_fp8.py,
    kernels/activation_fp8.py) against the plain op followed by the cast kernel, forward only."""
    import torch

    from meshtrain.kernels import dispatch

    time_ms = _timer(device, iters, warmup)
    fmt = torch.float8_e4m3fn
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    width = shape[1] // 2 if op == "swiglu" else shape[1]
    w = torch.ones(width, device=device, dtype=torch.bfloat16)
    b = torch.zeros(width, device=device, dtype=torch.bfloat16)
    scale = torch.tensor(1.0, device=device)
    plain, fused = {
        "rms_norm": (
            lambda: dispatch.rms_norm(x, w, 1e-5),
            lambda s: dispatch.rms_norm_fp8(x, w, 1e-5, s, fmt),
        ),
        "layer_norm": (
            lambda: dispatch.layer_norm(x, w, b, 1e-5),
            lambda s: dispatch.layer_norm_fp8(x, w, b, 1e-5, s, fmt),
        ),
        "swiglu": (lambda: dispatch.swiglu(x), lambda s: dispatch.swiglu_fp8(x, s, fmt)),
        "gelu": (lambda: dispatch.gelu(x), lambda s: dispatch.gelu_fp8(x, s, fmt)),
    }[op]
    n_in, n_out, e = x.numel(), shape[0] * width, x.element_size()

    def unfused_delayed():
        return dispatch.fp8_cast_transpose(plain(), scale, fmt, False, True)

    def unfused_tensorwise():
        return dispatch.fp8_amax(plain())

    kernels = {  # name: (call, bytes an ideal kernel moves)
        "copy": (lambda: x.clone(), 2 * n_in * e),
        "plain": (plain, (n_in + n_out) * e),
        "fused_delayed": (lambda: fused(scale), (n_in + n_out) * e + n_out),
        "unfused_delayed": (unfused_delayed, (n_in + n_out) * e + n_out),
        "fused_amax": (lambda: fused(None), (n_in + n_out) * e),
        "unfused_amax": (unfused_tensorwise, (n_in + n_out) * e),
    }
    row: dict = {"shape": list(shape), "dtype": "bfloat16", "fp8": "e4m3"}
    with torch.no_grad():
        row["kernels"] = _stats(kernels, time_ms, _graph_timer(device, iters, calls))
    k = row["kernels"]
    row["speedup_delayed"] = k["unfused_delayed"]["ms"] / k["fused_delayed"]["ms"]
    row["speedup_amax"] = k["unfused_amax"]["ms"] / k["fused_amax"]["ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="two tiny tensors (the CPU smoke run)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per kernel")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    parser.add_argument("--no-compile", action="store_true", help="skip unfused_compiled")
    parser.add_argument("--time-budget-s", type=float, default=120.0)
    parser.add_argument(
        "--graph-calls", type=int, default=10, help="calls per CUDA graph for device_ms (0: skip)"
    )
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --tiny)")
    began = time.perf_counter()
    report: dict = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "goal_frac_of_copy": 0.85,
        "iters": args.iters,
        "cases": {},
        "producers": {},
        "skipped": [],
    }
    cases = TINY if args.tiny else CASES
    for name, shape in cases.items():
        if time.perf_counter() - began > args.time_budget_s:
            report["skipped"].append(name)
            continue
        print(f"fp8 casts: {name} {shape} ...", flush=True)
        row = measure(
            name, shape, args.device, args.iters, args.warmup, not args.no_compile, args.graph_calls
        )
        report["cases"][name] = row
        _print(row["kernels"])
        report["elapsed_s"] = time.perf_counter() - began
        args.out.write_text(json.dumps(report, indent=2))
    for op, shape in (TINY_PRODUCERS if args.tiny else PRODUCERS).items():
        if time.perf_counter() - began > args.time_budget_s:
            report["skipped"].append(op)
            continue
        print(f"fp8 producers: {op} {shape} ...", flush=True)
        row = measure_producer(op, shape, args.device, args.iters, args.warmup, args.graph_calls)
        report["producers"][op] = row
        _print(row["kernels"])
        report["elapsed_s"] = time.perf_counter() - began
        args.out.write_text(json.dumps(report, indent=2))
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({time.perf_counter() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
