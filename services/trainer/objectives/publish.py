"""How GRPO's policy weights reach the rollout backend before each batch of rollouts, as version
= the step (the optimizer updates taken so far).

The colocated generator samples with the trainer's model itself: publishing is a version bump.
For the rollout service (`grpo.rollout = "service"`), `grpo.publish` says how:

- stream: every parameter gathered whole, in the checkpoint's global layout (tensor-parallel
  shards put together by `checkpoint_boxes.whole_tensor`, vocabulary padding cut off: the names
  and shapes of the single-device model a worker holds), by the tensor-parallel group of dp rank
  0; global rank 0 streams them to every worker (`RolloutClient.update_weights(step, tensors)`).
- checkpoint: a checkpoint of the step committed through the run's own checkpoint path
  (`checkpoint.save`); rank 0 then asks each worker to load that step from its root.

Either way every rank then learns whether the publication succeeded (one all-reduce), so all
raise together rather than some waiting for a peer that failed.

    publisher = WeightsPublisher(job, model, mesh, backend, save_checkpoint)
    publisher.publish(step)       # collective: every rank calls it before generating
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.services.common.errors import ConfigError, MeshtrainError
from meshtrain.services.trainer.checkpoint_boxes import whole_tensor
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor_layers import tp_split_of

log = logging.getLogger("meshtrain.train")


class PublishError(MeshtrainError):
    """The weights of a step did not reach the rollout workers."""


def check_publish(job: JobConfig, mesh: Mesh) -> None:
    """Refuse a layout the chosen publication cannot gather, naming the setting.

    Raises:
        ConfigError: grpo.publish = 'stream' with expert parallelism (a rank holds some experts).
    """
    g = job.grpo
    if g.rollout == "service" and g.publish == "stream" and mesh.ep > 1:
        raise ConfigError(
            "grpo.publish='stream' with parallel.expert_model_parallel_size > 1 is not supported "
            "yet; use grpo.publish='checkpoint'"
        )


def full_weights(model: torch.nn.Module, mesh: Mesh) -> dict[str, torch.Tensor] | None:
    """Every parameter of `model` whole, in global coordinates, on the CPU of global rank 0
    (None elsewhere). Collective over the tensor-parallel group of dp rank 0 (the other dp
    replicas hold the same values and take no part)."""
    if mesh.dp_rank != 0:
        return None
    vocab: int = model.vocab_size  # type: ignore[assignment]
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if mesh.tp > 1 and tp_split_of(p) is not None:
            shards = [torch.empty_like(t) for _ in range(mesh.tp)]
            dist.all_gather(shards, t.contiguous(), group=mesh.group("tp"))
        else:
            shards = [t]
        if mesh.tp_rank == 0:
            out[name] = whole_tensor(name, shards, p, vocab).cpu()
    return out if mesh.rank == 0 else None


class WeightsPublisher:
    """Publishes the trainer's weights to `backend` (see the module docstring)."""

    def __init__(
        self,
        job: JobConfig,
        model: torch.nn.Module,
        mesh: Mesh,
        backend: Any,
        save_checkpoint: Callable[[int], None] | None = None,
    ):
        """Args:
        job: the run (grpo.rollout and grpo.publish).
        model: the policy (sharded under tp).
        mesh: the layout.
        backend: the `RolloutBackend`.
        save_checkpoint: commits a checkpoint of the current weights as step `step` (collective;
            grpo.publish = 'checkpoint').
        """
        g = job.grpo
        self.model, self.mesh, self.backend = model, mesh, backend
        self.mode = "version" if g.rollout == "colocated" else g.publish
        if self.mode == "checkpoint" and save_checkpoint is None:
            raise ConfigError("grpo.publish='checkpoint' needs the run's checkpointer")
        self.save_checkpoint = save_checkpoint

    def publish(self, step: int) -> None:
        """Make the current weights version `step` of the backend (collective).

        Raises:
            PublishError: on every rank, when the workers did not take the weights.
        """
        if self.mode == "version":
            self.backend.update_weights(step)
            return
        start = time.perf_counter()
        error: BaseException | None = None
        tensors = None
        try:
            if self.mode == "stream":
                tensors = full_weights(self.model, self.mesh)
            else:
                assert self.save_checkpoint is not None
                self.save_checkpoint(step)
            if self.mesh.rank == 0:
                if self.mode == "stream":
                    self.backend.update_weights(step, tensors)
                else:
                    self.backend.update_weights(step)
        except MeshtrainError as e:
            error = e
        ok = self._agree(error is None)
        if error is not None:
            raise PublishError(f"weights of step {step} not published: {error}") from error
        if not ok:
            raise PublishError(f"weights of step {step} not published (see rank 0's error)")
        log.debug(
            "grpo: weights of step %d published (%s) in %.2f s",
            step,
            self.mode,
            time.perf_counter() - start,
        )

    def _agree(self, ok: bool) -> bool:
        """Whether every rank succeeded."""
        if not self.mesh.distributed:
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=_device(self.model))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() > 0)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
