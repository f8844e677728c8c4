"""Saving and loading training checkpoints from a hand-written loop: the public API.

`save_checkpoint` and `load_checkpoint` take what such a loop holds (a GPT or its
DistributedDataParallel, a torch optimizer or the wrapper's DistributedOptimizer) and write or
read the same format `meshtrain train` does, so any layout loads it, `meshtrain ckpt export`
exports it and `meshtrain train --load` resumes from it. The trainer itself uses the
`Checkpointer` (`checkpoint_saver`) and `restore` (`checkpoint_restore`) directly.
"""

from __future__ import annotations

from torch import nn

from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.trainer.checkpoint_restore import restore
from meshtrain.services.trainer.checkpoint_saver import Checkpointer
from meshtrain.services.trainer.checkpoint_state import Parallel, TrainState
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh


def _unwrap(model: nn.Module, optimizer, mesh: Mesh | None):
    """(GPT, torch optimizer or None, Parallel) from what a hand-written loop holds: a GPT or
    its DistributedDataParallel wrapper, an optimizer or the wrapper's DistributedOptimizer."""
    from meshtrain.services.trainer.parallel.ddp import (
        DistributedDataParallel,
        DistributedOptimizer,
    )

    ddp = None
    if isinstance(model, DistributedDataParallel):
        model.finish_param_sync()  # a ZeRO-1 step's parameters may still be on their way
        ddp, mesh, model = model.ddp, model.mesh, model.module
    if isinstance(optimizer, DistributedOptimizer):
        optimizer = optimizer.inner
    if not isinstance(model, GPT):
        raise CheckpointError(
            f"checkpoints hold a meshtrain GPT (or its DistributedDataParallel), not a "
            f"{type(model).__name__}"
        )
    return model, optimizer, Parallel(mesh if mesh is not None else Mesh.single(), ddp)


def save_checkpoint(
    root: str,
    step: int,
    model: nn.Module,
    optimizer,
    *,
    mesh: Mesh | None = None,
    consumed_samples: int = 0,
    job: JobConfig | None = None,
    service_address: str | None = None,
    overwrite: bool = False,
) -> str:
    """Save a committed checkpoint of step `step` and return its URL (every rank calls it).

    The same format `meshtrain train` writes: any layout loads it, `meshtrain ckpt export`
    exports it, `meshtrain train --load` resumes from it.

    Args:
        root: checkpoint root (a folder, `file://`, `s3://bucket/prefix`, `memory://`).
        step: the step to save as (the number of optimizer steps taken).
        model: a GPT (sharded by `parallelize` or not) or its `DistributedDataParallel`.
        optimizer: its optimizer (the wrapper's, or a torch AdamW); None saves the weights only.
        mesh: the layout (taken from a DistributedDataParallel; unset: one process).
        consumed_samples: samples trained on so far, recorded for a resume.
        job: the config recorded with the checkpoint (unset: the model's, defaults elsewhere).
        service_address: stream the shards to a checkpoint service (`meshtrain ckpt serve`)
            instead of writing storage from this process.
        overwrite: replace a committed checkpoint of the same step.

    Returns:
        The checkpoint's URL, once it is committed.
    """
    gpt, opt, par = _unwrap(model, optimizer, mesh)
    saver = Checkpointer(
        root, par, asynchronous=False, service_address=service_address, overwrite=overwrite
    )
    try:
        return saver.save(
            gpt, opt, TrainState(step, consumed_samples), job or JobConfig(model=gpt.config), {}
        )
    except BaseException:
        saver.close_after_failure()
        raise
    finally:
        saver.close()


def load_checkpoint(
    root: str,
    model: nn.Module,
    optimizer=None,
    *,
    mesh: Mesh | None = None,
    step: int | None = None,
) -> TrainState:
    """Load checkpoint `step` (unset: the newest committed one) into `model` and `optimizer`, in
    place, whatever layout saved it (collective only in that every rank reads its own part).

    Args:
        root: checkpoint root.
        model: a GPT (sharded or not) or its `DistributedDataParallel`.
        optimizer: its optimizer, to restore the Adam moments too; None: the weights only.
        mesh: the layout (taken from a DistributedDataParallel; unset: one process).
        step: which step; unset: the newest committed one.

    Returns:
        The step and consumed samples the checkpoint recorded.

    Raises:
        CheckpointError: no such checkpoint, a corrupt one, or one that does not fit the model.
    """
    gpt, opt, par = _unwrap(model, optimizer, mesh)
    state, _ = restore(root, gpt, opt, par, step)
    return state
