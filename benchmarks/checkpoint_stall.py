"""Training stall of an async checkpoint save, in ms per GB of per-rank state.

    python benchmarks/checkpoint_stall.py --mb 1024 --out result.json     # CUDA if available

Builds `--mb` MB of bf16 per-layer boxes of `--box-mb` each on the device (CUDA when available, else
CPU) and saves them `--repeat` times with `AsyncSaver` to a local temp folder. The stall is what
`save()` blocks for: the copy into reused host buffers (pinned on CUDA); the upload runs behind it
and is waited for before the next save, outside the timed part. The first save (which allocates and
pins the buffers) is reported separately. For reference it also times a bare `copy_` of the same
tensors into the same buffers, the floor the stall can reach.

Then the same saves with `AsyncSaver.prepare` (what a run that will save does once its model is
built): a second saver's buffers are allocated on a background thread while the device runs a
stand-in training loop (bf16 8192x8192 matmuls); reported: that loop's time per iteration while
the buffers are being allocated against after (the price of preparing, if any), how long the
allocation took, and the first save's stall once prepared against the steady state.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.checkpoint.async_save import AsyncSaver, StorageSink
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.multiwriter import begin_save

COLS = 1024  # each box is one bf16 (rows, COLS) slice of a stacked array


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=512, help="per-rank state in MB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--box-mb", type=float, default=8, help="size of each bf16 box (one per layer slice)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--local-dir", default=None, help="where uploads go (default: a temp dir)")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()

    rows = max(1, round(args.box_mb * 2**20 / (COLS * 2)))
    layers = max(1, round(args.mb * 2**20 / (rows * COLS * 2)))
    full = torch.randn(layers, rows, COLS, device=args.device).to(torch.bfloat16)
    boxes = [
        (
            ShardSpec("layers.w", tuple(full.shape), "bfloat16", (i, 0, 0), (1, rows, COLS)),
            full[i : i + 1],
        )
        for i in range(layers)
    ]
    gb = full.numel() * 2 / 1e9
    with tempfile.TemporaryDirectory(dir=args.local_dir) as tmp:
        root = os.path.join(tmp, "ckpt")
        saver = AsyncSaver(StorageSink(root))
        stalls, persists = [], []
        for step in range(args.repeat + 1):
            save_id = begin_save(root, step)
            start = time.perf_counter()
            saver.save(step, save_id, boxes, committer=True)
            stalls.append(saver.last_stall_s)
            saver.wait()
            persists.append(time.perf_counter() - start)
        # The floor: the same copies into the same (already allocated) buffers.
        buffers = [saver._buffers[(spec.array, spec.offsets)] for spec, _ in boxes]
        copies = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for buf, (_, t) in zip(buffers, boxes):
                buf.copy_(t, non_blocking=saver.pin)
            if saver.pin:
                torch.cuda.synchronize()
            copies.append(time.perf_counter() - start)
        saver.close()

    prepared = measure_prepared(boxes, args) if saver.pin else None
    steady = stalls[1:]
    result = {
        "device": args.device,
        "pinned": saver.pin,
        "gb": gb,
        "first_stall_ms_per_gb": stalls[0] * 1e3 / gb,
        "stall_ms_per_gb_best": min(steady) * 1e3 / gb,
        "stall_ms_per_gb_median": statistics.median(steady) * 1e3 / gb,
        "bare_copy_ms_per_gb_best": min(copies) * 1e3 / gb,
        "persist_MBps_best": gb * 1e3 / min(persists[1:]),
    }
    if prepared is not None:
        result["prepared"] = {
            **prepared,
            "first_stall_ms_per_gb": prepared["first_stall_s"] * 1e3 / gb,
            "first_over_steady": prepared["first_stall_s"] / statistics.median(steady),
        }
    print(
        f"{'device':<6} {'GB':>6} {'first ms/GB':>12} {'stall ms/GB best':>17} "
        f"{'median':>8} {'bare copy ms/GB':>16} {'persist MB/s':>13}"
    )
    print(
        f"{args.device:<6} {gb:6.2f} {result['first_stall_ms_per_gb']:12.1f} "
        f"{result['stall_ms_per_gb_best']:17.1f} {result['stall_ms_per_gb_median']:8.1f} "
        f"{result['bare_copy_ms_per_gb_best']:16.1f} {result['persist_MBps_best']:13.1f}"
    )
    record = {
        "benchmark": "checkpoint_stall",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "result": result,
    }
    if prepared is not None:
        r = result["prepared"]
        print(
            f"prepared: allocation {r['allocate_s']:.2f} s in the background; first save "
            f"{r['first_stall_ms_per_gb']:.1f} ms/GB = "
            f"{r['first_over_steady']:.2f}x the steady stall; "
            f"device loop {r['loop_ms_while_preparing']:.2f} ms/iter while preparing, "
            f"{r['loop_ms_after']:.2f} after"
        )
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


def measure_prepared(boxes, args) -> dict:
    """A fresh saver prepared in the background while the device computes; then its first save."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def loop_ms(until=None, iters: int = 20) -> tuple[float, int]:
        n, start = 0, time.perf_counter()
        while (until is not None and until()) or (until is None and n < iters):
            for _ in range(4):
                a.copy_((a @ a).mul_(1e-4))
            torch.cuda.synchronize()
            n += 1
        return (time.perf_counter() - start) * 1e3 / max(n, 1), n

    loop_ms()  # warm up
    with tempfile.TemporaryDirectory(dir=args.local_dir) as tmp:
        root = os.path.join(tmp, "ckpt")
        saver = AsyncSaver(StorageSink(root))
        saver.prepare([spec for spec, _ in boxes])
        during, n_during = loop_ms(until=saver._preparing.is_alive)
        saver._preparing.join()
        after, _ = loop_ms()
        saver.save(0, begin_save(root, 0), boxes, committer=True)
        first = saver.last_stall_s
        saver.close()
    return {
        "allocate_s": saver.prepared_s,
        "loop_ms_while_preparing": during,
        "loop_iters_while_preparing": n_during,
        "loop_ms_after": after,
        "first_stall_s": first,
    }


if __name__ == "__main__":
    sys.exit(main())
