"""The training loop's log: the steps run since the last log, their (loss, grad_norm) kept on
the device until a logging step, which synchronizes with the host once, and metrics.jsonl's row
of that step (loss, lr, throughput, MFU, memory, the objective's and the MoE routers' statistics).
Time spent in evaluation and saves is left out of step times.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from meshtrain.services.trainer.metrics import MetricsLog, mean_losses, memory_metrics
from meshtrain.services.trainer.optim.schedule import lr_at

if TYPE_CHECKING:
    from meshtrain.services.trainer.train import Trainer, TrainResult

log = logging.getLogger("meshtrain.train")


class StepLog:
    """The steps run since the last log (see the module docstring)."""

    def __init__(
        self,
        trainer: Trainer,
        result: TrainResult,
        metrics: MetricsLog,
        step: int,
        tokens_per_step: int,
    ):
        self.trainer, self.result, self.metrics = trainer, result, metrics
        self.tokens_per_step = tokens_per_step
        self.start = time.perf_counter()
        """perf_counter() when the last log ended."""
        self.step = step
        """The step last logged (the run's start before the first log)."""
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.paused = 0.0
        """Seconds spent in eval/save since the last log, left out of step times."""

    def log(self, n: int) -> None:
        """Record the steps since the last log, ending with step n (one host sync)."""
        trainer = self.trainer
        losses = mean_losses(self.pending, trainer.mesh)  # the one host sync
        norm = self.pending[-1][1].item()
        now = time.perf_counter()
        step_time = (now - self.start - self.paused) / (n - self.step)
        for k, value in enumerate(losses):
            self.result.losses[self.step + k + 1] = value
        record = self.record(n, losses[-1], norm, step_time)
        disk_full = trainer.checkpointer.poll()  # a save that ended since: recovered, or failed
        if disk_full is not None and trainer.is_main:
            record["checkpoint_error"] = str(disk_full[1])
        self.metrics.step(record)
        if disk_full is not None and trainer.is_main:  # on every logged step until a save commits
            log.warning(
                "the last checkpoint save failed (%s); training goes on, and the next save tries "
                "again",
                disk_full[1],
            )
        trainer.progress.update(
            loss=losses[-1],
            tokens_per_s=record["tokens_per_s"],
            eta_s=(trainer.job.train.train_iters - n) * step_time,
        )
        self.pending.clear()
        self.start, self.step, self.paused = time.perf_counter(), n, 0.0

    def record(self, n: int, loss: float, norm: float, step_time: float) -> dict:
        """metrics.jsonl's row of step n: loss, lr, throughput, MFU, memory, MoE statistics."""
        trainer = self.trainer
        job, t = trainer.job, trainer.job.train
        record = {
            "step": n,
            "loss": loss,
            "lr": lr_at(n - 1, job.optim, t.train_iters),
            "grad_norm": norm,
            "tokens_per_s": self.tokens_per_step / step_time,
            "step_time_s": step_time,
            "consumed_samples": trainer.state.consumed_samples,
        }
        if trainer.peak:  # per device: the global batch's FLOPs shared by every rank
            record["mfu"] = (
                trainer.flops_per_token
                * record["tokens_per_s"]
                / (trainer.peak * 1e12 * trainer.mesh.world_size)
            )
        record.update(trainer.objective.step_metrics())  # e.g. DPO's rewards/accuracies
        record.update(memory_metrics(trainer.device))
        record.update(
            trainer.router_stats.metrics(job.model, trainer.device)
        )  # the MoE routers' (every rank)
        return record
