"""The run directory's metrics: metrics.jsonl, the progress display, MFU and loss.png.

`metrics.jsonl` holds one JSON object per logged step (every `log.log_interval` steps, the
run's first and last step too) with at least `step`, `time` (Unix seconds, float), `loss`,
`lr`, `grad_norm`, `tokens_per_s`, `step_time_s`, `consumed_samples`, `max_rss_gib` (the process's
peak resident host memory), on CUDA `mem_max_allocated_gib` (peak device memory allocated by
tensors) and, where the device's peak is known, `mfu`; evaluation adds objects with `step`, `time`
and `eval_loss`. On a terminal a progress bar shows step, loss, tokens/s and ETA; elsewhere the
same goes out as plain log lines. The same scalars go to TensorBoard and W&B where asked for
(`tracking.py`).

A mixture of experts adds its routers' statistics of the logged step, over the global batch
(`RouterStats`): `moe/layer<i>/tokens_per_expert_max_over_mean` (the busiest expert's routed
tokens over the mean: 1 is perfect balance), `moe/layer<i>/dropped` (token choices over an
expert's capacity), and `moe/aux_loss`, `moe/z_loss` (summed over the layers, mean over the
micro-batches: the auxiliary losses whose gradients the step trained with; `loss` stays the
language-model loss).
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.model.moe import MoEStats, moe_layers
from meshtrain.services.trainer.parallel import mappings
from meshtrain.services.trainer.tracking import Tracker, close_trackers, scalars

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


@dataclass
class ModelSize:
    """What the whole model (every rank's shards together) computes and holds."""

    flops_per_token: float
    """Training FLOPs per token (`GPT.flops_per_token`: active expert weights only)."""
    parameters: int
    """Every parameter, every expert counted."""
    active_parameters: int
    """Parameters one token passes through (top-k of each MoE block's experts)."""


def model_size(config: ModelConfig) -> ModelSize:
    """`ModelSize` of the model `config` describes, from a copy built on the meta device (no
    memory, no compute): independent of how this rank's model is sharded (tp, pp, ep), so MFU and
    the logged sizes are the same at any layout."""
    with torch.device("meta"):
        model = GPT(config)
    total = model.num_parameters()
    return ModelSize(model.flops_per_token(), total, total - model.inactive_parameters())


def _global_layer(name: str) -> int:
    """`layers.<i>.mlp` (GPT or a pipeline stage: i is global) -> i."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


class RouterStats:
    """The MoE routers' statistics of the last step, summed over the ranks of the global batch.

    After every optimizer step `end_step` moves each layer's expert bias (from the step's routed
    counts) and takes the layer's statistics, leaving it empty for the next step (no host sync);
    on logged steps `metrics` reduces them (one all-reduce over dp x cp, one over pp) and returns
    the `moe/...` entries of metrics.jsonl.

    Args:
        model: this rank's model or pipeline stage.
        num_layers: blocks in the whole model (pipeline stages hold some of them).
        batch_group: the ranks of one global batch (dp x cp), over which counts add up; its
            ranks' MoE blocks have `stats_group` set to it for the aux losses, or None alone.
        pp_group: the pipeline group (each stage holds its blocks' statistics), or None.
    """

    def __init__(
        self,
        model: nn.Module,
        num_layers: int,
        batch_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None = None,
    ):
        self.layers = [(_global_layer(name), m) for name, m in moe_layers(model)]
        self.num_layers = num_layers
        self.batch_group, self.pp_group = batch_group, pp_group
        self.last: list[
            tuple[int, MoEStats, bool]
        ] = []  # (global block, its statistics, aux shared)

    def discard(self) -> None:
        """Zero the statistics gathered so far in this step (what a CUDA graph's warm-up
        forwards recorded before its capture)."""
        for _, m in self.layers:
            m.reset_stats()

    def end_step(self) -> None:
        """After the optimizer step: expert-bias updates, then the step's statistics put aside."""
        for _, m in self.layers:
            m.update_expert_bias(self.batch_group)
        self.last = [(i, m.reset_stats(), m.stats_group is not None) for i, m in self.layers]

    def metrics(self, config: ModelConfig, device: torch.device) -> dict[str, float]:
        """The last step's `moe/...` metrics (identical on every rank); {} for a dense model."""
        ids = [i for i in range(self.num_layers) if config.is_moe_layer(i)]
        if not ids:
            return {}
        e = config.num_experts
        assert e is not None  # a MoE layer exists
        batch_size = _group_size(self.batch_group)
        # per global block: routed (E), kept (E), aux, z (per micro-batch, this rank's part)
        table = torch.zeros(self.num_layers, 2 * e + 2, dtype=torch.float64, device=device)
        for i, st, shared in self.last:
            n = st.micro_batches.to(device, torch.float64).clamp(min=1)
            # aux values are this rank's share of the global micro-batch's loss when the layer's
            # statistics group spans the batch; alone, whole losses, averaged over the ranks
            weight = 1.0 if shared else 1.0 / batch_size
            table[i, :e] = st.routed_per_expert.to(device, torch.float64)
            table[i, e : 2 * e] = st.tokens_per_expert.to(device, torch.float64)
            table[i, 2 * e] = st.aux_loss.to(device, torch.float64) * weight / n
            table[i, 2 * e + 1] = st.z_loss.to(device, torch.float64) * weight / n
        for group in (self.batch_group, self.pp_group):
            if _group_size(group) > 1:
                dist.all_reduce(table, group=group)
        rows = table[ids].tolist()  # the one host sync
        out: dict[str, float] = {}
        for i, row in zip(ids, rows):
            routed, kept = row[:e], row[e : 2 * e]
            mean = sum(routed) / e
            out[f"moe/layer{i}/tokens_per_expert_max_over_mean"] = (
                max(routed) / mean if mean else 0.0
            )
            out[f"moe/layer{i}/dropped"] = int(round(sum(routed) - sum(kept)))
        if config.moe_aux_loss_coeff > 0:
            out["moe/aux_loss"] = sum(row[2 * e] for row in rows)
        if config.moe_z_loss_coeff:
            out["moe/z_loss"] = sum(row[2 * e + 1] for row in rows)
        return out


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory so far: the process's resident host memory, and on CUDA the device memory
    tensors have held (the caching allocator's peak; what an out-of-memory error runs into)."""
    out = {
        "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    }  # KiB on Linux
    if device.type == "cuda":
        out["mem_max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def mean_losses(pending: list[tuple[torch.Tensor, torch.Tensor]], mesh) -> list[float]:
    """The global batch's loss of each pending (loss, grad_norm) step, on the host."""
    stacked = torch.stack([p[0] for p in pending])
    if mesh.pp > 1:  # the last stage computed the losses; the others hold zeros
        stacked = mappings.all_reduce(stacked, mesh.group("pp"))
    if mesh.cp > 1:  # each cp rank's loss is its share of the mean
        stacked = mappings.all_reduce(stacked, mesh.group("cp"))
    if mesh.dp > 1:  # each dp rank saw 1/dp of the batch: average
        stacked = mappings.all_reduce(stacked, mesh.group("dp")) / mesh.dp
    return stacked.tolist()


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsLog:
    """Appends records to RUN_DIR/metrics.jsonl and shows progress (bar or lines)."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        progress: str,
        trackers: list[Tracker] | None = None,
    ):
        """progress: 'auto' | 'bar' | 'lines', or 'none' on ranks that write nothing.
        trackers: TensorBoard / W&B, given the same scalars as each row (closed by `close`)."""
        self.path = run_dir / "metrics.jsonl"
        self.silent = progress == "none"
        self.trackers = list(trackers or [])
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
        if self.trackers:
            values = scalars(record)
            for tracker in self.trackers:
                tracker.log(record["step"], values)

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
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", eta=eta
            )
        else:
            mfu = f" | MFU {record['mfu'] * 100:.1f}%" if "mfu" in record else ""
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s tok/s | %.3f s/step%s | "
                "ETA %s",
                record["step"],
                self.total,
                record["loss"],
                record["lr"],
                record["grad_norm"],
                f"{record['tokens_per_s']:,.0f}",
                record["step_time_s"],
                mfu,
                eta,
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
        close_trackers(self.trackers)
        self.trackers = []


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
        log.info(
            "%s: dropped %d rows after step %d, which this run logs again",
            path,
            len(lines) - len(kept),
            step,
        )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(run_dir: Path) -> Path | None:
    """Write RUN_DIR/loss.png (train loss per logged step, eval loss markers); returns its path,
    or None, with a warning, where matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning(
            "no loss.png: matplotlib is not installed (pip install 'meshtrain[plot]', or "
            "--log.plot=false)"
        )
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
