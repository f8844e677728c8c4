"""Where a GPU training step's time goes: kernels by kind, device idle, exposed communication.

`profile_steps` runs a few steps under torch.profiler (CUPTI kernel records) and reduces them
to one table per step:

    wall          the steps' wall time (synchronized before and after)
    busy / idle   time the GPU had any kernel or copy running (union over streams) / did not:
                  idle is host-bound time (launch overhead, Python, synchronization)
    per kind      summed kernel time of GEMMs, attention, communication, Inductor's fused
                  Triton kernels, meshtrain's own Triton kernels, the optimizer, other aten
                  kernels, copies (kinds can overlap one another on different streams)
    comm exposed  communication time with no compute kernel running beside it: what overlap
                  could still hide
    where         exposed communication by collective kernel, and the longest idle gaps and
                  exposed stretches with their offset from the first kernel (with one profiled
                  step: where in the step they fall, e.g. the gradient reduction's tail)

    from benchmarks.step_breakdown import profile_steps, format_breakdown
    result = profile_steps(lambda i: trainer.train_step(i), first_step=20, steps=2, device=dev)
    print(format_breakdown("meshtrain", result))

Without a GPU the same reduction runs over the leaf host ops (aten calls, gloo collectives): a
smoke run of the plumbing, not a kernel profile. `benchmarks/train_throughput.py
--profile-steps K` uses this for both meshtrain and the baseline.
"""

from __future__ import annotations

import bisect
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# (kind, pattern) in order: the first match wins. GPU kernel names (cuBLAS, cuDNN, flash,
# NCCL, Inductor, ours) and, for the host-op fallback, aten / c10d op names. Inductor's kernels
# come first: it names a fused kernel after the ops in it ("..._scaled_dot_product_..._transpose",
# "..._all_gather_into_tensor_..." for a collective's input copy), which are not attention or comm.
KINDS: list[tuple[str, re.Pattern]] = [
    ("inductor triton", re.compile(r"^triton_(poi|red|per)_")),
    (
        "meshtrain triton",
        re.compile(r"^_(gelu|swiglu|rms_norm|layer_norm|rope|ce|stats|grad)_?\w*$"),
    ),
    (
        "comm",
        re.compile(
            r"nccl|gloo|c10d|all_?gather|reduce_?scatter|all_?reduce|allgather|reducescatter"
            # not inside a word: a cutlass GEMM's epilogue is named "...Sm90RowBroadcast..."
            r"|(?<![a-z])broadcast|record_param_comms|symm|memcpy ptop|memcpy peer",
            re.IGNORECASE,
        ),
    ),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|_efficient_attention", re.IGNORECASE)),
    (
        "gemm",
        re.compile(
            r"gemm|nvjet|xmma|cutlass|cublas|triton_tem|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"
            r"|^sm\d+_",
            re.IGNORECASE,
        ),
    ),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|^aten::_foreach", re.IGNORECASE)),
    (
        "copy",
        re.compile(
            r"memcpy|memset|copy_|^aten::(copy_|to|_to_copy|contiguous|clone)$", re.IGNORECASE
        ),
    ),
    ("other aten", re.compile(r"elementwise|reduce_kernel|vectorized|^aten::", re.IGNORECASE)),
]
KIND_NAMES = [k for k, _ in KINDS] + ["other"]


def classify(name: str) -> str:
    """The kind of a kernel (or, off the GPU, a host op) from its name."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(merged: Sequence[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged)


def subtract(
    a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The parts of union `a` that union `b` does not cover (both from `merge`)."""
    out = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cur = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def gaps(merged: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The holes between consecutive intervals of a union."""
    return [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]


def overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of the intersection of two unions (each from `merge`)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class Span:
    """One kernel (or host op) with its start and end in microseconds."""

    name: str
    start_us: float
    end_us: float


def breakdown(
    spans: Sequence[Span], wall_us: float, steps: int, source: str = "gpu kernels"
) -> dict:
    """Reduce spans recorded over `steps` steps of `wall_us` total to per-step milliseconds.

    Returns:
        {"source", "wall_ms", "busy_ms", "idle_ms", "kinds": {kind: ms}, "comm_ms",
         "comm_exposed_ms", "top": [(name, ms), ...], "exposed_by_comm": [(name, ms), ...],
         "idle_gaps": [(at_ms, ms), ...], "exposed_stretches": [(at_ms, ms), ...]} per step;
        kinds sum kernel time, so with streams running side by side they can add up to more than
        busy, and so can exposed_by_comm (two collectives side by side, neither beside compute) add
        up to more than comm_exposed_ms. The gaps and stretches are the longest few over the whole
        window (not per step), at_ms counted from its first span; the gaps are those between spans
        (idle before the first span or after the last one counts in idle_ms only).
    """
    per = 1e3 * steps  # us over all steps -> ms per step
    kinds = dict.fromkeys(KIND_NAMES, 0.0)
    by_name: dict[str, float] = {}
    comm, compute = [], []
    for s in spans:
        kind = classify(s.name)
        dur = s.end_us - s.start_us
        kinds[kind] += dur
        by_name[s.name] = by_name.get(s.name, 0.0) + dur
        (comm if kind == "comm" else compute).append((s.start_us, s.end_us))
    busy_u = merge(comm + compute)
    busy = length(busy_u)
    comm_u, compute_u = merge(comm), merge(compute)
    comm_total = length(comm_u)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:30]
    exposed_by: dict[str, float] = {}
    starts = [a for a, _ in compute_u]
    for sp in spans:  # each collective's own time with no compute beside it
        if classify(sp.name) == "comm":
            first = max(
                bisect.bisect_right(starts, sp.start_us) - 1, 0
            )  # the compute interval it starts in or after
            beside = overlap([(sp.start_us, sp.end_us)], compute_u[first:])
            exposed_by[sp.name] = exposed_by.get(sp.name, 0.0) + sp.end_us - sp.start_us - beside
    origin = busy_u[0][0] if busy_u else 0.0

    def longest(intervals, n=5):
        ranked = sorted(intervals, key=lambda iv: iv[0] - iv[1])[:n]
        return [((a - origin) / 1e3, (b - a) / 1e3) for a, b in ranked]

    return {
        "source": source,
        "wall_ms": wall_us / per,
        "busy_ms": busy / per,
        "idle_ms": max(wall_us - busy, 0.0) / per,
        "kinds": {k: v / per for k, v in kinds.items() if v > 0},
        "comm_ms": comm_total / per,
        "comm_exposed_ms": (comm_total - overlap(comm_u, compute_u)) / per,
        "top": [(n, v / per) for n, v in top],
        "exposed_by_comm": [
            (n, v / per) for n, v in sorted(exposed_by.items(), key=lambda kv: -kv[1])[:6] if v > 0
        ],
        "idle_gaps": longest(gaps(busy_u)),
        "exposed_stretches": longest(subtract(comm_u, compute_u)),
    }


def _outermost_op(e) -> bool:
    """An aten or c10d op not called from inside another one (host-op fallback)."""
    if not e.name.startswith(("aten::", "c10d::", "gloo:")):
        return False
    parent = e.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "c10d::", "gloo:")):
            return False
        parent = parent.cpu_parent
    return True


def spans_from_profile(prof, on_gpu: bool) -> list[Span]:
    """Device kernels and copies (on a GPU), else the outermost aten/c10d host ops."""
    from torch.autograd import DeviceType

    spans = []
    for e in prof.events():
        keep = (
            e.device_type == DeviceType.CUDA
            if on_gpu
            else e.device_type == DeviceType.CPU and _outermost_op(e)
        )
        if keep:
            spans.append(Span(e.name, e.time_range.start, e.time_range.end))
    return spans


def profile_steps(
    step_fn: Callable[[int], object],
    first_step: int,
    steps: int,
    device: torch.device,
    trace_path: str | None = None,
) -> dict:
    """Run `step_fn(i)` for i in [first_step, first_step + steps) under the profiler.

    Args:
        step_fn: one optimizer step (already warmed up and compiled).
        first_step: the step index to start at.
        steps: how many steps to profile (2-3 is plenty; a trace grows with each).
        device: where the steps run; CUDA profiles kernels, anything else host ops.
        trace_path: also write a Chrome trace there (open in Perfetto).
    """
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    # On a GPU only CUPTI's kernel records: recording every host op as well would slow the host
    # side and show as idle device time that an unprofiled step does not have.
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]

    def sync():
        if on_gpu:
            torch.cuda.synchronize(device)

    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(first_step, first_step + steps):
            step_fn(i)
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return breakdown(
        spans_from_profile(prof, on_gpu),
        wall_us,
        steps,
        "gpu kernels" if on_gpu else "host ops (no GPU)",
    )


def format_breakdown(title: str, r: dict) -> str:
    """A short table of one breakdown (ms per step and % of wall)."""
    wall = r["wall_ms"]

    def row(label: str, ms: float) -> str:
        return f"  {label:<22}{ms:>10.2f}{100 * ms / wall if wall else 0:>8.1f}%"

    lines = [
        f"{title}: where a step goes ({r['source']}), ms per step",
        row("wall (profiled)", wall),
        row("busy (any kernel)", r["busy_ms"]),
        row("idle (host-bound)", r["idle_ms"]),
    ]
    if "timed_ms" in r:  # the same step unprofiled: how much the profiler itself added
        lines.insert(1, row("step (unprofiled)", r["timed_ms"]))
    lines += [row(k, r["kinds"][k]) for k in KIND_NAMES if k in r["kinds"]]
    lines += [row("comm (union)", r["comm_ms"]), row("comm exposed", r["comm_exposed_ms"])]
    lines.append("  top kernels: " + "; ".join(f"{n[:60]} {ms:.2f}" for n, ms in r["top"][:6]))
    if r.get("exposed_by_comm"):
        lines.append(
            "  exposed comm by kernel: "
            + "; ".join(f"{n[:60]} {ms:.2f}" for n, ms in r["exposed_by_comm"])
        )
    for key, label in (
        ("idle_gaps", "longest idle gaps"),
        ("exposed_stretches", "longest exposed comm"),
    ):
        if r.get(key):
            lines.append(
                f"  {label} (at ms: ms): " + ", ".join(f"{at:.1f}: {ms:.2f}" for at, ms in r[key])
            )
    return "\n".join(lines)
