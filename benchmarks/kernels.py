"""Each Triton kernel against the torch eager reference and torch.compile of the reference.

    python benchmarks/kernels.py --out kernels.json [--no-compile] [--rounds 3] [--budget-s 200]

For every op at a training-sized shape (the ≈1.3B Llama config's tokens per micro-batch) this
times forward and backward separately with `triton.testing.do_bench` (median, L2 flushed
between runs; the best of `--rounds` interleaved rounds, since a shared GPU's noise only adds
time) for four implementations: `triton` (kernels/<op>.py, eager autograd), `triton_compiled`
(torch.compile of the same function: the `meshtrain::<op>` custom-op path a compiled model
takes), `eager` (kernels/reference.py as written) and `compiled` (torch.compile of the
reference). Memory-bound ops report achieved GB/s — the bytes an ideal kernel must move (each
input read once, each output written once), divided by the time — and that as a fraction of a
device-to-device copy (1 GiB) measured in the same run. `dev_frac_of_same_size_copy` divides
instead by a copy moving the op's own bytes: the ceiling for a kernel of a few tens of MB,
which pays a launch's ramp and tail as that copy does. The cross-entropy ops at a 128k
vocabulary also report peak memory of forward + backward. Prints a table and writes
everything to `--out` as JSON.

`ms` is what a Python caller waits per call, so for kernels of a few tens of microseconds it
includes the host's launch overhead (autograd, allocation, Triton's launcher) whenever that
exceeds the GPU time. `dev_ms` is the device's own time per call: the summed durations of the
GPU kernels the call launched (CUDA events recorded by torch.profiler/CUPTI over `--reps`
calls, each after an L2 flush, minus a profile of the flushes alone), so idle gaps while the
host prepares the next launch do not count; that is what a training step pays when the host
runs ahead of the GPU. `dev_gbps` / `dev_frac_of_copy` use it. (A device-only timing through
CUDA-graph replay was tried first and dropped: on torch 2.11 a failed capture left the CUDA
RNG unusable for the rest of the run.)

The norm and RoPE kernels autotune (kernels/_launch.py): every implementation runs forward
and backward once before timing, so tuning is never timed, and the JSON records each tuned
kernel's chosen config (`autotune`). Needs CUDA and Triton; nothing else about the GPU is
assumed. Tuning and torch.compile dominate the runtime; compiling is skipped for the
remaining ops once `--budget-s` is spent (the JSON says so). TRITON_CACHE_AUTOTUNING=1 keeps
tuning results on disk between runs of one machine.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.kernels import reference

BF16 = torch.bfloat16


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn() (do_bench flushes L2 between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


_FLUSH: list[torch.Tensor] = []


def _device_busy_us(calls: Callable[[], None]) -> float:
    """Microseconds of GPU kernel time while `calls()` runs (CUPTI kernel records)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        calls()
        torch.cuda.synchronize()
    return sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )


def device_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """GPU kernel milliseconds per call of fn(), each call after an L2 flush, flushes excluded."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 * 2**20, dtype=torch.int8, device="cuda"))
    flush = _FLUSH[0]

    def run(with_fn: bool):
        def calls():
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()

        return calls

    fn()  # not the first call: lazy allocations and caches settle outside the profile
    both, flushes = _device_busy_us(run(True)), _device_busy_us(run(False))
    return max(0.0, both - flushes) / reps / 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second, in GB/s."""
    src = torch.empty(2**29, dtype=BF16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


@functools.cache
def same_size_copy_ms(nbytes: int) -> float:
    """Device milliseconds of a device-to-device copy moving `nbytes` (half read, half written).

    The ceiling a kernel of that size can reach: a copy of a few tens of MB pays the launch's
    ramp and tail as a kernel does, and so reaches well under the 1 GiB copy's bandwidth.
    """
    src = torch.empty(max(1, nbytes // 4), dtype=BF16, device="cuda")
    dst = torch.empty_like(src)
    return min(device_ms(lambda: dst.copy_(src)) for _ in range(2))


def _triton(op: str) -> Callable:
    return getattr(importlib.import_module(f"meshtrain.kernels.{op}"), op)


def _case(op: str):
    """(inputs builder, fwd bytes, bwd bytes, shape label) for `op` at a training shape."""
    rows = 8 * 2048  # tokens in one micro-batch of the 1.3B config (batch 8, seq 2048)

    def randn(*shape, dtype=BF16, grad=True):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)

    if op == "rms_norm":
        h = 2048
        return (
            lambda: [randn(rows, h), randn(h, dtype=torch.float32), 1e-5],
            2 * rows * h * 2,
            3 * rows * h * 2,
            f"x ({rows}, {h}) bf16, w fp32",
        )
    if op == "layer_norm":
        h = 1024
        return (
            lambda: [randn(rows, h), randn(h), randn(h), 1e-5],
            2 * rows * h * 2,
            3 * rows * h * 2,
            f"x ({rows}, {h}) bf16 + bias",
        )
    if op == "gelu":
        f = 4096
        return (lambda: [randn(rows, f)], 2 * rows * f * 2, 3 * rows * f * 2, f"({rows}, {f}) bf16")
    if op == "swiglu":
        f = 5632
        return (
            lambda: [randn(rows, 2 * f)],
            3 * rows * f * 2,
            5 * rows * f * 2,
            f"({rows}, 2x{f}) bf16",
        )
    if op == "rope":
        b, s, heads, groups, d = 8, 2048, 16, 16, 128
        cos, sin = reference.rope_cos_sin(s, d, 10000.0, device="cuda")

        def build():
            qkv = randn(b, s, heads + 2 * groups, d, grad=False)
            return [
                qkv[:, :, :heads].transpose(1, 2).requires_grad_(),
                cos,
                sin,
            ]  # strided q, as in the model

        n = b * heads * s * d
        return build, 2 * n * 2, 2 * n * 2, f"q ({b}, {heads}, {s}, {d}) bf16, strided"
    if op == "cross_entropy":
        n, v = 8192, 128256
        return (
            lambda: [randn(n, v), torch.randint(0, v, (n,), device="cuda")],
            n * v * 2,
            2 * n * v * 2,
            f"logits ({n}, {v}) bf16",
        )
    if op == "linear_cross_entropy":
        n, h, v, padded = 8192, 2048, 128256, 128512
        return (
            lambda: [
                randn(n, h),
                (0.02 * randn(padded, h, grad=False)).requires_grad_(),
                torch.randint(0, v, (n,), device="cuda"),
                None,
                v,
            ],
            None,
            None,
            f"h ({n}, {h}), w ({padded}, {h}) bf16, vocab {v}",
        )
    raise ValueError(op)


def _differentiable(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def time_fwd_bwd(fn: Callable, args: list) -> tuple[float, float]:
    """(forward ms, backward ms); backward replays one retained autograd graph."""
    fwd = bench(lambda: fn(*args))
    out = fn(*args)
    dy = torch.randn_like(out) if out.dim() else torch.ones_like(out)
    bwd = bench(lambda: torch.autograd.grad(out, _differentiable(args), dy, retain_graph=True))
    return fwd, bwd


def device_fwd_bwd(fn: Callable, args: list) -> tuple[float, float]:
    """(forward, backward) GPU kernel milliseconds per call (`device_ms`)."""
    out = fn(*args)
    dy = torch.randn_like(out) if out.dim() else torch.ones_like(out)
    return (
        device_ms(lambda: fn(*args)),
        device_ms(lambda: torch.autograd.grad(out, _differentiable(args), dy, retain_graph=True)),
    )


def warm(fn: Callable, args: list) -> None:
    """One forward + backward before any timing: autotuning and compilation happen here."""
    out = fn(*args)
    if _differentiable(args):
        torch.autograd.grad(out, _differentiable(args), torch.ones_like(out))
    torch.cuda.synchronize()


def autotune_choices() -> dict[str, str]:
    """Each autotuned kernel's chosen config per tuning key, as loaded so far."""
    import triton

    choices = {}
    for module in (
        "meshtrain.kernels.rms_norm",
        "meshtrain.kernels.layer_norm",
        "meshtrain.kernels.rope",
    ):
        mod = sys.modules.get(module)
        for name, obj in vars(mod).items() if mod else ():
            if isinstance(obj, triton.runtime.Autotuner):
                for key, config in obj.cache.items():
                    choices[f"{module}.{name}{key}"] = str(config)
    return choices


def time_fwd_and_bwd(fn: Callable, args: list) -> float:
    """Milliseconds of forward + backward together (for ops whose forward makes the gradients)."""
    return bench(lambda: torch.autograd.grad(fn(*args), _differentiable(args)))


def peak_memory(fn: Callable, args: list) -> int:
    """Bytes allocated at the peak of one forward + backward, beyond what existed before."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(fn(*args), _differentiable(args))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run(ops: list[str], use_compile: bool, budget_s: float, rounds: int) -> dict:
    start = time.time()
    copy_gbps = max(copy_bandwidth() for _ in range(rounds))
    best: dict[tuple, dict] = {}
    memory, notes = {}, []

    def keep(row):  # the fastest of the rounds: noise on a shared GPU only ever adds time
        key = (row["op"], row["impl"], row["pass"])
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row

    for op in ops:
        build, fwd_bytes, bwd_bytes, label = _case(op)
        impls = {"triton": _triton(op), "eager": getattr(reference, op)}
        if use_compile and time.time() - start < budget_s:
            impls["triton_compiled"] = torch.compile(_triton(op))
            impls["compiled"] = torch.compile(getattr(reference, op))
        elif use_compile:
            notes.append(f"{op}: torch.compile skipped, budget of {budget_s:.0f}s spent")
        ce = op.endswith("cross_entropy")
        for impl, fn in list(impls.items()):
            try:
                warm(fn, build())
            except Exception as e:  # noqa: BLE001 - report the failure, time the others
                notes.append(f"{op}/{impl}: failed in warm-up: {type(e).__name__}: {e}"[:500])
                del impls[impl]
            torch.cuda.empty_cache()
        for _ in range(rounds):  # rounds interleave the implementations
            for impl, fn in impls.items():
                args = build()
                if ce:
                    # the fused op computes its gradients in forward,
                    # so only forward + backward compares
                    ms = time_fwd_and_bwd(fn, args)
                    row = {"op": op, "impl": impl, "shape": label, "pass": "fwd+bwd", "ms": ms}
                    if op == "cross_entropy":
                        row["gbps"] = 3 * args[0].numel() * 2 / ms / 1e6
                    else:
                        n, h = args[0].shape
                        row["tflops"] = (
                            3 * 2 * n * h * args[4] / ms / 1e9
                        )  # logits matmul + its two grads
                    keep(row)
                    if impl not in memory.get(op, {}):
                        memory.setdefault(op, {})[impl] = peak_memory(fn, args)
                else:
                    fwd, bwd = time_fwd_bwd(fn, args)
                    for name, ms, nbytes in (("fwd", fwd, fwd_bytes), ("bwd", bwd, bwd_bytes)):
                        keep(
                            {
                                "op": op,
                                "impl": impl,
                                "shape": label,
                                "pass": name,
                                "ms": ms,
                                "gbps": nbytes / ms / 1e6,
                            }
                        )
                args = None  # free this implementation's inputs before the next one's
                torch.cuda.empty_cache()
        for impl, fn in impls.items():  # device-only time, once per implementation
            args = build()
            if ce:
                passes = {
                    "fwd+bwd": device_ms(
                        lambda: torch.autograd.grad(fn(*args), _differentiable(args))
                    )
                }
            else:
                passes = dict(zip(("fwd", "bwd"), device_fwd_bwd(fn, args)))
            for name, dev in passes.items():
                row = best.get((op, impl, name))
                if row is None or dev <= 0:
                    continue
                row["dev_ms"] = dev
                nbytes = {"fwd": fwd_bytes, "bwd": bwd_bytes}.get(name)
                if not nbytes and op == "cross_entropy":
                    nbytes = 3 * args[0].numel() * 2
                if nbytes:
                    row["dev_gbps"] = nbytes / dev / 1e6
                    row["dev_frac_of_same_size_copy"] = same_size_copy_ms(nbytes) / dev
            args = None
            torch.cuda.empty_cache()
    results = list(best.values())
    lce_module = sys.modules.get("meshtrain.kernels.linear_cross_entropy")
    if lce_module is not None and getattr(lce_module, "_MM_FP32_OUT", None) is not None:
        notes.append(
            f"linear_cross_entropy: fp32 weight-grad accumulation through out_dtype matmuls: "
            f"{lce_module._MM_FP32_OUT}"
        )
    for r in results:
        if "gbps" in r:
            r["frac_of_copy"] = r["gbps"] / copy_gbps
        if "dev_gbps" in r:
            r["dev_frac_of_copy"] = r["dev_gbps"] / copy_gbps
        for base in ("eager", "compiled"):  # speed relative to each baseline, same op and pass
            other = best.get((r["op"], base, r["pass"]))
            if other and r["impl"].startswith("triton"):
                r[f"speedup_vs_{base}"] = other["ms"] / r["ms"]
                if "dev_ms" in r and "dev_ms" in other:
                    r[f"dev_speedup_vs_{base}"] = other["dev_ms"] / r["dev_ms"]
    return dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=importlib.import_module("triton").__version__,
        python=platform.python_version(),
        copy_gbps=copy_gbps,
        rounds=rounds,
        results=results,
        peak_memory_bytes=memory,
        notes=notes,
        autotune=autotune_choices(),
        seconds=time.time() - start,
    )


def print_table(report: dict) -> None:
    print(
        f"{report['device']}  torch {report['torch']}  triton {report['triton']}  "
        f"copy {report['copy_gbps']:.0f} GB/s"
    )
    print(
        f"{'op':<22}{'pass':<9}{'impl':<17}{'ms':>9}{'GB/s':>9}{'%copy':>7}{'TFLOP/s':>9}"
        f"{'x eager':>9}{'x comp':>8}{'dev ms':>9}"
        f"{'dev %copy':>10}{'dev %same':>10}{'dev x comp':>11}"
    )
    for r in report["results"]:
        gbps = f"{r['gbps']:.0f}" if "gbps" in r else ""
        frac = f"{100 * r['frac_of_copy']:.0f}" if "frac_of_copy" in r else ""
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        se = f"{r['speedup_vs_eager']:.2f}" if "speedup_vs_eager" in r else ""
        sc = f"{r['speedup_vs_compiled']:.2f}" if "speedup_vs_compiled" in r else ""
        dev = f"{r['dev_ms']:.3f}" if "dev_ms" in r else ""
        dfrac = f"{100 * r['dev_frac_of_copy']:.0f}" if "dev_frac_of_copy" in r else ""
        dsame = (
            f"{100 * r['dev_frac_of_same_size_copy']:.0f}"
            if "dev_frac_of_same_size_copy" in r
            else ""
        )
        dc = f"{r['dev_speedup_vs_compiled']:.2f}" if "dev_speedup_vs_compiled" in r else ""
        print(
            f"{r['op']:<22}{r['pass']:<9}{r['impl']:<17}{r['ms']:>9.3f}{gbps:>9}{frac:>7}{tf:>9}"
            f"{se:>9}{sc:>8}{dev:>9}{dfrac:>10}{dsame:>10}{dc:>11}"
        )
    for kernel, config in report.get("autotune", {}).items():
        print(f"autotune {kernel}: {config}")
    for op, mem in report["peak_memory_bytes"].items():
        print(f"peak memory {op}: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in mem.items()))
    for note in report["notes"]:
        print("note:", note)
    print(f"total {report['seconds']:.0f}s")


def main() -> None:
    # Backward is replayed many times over one forward (retain_graph): compiled backward
    # graphs must not donate (free and reuse) their saved buffers.
    torch._functorch.config.donated_buffer = False
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON file to write")
    parser.add_argument(
        "--ops", default="rms_norm,layer_norm,gelu,swiglu,rope,cross_entropy,linear_cross_entropy"
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip torch.compile (of the reference and of the Triton custom ops)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds; the fastest is kept")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="stop compiling new baselines after this many seconds (keeps the run under ~4 min)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    report = run(args.ops.split(","), not args.no_compile, args.budget_s, args.rounds)
    print_table(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
