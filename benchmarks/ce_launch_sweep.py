"""The cross-entropy kernels' launch settings: vocabulary block, warps and pipeline stages.

    python benchmarks/ce_launch_sweep.py --out ce_sweep.json [--vocab 128256,50304] [--rows 8192]

`kernels/cross_entropy.py` runs one program per token row, looping over the vocabulary in
blocks (`launch_config`). This times its three kernels under every launch setting of a small
grid, against the current `launch_config` in the same run (the baseline row, ratio 1.0):

* `stats`: the forward pass (the row's max, sum of exponentials and label logit): reads the
  logits once;
* `grad`: the backward pass, (softmax - one_hot) * scale into a new tensor: reads the logits
  and writes the gradient;
* `fused`: forward and gradient in one program, in place (what the fused linear +
  cross-entropy runs on each chunk): reads the row, reads it again, and writes the gradient
  over it.

Each time is `triton.testing.do_bench`'s median (L2 flushed before every call) of one call on
bf16 logits (rows, vocab). GB/s counts the bytes DRAM must move at least: the logits once
per pass, except the fused kernel's second read (which could come from L2), and the gradient
once; it is reported against a device-to-device copy measured in the same run. Needs CUDA and
Triton. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import bench, copy_bandwidth

BLOCKS = (2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)
STAGES = (1, 2, 3)


def settings(vocab: int) -> list[dict]:
    """The grid, pruned to blocks no wider than the row and 4-64 values per lane."""
    import triton

    widest = triton.next_power_of_2(vocab)
    out = []
    for block, warps, stages in itertools.product(BLOCKS, WARPS, STAGES):
        per_lane = block // (32 * warps)
        if block <= widest and 4 <= per_lane <= 64:
            out.append({"BLOCK": block, "num_warps": warps, "num_stages": stages})
    return out


def time_setting(ce, launch: dict, rows: int, vocab: int) -> dict[str, float]:
    """{kernel: ms} for the three kernels launched with `launch`."""
    original = ce.launch_config
    ce.launch_config = lambda n: dict(launch)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=g)
        labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
        scale = torch.full((rows,), 1.0 / rows, device="cuda")
        _, lse = ce.fused_loss_and_grad_(logits, labels, None)
        out = torch.empty_like(logits)
        scratch = logits.clone()  # the fused kernel overwrites its input: time it on a copy
        return {
            "stats": bench(lambda: ce.fused_loss_and_grad_(logits, labels, None)),
            "grad": bench(lambda: ce.softmax_grad_(logits, labels, lse, scale, out=out)),
            "fused": bench(lambda: ce.fused_loss_and_grad_(scratch, labels, scale)),
        }
    finally:
        ce.launch_config = original


def cells(
    times: dict[str, float], base: dict[str, float], moved: dict[str, int], copy_gbps: float
) -> dict:
    """{kernel: ms, GB/s, fraction of copy bandwidth, speedup over the default's time}."""
    return {
        k: {
            "ms": ms,
            "gbps": moved[k] / ms / 1e6,
            "frac_of_copy": moved[k] / ms / 1e6 / copy_gbps,
            "speedup_vs_default": base[k] / ms,
        }
        for k, ms in times.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", default="128256,50304", help="vocabulary sizes, comma-separated")
    p.add_argument("--rows", type=int, default=8192, help="token rows")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ce_launch_sweep.py needs a CUDA GPU")
    import triton

    ce = importlib.import_module(
        "meshtrain.kernels.cross_entropy"
    )  # the package's `cross_entropy` is the dispatching op

    start = time.time()
    copy = copy_bandwidth()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d"),
        "copy_gbps": copy,
        "rows": args.rows,
        "results": [],
    }
    print(f"{report['device']}  copy {copy:,.0f} GB/s  rows {args.rows}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        nbytes = args.rows * vocab * 2
        moved = {"stats": nbytes, "grad": 2 * nbytes, "fused": 2 * nbytes}
        default = ce.launch_config(vocab)
        base = time_setting(ce, default, args.rows, vocab)

        # the default is always a row: timed once, and listed even where it is outside the grid
        timed = [(default, base)] + [
            (lc, time_setting(ce, lc, args.rows, vocab)) for lc in settings(vocab) if lc != default
        ]
        rows = [
            {
                "vocab": vocab,
                "launch": lc,
                "default": lc == default,
                **cells(times, base, moved, copy),
            }
            for lc, times in timed
        ]
        report["results"].extend(rows)
        print(f"\nvocab {vocab}: ms (% of copy, speedup vs default); * = the current default")
        print(
            f"{'BLOCK':>6} {'warps':>5} {'stages':>6} | "
            f"{'stats':>22} | {'grad':>22} | {'fused':>22}"
        )
        for r in sorted(rows, key=lambda r: r["stats"]["ms"] + r["grad"]["ms"]):
            lc = r["launch"]
            line = " | ".join(
                f"{r[k]['ms']:7.3f} ({r[k]['frac_of_copy']:4.0%}, "
                f"{r[k]['speedup_vs_default']:4.2f}x)"
                for k in ("stats", "grad", "fused")
            )
            print(
                f"{lc['BLOCK']:>6} {lc['num_warps']:>5} {lc.get('num_stages', '-')!s:>6} | {line}"
                f"{' *' if r['default'] else ''}"
            )
    report["seconds"] = time.time() - start
    print(f"total {report['seconds']:.0f}s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
