"""Is the training step host-bound? Host time per step against the wall clock, and blocking calls.

    python3 benchmarks/host_time.py --config deploy/configs/gpt2-125m.toml --out host.json \
        [overrides]

Runs meshtrain's own step (`Trainer.train_step`) and times it on the host without
synchronizing. When the host runs ahead, its time per step still equals the device's, because
CUDA's launch queue fills and blocks it; host time well under the wall time means the device
waits for the host. Then it profiles two steps with host and device activity and lists the CUDA
runtime calls that can block the host (synchronizations, blocking copies, pinned or device
allocations), with their count and host time: none should appear inside a step.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.common.logging import setup_logging
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import Trainer

BLOCKING = (
    "Synchronize",
    "cudaMemcpy",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaMallocHost",
    "cudaFree",
    "cudaMalloc",
    "cudaHostRegister",
)
"""Substrings of CUDA runtime calls that can wait for the device (the async variants
excluded below)."""


def blocking_calls(trainer: Trainer, first: int, steps: int) -> dict[str, dict]:
    """CUDA runtime calls that may block the host during `steps` profiled steps:
    {name: count, ms}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(first, first + steps):
            trainer.train_step(i)
    calls: dict[str, dict] = collections.defaultdict(lambda: {"count": 0, "ms": 0.0})
    for e in prof.events():
        if is_blocking(e.name):
            calls[e.name]["count"] += 1
            calls[e.name]["ms"] += e.cpu_time_total / 1e3
    return dict(calls)


def is_blocking(name: str) -> bool:
    """Whether a CUDA runtime call of this name can wait for the device."""
    return name.startswith("cuda") and any(b in name for b in BLOCKING) and "Async" not in name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (compile, allocator)")
    p.add_argument("--run-dir", default="runs/host_time")
    p.add_argument("--out", default="host_time.json")
    args, overrides = p.parse_known_args()
    setup_logging("WARNING")
    iters = args.warmup + args.steps + 2
    job = load_config(
        [
            "--config",
            args.config,
            "--train-iters",
            str(iters),
            "--eval-interval",
            "0",
            "--run-dir",
            args.run_dir,
            *overrides,
        ]
    )
    trainer = Trainer(job)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    for i in range(args.warmup):
        trainer.train_step(i)
    sync()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        trainer.train_step(i)
    host = time.perf_counter() - start
    sync()
    wall = time.perf_counter() - start
    calls = blocking_calls(trainer, args.warmup + args.steps, 2)
    result = {
        "config": args.config,
        "overrides": overrides,
        "steps": args.steps,
        "device": str(trainer.device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "host_ms_per_step": host / args.steps * 1e3,
        "wall_ms_per_step": wall / args.steps * 1e3,
        "blocking_calls_in_2_steps": calls,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"{args.config}: host {result['host_ms_per_step']:.1f} ms/step, "
        f"wall {result['wall_ms_per_step']:.1f} ms/step"
    )
    print(
        "blocking CUDA runtime calls in 2 profiled steps:",
        ", ".join(f"{n} x{c['count']} ({c['ms']:.2f} ms)" for n, c in calls.items()) or "none",
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
