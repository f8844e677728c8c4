"""Peak GPU memory of a training step by the allocating line: meshtrain vs the plain baseline.

    python benchmarks/memory_breakdown.py --config deploy/configs/gpt2-125m.toml --out mem.json \
        [--top 25]

For each side, in one process one after the other: the CUDA caching allocator's history is
recorded (`torch.cuda.memory._record_memory_history`) from before the model is built, warm-up
steps run (compilation, autotuning, the allocator settling), then one step. The trace is
replayed to the highest allocated total inside that step, and the blocks alive there are
grouped by where they were allocated:
- `site`: the first frame outside torch and the standard library. For a compiled graph that
  is a line of Inductor's generated code (`buf12 = empty_strided_cuda(...)`), shown with its
  source text; blocks with no such frame (the autograd engine accumulating `.grad` in C++)
  group as "(no Python frame)".
- `owner`: the first frame in this repository above it (the module or optimizer that ran
  the compiled graph).
Prints each side's largest groups and writes every group as JSON. Allocation totals follow
`torch.cuda.memory_allocated`: a block counts from its allocation to its free request. A
1-GPU tool (run it without torchrun); it needs CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import linecache
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.train_throughput import BF16_RESIDUAL, PLAIN, baseline_step, meshtrain_step  # noqa: E402
from meshtrain.services.common.logging import setup_logging  # noqa: E402

REPO = str(Path(__file__).resolve().parents[1])
TORCH_DIR = os.path.dirname(torch.__file__)
STDLIB_DIR = sysconfig.get_paths()["stdlib"]
NO_FRAME = "(no Python frame)"
MAX_ENTRIES = 4_000_000
"""Trace entries kept. The replay needs every allocation since recording began, so a trace that
reached this many (the allocator's ring buffer then overwrites its oldest) is refused."""


def _library(filename: str) -> bool:
    return filename.startswith((TORCH_DIR, STDLIB_DIR, "<")) or any(
        d in filename for d in ("site-packages", "dist-packages")
    )


def site_and_owner(frames: list[dict]) -> tuple[str, str]:
    """(site, owner) of an allocation's frames, innermost first (the snapshot's order).

    site: the first frame outside torch, the standard library and installed packages, as
    `file:line function`, with the line's source for generated code (file outside this
    repository). owner: the first frame inside this repository, from the site outwards.
    """
    site, owner = NO_FRAME, ""
    for i, f in enumerate(frames):
        name = f.get("filename", "")
        if _library(name):
            continue
        site = f"{_short(name)}:{f.get('line', 0)} {f.get('name', '')}"
        if not name.startswith(REPO):
            source = linecache.getline(name, f.get("line", 0)).strip()
            if source:
                site += f"  [{source[:120]}]"
        owner = next(
            (
                f"{_short(g['filename'])}:{g.get('line', 0)} {g.get('name', '')}"
                for g in frames[i:]
                if g.get("filename", "").startswith(REPO) and not _library(g["filename"])
            ),
            "",
        )
        break
    return site, owner


def _short(filename: str) -> str:
    return (
        os.path.relpath(filename, REPO) if filename.startswith(REPO) else os.path.basename(filename)
    )


def peak_live(trace: list[dict], start: int, base: int = 0) -> tuple[int, int, dict[int, dict]]:
    """(peak bytes, index of the event reaching it, {address: alloc event} alive there).

    Replays `trace` (the allocator's events, oldest first) from its beginning; only events at
    index `start` or later may set the peak. `base` is what was allocated before recording
    began. A block is freed at its free request (as `memory_allocated` counts) or, when the
    request was not recorded, at its completion.
    """
    live: dict[int, dict] = {}
    total, peak, at = base, -1, -1
    peak_set: dict[int, dict] = {}
    for i, e in enumerate(trace):
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if i >= start and total > peak:
                peak, at = total, i
                peak_set = dict(live)
        elif action in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    if at < 0:
        raise ValueError(
            f"no allocation at or after trace entry {start}: the measured step allocated nothing"
        )
    return peak, at, peak_set


def group(live: dict[int, dict]) -> list[dict]:
    """The blocks in `live` summed by (site, owner), largest first."""
    sums: dict[tuple[str, str], dict] = {}
    for e in live.values():
        key = site_and_owner(e.get("frames", []))
        g = sums.setdefault(key, {"site": key[0], "owner": key[1], "bytes": 0, "blocks": 0})
        g["bytes"] += e["size"]
        g["blocks"] += 1
    return sorted(sums.values(), key=lambda g: -g["bytes"])


def measure(build: Callable[[], Callable[[int], object]], warmup: int) -> dict:
    """Record from before `build()` (which returns step(i)), run `warmup` steps, then one
    step; its peak, grouped."""
    device = torch.cuda.current_device()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(
        "all", context="alloc", stacks="python", max_entries=MAX_ENTRIES
    )
    try:
        step = build()
        for i in range(warmup):
            step(i)
        torch.cuda.synchronize()
        start = len(_trace(device))
        torch.cuda.reset_peak_memory_stats()
        step(warmup)
        torch.cuda.synchronize()
        trace = _trace(device)
        reported = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    finally:
        torch.cuda.memory._record_memory_history(None)
    if len(trace) >= MAX_ENTRIES:
        raise RuntimeError(
            f"the allocator trace reached {MAX_ENTRIES} entries and lost its oldest: "
            "raise MAX_ENTRIES or use fewer warm-up steps"
        )
    peak, at, live = peak_live(trace, start, base)
    groups = group(live)
    return {
        "peak_bytes": peak,
        "max_memory_allocated": reported,
        "max_memory_reserved": reserved,
        "base_bytes": base,
        "trace_entries": len(trace),
        "peak_entry": at,
        "groups": groups,
    }


def _trace(device: int) -> list[dict]:
    snap = torch.cuda.memory._snapshot()
    return snap["device_traces"][device]


def print_groups(name: str, result: dict, top: int) -> None:
    gb = 1e9
    print(
        f"\n{name}: peak {result['peak_bytes'] / gb:.3f} GB from the trace "
        f"(max_memory_allocated {result['max_memory_allocated'] / gb:.3f}, reserved "
        f"{result['max_memory_reserved'] / gb:.3f})"
    )
    print(f"{'GB':>8}{'blocks':>8}  site  <-  owner")
    for g in result["groups"][:top]:
        print(f"{g['bytes'] / gb:>8.3f}{g['blocks']:>8}  {g['site']}  <-  {g['owner']}")
    rest = result["groups"][top:]
    if rest:
        print(
            f"{sum(g['bytes'] for g in rest) / gb:>8.3f}{sum(g['blocks'] for g in rest):>8}  "
            f"({len(rest)} other sites)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument(
        "--warmup", type=int, default=3, help="steps before the measured one (compile, autotune)"
    )
    p.add_argument("--run-dir", default="runs/bench-memory")
    p.add_argument("--out", default="memory_breakdown.json")
    p.add_argument("--top", type=int, default=25, help="groups printed per side (the JSON has all)")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument(
        "--baseline-bf16-residual",
        action="store_true",
        help="the baseline with its residual stream in bf16 (meshtrain's default), not fp32",
    )
    args, overrides = p.parse_known_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the allocator history is CUDA's)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("a 1-GPU tool: run it with python, not torchrun")
    setup_logging("WARNING")
    args.steps, args.rounds = (
        1,
        1,
    )  # meshtrain_step plans the run's length from warmup + rounds x steps
    holder = {}

    def build_meshtrain():
        holder["trainer"], step, _ = meshtrain_step(args, overrides)
        return step

    results = {"meshtrain": measure(build_meshtrain, args.warmup)}
    job = holder.pop("trainer").job
    if not args.skip_baseline:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        spec = BF16_RESIDUAL if args.baseline_bf16_residual else PLAIN
        results["baseline"] = measure(lambda: baseline_step(job, spec)[0], args.warmup)
    for name, r in results.items():
        print_groups(name, r, args.top)
    out = {
        "config": args.config,
        "overrides": overrides,
        "warmup": args.warmup,
        "baseline_bf16_residual": args.baseline_bf16_residual,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
