"""The run directory's metrics: metrics.jsonl, the progress display, MFU and loss.png.

`metrics.jsonl` holds one JSON object per logged step (every `log.log_interval` steps, the
run's first and last step too) with at least `step`, `time` (Unix seconds, float), `loss`,
`lr`, `grad_norm`, `tokens_per_s`, `step_time_s`, `consumed_samples` and, where the device's
peak is known, `mfu`; evaluation adds objects with `step`, `time` and `eval_loss`. On a terminal a progress bar shows
step, loss, tokens/s and ETA; elsewhere the same goes out as plain log lines.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("meshtrain.train")

# Dense bf16 peak TFLOP/s by device-name substring (vendor datasheets).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """The configured peak, else a known GPU's, else None (MFU is then not reported)."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_TFLOPS.items():
            if key in name:
                return value
    return None


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsLog:
    """Appends records to RUN_DIR/metrics.jsonl and shows progress (bar or lines)."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, progress: str):
        """progress: 'auto' | 'bar' | 'lines', or 'none' on ranks that write nothing."""
        self.path = run_dir / "metrics.jsonl"
        self.silent = progress == "none"
        if not self.silent:
            _drop_rows_after(self.path, start_step)
        self.file = None if self.silent else self.path.open("a", buffering=1)
        self.total = total_steps
        use_bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
        self.bar = None
        if use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def step(self, record: dict[str, Any]) -> None:
        """Record a training step and update the display."""
        if self.silent:
            return
        # Wall-clock time of the row, so curves from runs (or resumes) can be lined up in time.
        record = {**record, "time": record.get("time", time.time())}
        self.write(record)
        eta = format_duration((self.total - record["step"]) * record["step_time_s"])
        if self.bar is not None:
            self.bar.n = record["step"]
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", eta=eta)
        else:
            mfu = f" | MFU {record['mfu'] * 100:.1f}%" if "mfu" in record else ""
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s | %.3f s/step%s | ETA %s",
                record["step"], self.total, record["loss"], record["lr"], record["grad_norm"],
                f"{record['tokens_per_s']:,.0f}", record["step_time_s"], mfu, eta,
            )

    def eval(self, step: int, loss: float) -> None:
        if self.silent:
            return
        self.write({"step": step, "eval_loss": loss, "time": time.time()})
        msg = f"step {step}: eval loss {loss:.4f}"
        if self.bar is not None:
            self.bar.write(msg)
        else:
            log.info(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


def _drop_rows_after(path: Path, step: int) -> None:
    """Remove the rows of steps after `step`: a run resumed from an earlier checkpoint into the
    same run directory (the previous run died past its last save, or `--ckpt-step` rolled it
    back) logs those steps again, and each step must appear once, as this run computed it."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)

    def keep(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= step
        except json.JSONDecodeError:  # a row torn by the crash that ended the previous run
            return False

    kept = [line for line in lines if line.strip() and keep(line)]
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)  # atomic: a crash here leaves the old file or the new one
        log.info("%s: dropped %d rows after step %d, which this run logs again", path, len(lines) - len(kept), step)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(run_dir: Path) -> Path | None:
    """Write RUN_DIR/loss.png (train loss per logged step, eval loss markers); returns its path,
    or None, with a warning, where matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning(
            "no loss.png: matplotlib is not installed (pip install 'meshtrain[plot]', or --log.plot=false)")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir / "metrics.jsonl")
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
