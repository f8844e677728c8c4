"""The training loop's saves: when a step is followed by one (checkpoint.save_interval, the run's
last step, a checkpoint request or a stop), what a save does first (the parameters back to their
shards, older checkpoints retired by checkpoint.keep_last) and which failures end the run. A save
that fails with the disk full is survived (logged, left to the next one) unless it is the run's
last; a stop's save goes ahead even when an earlier one failed. The saving itself, one save in
flight while the run trains on, is the `Checkpointer`'s (checkpoint_saver.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from meshtrain.services.checkpoint.maintenance import apply_retention
from meshtrain.services.common.errors import CheckpointError, DiskFullError

if TYPE_CHECKING:
    from meshtrain.services.trainer.checkpoint_saver import Checkpointer
    from meshtrain.services.trainer.train import Trainer, TrainResult

log = logging.getLogger("meshtrain.train")


def save(trainer: Trainer) -> str | None:
    """Start saving the trainer's current state (asynchronous unless checkpoint.async_save is
    off); returns the checkpoint's URL.

    A save that fails with the disk full (DiskFullError) is logged and left to the next one
    (None is returned), unless it is the run's last (at train.train_iters, or a stop's): the run
    ends with that error. Earlier saves' failures are recorded (`Checkpointer.disk_full`)."""
    c, checkpointer = trainer.job.checkpoint, trainer.checkpointer
    if (
        trainer.ddp is not None
    ):  # with overlap_param_gather the last step's gathers may be in flight
        trainer.ddp.wait_param_gather()
    if c.keep_last and trainer.is_main:
        assert c.save is not None  # the trainer fills it in (RUN_DIR/checkpoints)
        checkpointer.settle()  # retention looks at committed saves only
        own = checkpointer.own_latest_step
        apply_retention(c.save, c.keep_last, c.keep_every, protect=() if own is None else (own,))
    try:
        url = checkpointer.save(
            trainer.model,
            trainer.optimizer,
            trainer.state,
            trainer.job,
            {"tokenizer": trainer.data.tokenizer, "data_prefix": trainer.data.prefix},
        )
    except DiskFullError:
        if (
            trainer.state.iteration >= trainer.job.train.train_iters
            or trainer.stop_cause is not None
        ):
            raise
        return None  # logged; the warning goes on at every logged step until a save commits
    trainer.last_saved = trainer.state.iteration
    log.info(
        "checkpoint step %d %s: %s (stall %.0f ms)",
        trainer.state.iteration,
        "saving in the background" if c.async_save else "committed",
        url,
        checkpointer.saver.last_stall_s * 1e3,
    )
    return url


def save_if_due(trainer: Trainer, n: int, requested: bool, stop: bool, result: TrainResult) -> None:
    """Save after step n at checkpoint.save_interval, the last step, or on request (a stop's
    save first settles the previous one)."""
    interval = trainer.job.checkpoint.save_interval
    if (interval and n % interval == 0) or n == trainer.job.train.train_iters or requested:
        # Cleared before saving: this save answers the requests made so far, and one that
        # arrives while it runs (a sync save takes a while) stays set for the next step.
        trainer.requests.checkpoint_started()
        if stop:
            _settle_previous_save(trainer.checkpointer)
        result.checkpoint = trainer.save() or result.checkpoint
    # Only a committed save is reported: one still in flight may yet fail.
    trainer.progress["last_checkpoint"] = trainer.checkpointer.committed_url


def _settle_previous_save(checkpointer: Checkpointer) -> None:
    """Before a stop's save: a failed earlier save is logged, not raised, so it cannot cost
    the run its last chance to checkpoint (storage may have recovered since). If the stop's
    save fails too, that error ends the run."""
    try:
        checkpointer.settle()  # a save that failed with the disk full is logged there
    except CheckpointError as e:
        log.error(
            "an earlier checkpoint was not committed (%s); saving the stop's checkpoint anyway", e
        )
