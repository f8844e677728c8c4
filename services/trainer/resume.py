"""Where a run starts: the checkpoint it resumes (or a fresh start), and the checks that a
resume continues the saved run and that the root it saves into will take its saves.

    state, resumed_here = resume(job, model, optimizer, par)   # TrainState(), None without --load
    if not job.checkpoint.overwrite:
        refuse_a_root_with_later_steps(job.checkpoint, state.iteration)
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from typing import Any

import torch

from meshtrain.services.checkpoint.config import CheckpointConfig
from meshtrain.services.checkpoint.reader import list_checkpoints, unreadable_manifests
from meshtrain.services.checkpoint.store import same_root
from meshtrain.services.common.errors import CheckpointError, ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.checkpoint_checks import refuse_damaged_newer
from meshtrain.services.trainer.checkpoint_restore import restore
from meshtrain.services.trainer.checkpoint_state import Parallel, TrainedModel, TrainState
from meshtrain.services.trainer.config.sections import JobConfig

log = logging.getLogger("meshtrain.train")


def resume(
    job: JobConfig, model: TrainedModel, optimizer: torch.optim.Optimizer, par: Parallel
) -> tuple[TrainState, int | None]:
    """Load `checkpoint.load` into `model` and `optimizer` in place, checked against the job.

    With `checkpoint.finetune` only the weights are loaded and the run starts at step 0;
    `load_optim` / `load_rng` false leave the optimizer / RNG states fresh.

    Returns:
        (the state to train on from, the step resumed from when it is under the root this run
        saves into, else None). Without `checkpoint.load`, or fine-tuning: (TrainState(), None).
    """
    c = job.checkpoint
    if not c.load:
        return TrainState(), None
    saves_here = c.save is not None and same_root(c.load, c.save)  # resumes its own root
    if c.load_step is None and saves_here and not list_checkpoints(c.load):
        # Megatron's requeue idiom, `--load X --save X` for the first launch and every relaunch
        # alike: nothing committed yet is a fresh start. A --load elsewhere (weights to start
        # from) or an explicit step that is missing stays an error: a mistyped path must not
        # silently train from scratch.
        refuse_damaged_newer(c.load, None)  # nor may a root whose steps are damaged
        log.warning(
            "no committed checkpoint under %s, the root this run saves into: starting from step 0 "
            "(--load of the root a run saves into resumes it once it holds one)",
            c.load,
        )
        return TrainState(), None
    if c.finetune:
        # Megatron's --finetune: the weights alone, and a new run from step 0 (its own data
        # order, LR schedule and RNG streams), so nothing of the loaded run's plan is checked.
        _, meta = restore(c.load, model, None, par, c.load_step, rng=False, masters=optimizer)
        carry_hf_identity(job, meta)
        log.info(
            "fine-tuning from %s step %d: weights loaded, starting at step 0 with a fresh "
            "optimizer and RNG states",
            c.load,
            meta["iteration"],
        )
        return TrainState(), None
    state, meta = restore(
        c.load,
        model,
        optimizer if c.load_optim else None,
        par,
        c.load_step,
        rng=c.load_rng,
        masters=optimizer,
    )
    check_continuation(job, state, meta)
    carry_hf_identity(job, meta)
    log.info(
        "resumed from %s at step %d (%d samples consumed)",
        c.load,
        state.iteration,
        state.consumed_samples,
    )
    return state, state.iteration if saves_here else None


def carry_hf_identity(job: JobConfig, meta: dict) -> None:
    """Take the checkpoint's model.hf_* settings (the Hugging Face model it was imported from)
    where this run names no source of its own, so that the run's saves export as that model
    again; they change nothing the model computes. A window shorter than this run's sequences
    is left behind (the export then has none: meshtrain attends to the whole sequence)."""
    saved = (meta.get("config") or {}).get("model") or {}
    if job.model.hf_model_type is not None or saved.get("hf_model_type") is None:
        return
    carried: dict[str, Any] = {
        f.name: saved.get(f.name) for f in fields(ModelConfig) if f.name.startswith("hf_")
    }
    window = carried["hf_sliding_window"]
    if window is not None and window < job.model.seq_length:
        log.warning(
            "the checkpoint's model had a sliding window of %d tokens (model.hf_sliding_window), "
            "shorter than model.seq_length=%d: its exports have no window from here on",
            window,
            job.model.seq_length,
        )
        carried["hf_sliding_window"] = None
    job.model = replace(job.model, **carried)
    log.info(
        "the checkpoint's model came from Hugging Face %r: model.hf_* taken from it, so this "
        "run's saves export as one",
        carried["hf_model_type"],
    )


def check_continuation(job: JobConfig, state: TrainState, meta: dict) -> None:
    """Refuse a resume that would skip or repeat samples; warn when it changes the plan or the
    residual stream's dtype.

    Batches are indexed by step (step k takes samples [k·gbs, (k+1)·gbs) of the shuffled
    stream), so a different global batch size would not continue at the samples consumed.
    The sample order and the LR schedule's length both follow train.train_iters, as in
    Megatron: a different value continues a different run (the README says so).
    """
    t = job.train
    if state.consumed_samples != state.iteration * t.global_batch_size:
        raise ConfigError(
            f"the checkpoint consumed {state.consumed_samples} samples in {state.iteration} steps, "
            f"but train.global_batch_size={t.global_batch_size} would put step {state.iteration} "
            f"at sample {state.iteration * t.global_batch_size}: samples would be skipped or "
            "repeated; resume with the checkpoint's global batch size"
        )
    before = meta.get("config", {}).get("train", {}).get("train_iters")
    if before is not None and before != t.train_iters:
        log.warning(
            "train.train_iters changed from %d to %d since the checkpoint: the sample order and "
            "the LR schedule follow it, so this continues a different run than the one saved "
            "(keep it unchanged for an exact continuation; optim.lr_decay_iters fixes the "
            "schedule alone)",
            before,
            t.train_iters,
        )
    saved = meta.get("config", {})
    # What else decides the samples a step takes, and which documents evaluation holds out.
    for section, key in (
        ("train", "seed"),
        ("data", "split"),
        ("data", "data_path"),
        ("model", "seq_length"),
    ):
        was, now = saved.get(section, {}).get(key), getattr(getattr(job, section), key)
        if was is not None and was != now:
            log.warning(
                "%s.%s changed from %s to %s since the checkpoint: the samples each step takes "
                "(and the documents held out for evaluation) follow it, so the steps from here "
                "skip and repeat samples of the saved run's order (keep it unchanged for an exact "
                "continuation)",
                section,
                key,
                was,
                now,
            )
    # The LR schedule is recomputed from the config at every step (not stored), so a changed
    # setting moves the rate at once; Megatron refuses this without
    # --override-opt_param-scheduler, here it is a warning (a lower peak LR after a loss spike
    # is deliberate practice).
    changed = [
        f"optim.{key} {saved['optim'][key]} -> {getattr(job.optim, key)}"
        for key in ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style")
        if key in saved.get("optim", {}) and saved["optim"][key] != getattr(job.optim, key)
    ]
    if changed:
        log.warning(
            "the LR schedule changed since the checkpoint (%s): the learning rate from step %d "
            "follows the new schedule, not the saved run's (keep them unchanged for an exact "
            "continuation)",
            ", ".join(changed),
            state.iteration + 1,
        )
    if t.bf16 and saved.get("train", {}).get("bf16"):
        # Checkpoints from before the setting existed trained with plain autocast's fp32 stream.
        was = saved.get("model", {}).get("fp32_residual_connection", True)
        now = job.model.fp32_residual_connection
        if was != now:
            dtype = {True: "fp32", False: "bf16"}
            log.warning(
                "model.fp32_residual_connection changed from %s to %s since the checkpoint: its "
                "residual stream was %s, this run's is %s, so the numerics change from here on "
                "(%s --fp32-residual-connection to keep the checkpoint's)",
                was,
                now,
                dtype[was],
                dtype[now],
                "pass" if was else "drop",
            )


def refuse_a_root_with_later_steps(c: CheckpointConfig, start: int) -> None:
    """Refuse, before training, a run into a root that holds committed steps after its start.

    A run rolled back with --ckpt-step (or started afresh) into such a root would meet them:
    a scheduled save on one of those steps stops the run with an error after training up to
    it, and so does the final save of a stop (SIGTERM: preemption) landing on one, losing the
    work since the last save. A save between them would not collide, but the root's latest
    step would still be the abandoned run's, which the next `--load` (deploy/train.sh's
    resume after a preemption) would take up instead of this run's. Every rank lists the
    root, so every rank raises alike; `checkpoint.overwrite` lets the run share the root.
    """
    if c.save is None:
        return  # a run that saves nothing meets no steps
    damaged = [s for s in unreadable_manifests(c.save) if s > start]
    if damaged:  # readers skip them, but a save of their step finds the folder taken
        raise CheckpointError(
            f"checkpoint steps {damaged[:5]}{' ...' if len(damaged) > 5 else ''} after this run's "
            f"start (step {start}) under {c.save!r} hold a manifest.json that cannot be read "
            f"(`meshtrain ckpt verify {c.save} --all`): the run's save of such a step would fail; "
            f"delete them (meshtrain ckpt delete {c.save} --step N), pass "
            "--checkpoint.overwrite=true, or --save another root"
        )
    later = [s for s in list_checkpoints(c.save) if s > start]
    if later:
        shown = f"{later[:5]}{' ...' if len(later) > 5 else ''}"
        raise CheckpointError(
            f"checkpoint steps {shown} after this run's start (step {start}) already exist under "
            f"{c.save!r}: its saves (scheduled, or a stop's final one) would meet them, and the "
            "next --load would resume from them rather than from this run; "
            # a first command run again (no --load) most likely meant to resume those steps
            + (f"to resume them pass --load {c.save}; " if not c.load else "")
            + "pass --checkpoint.overwrite=true to share the root anyway, or --save another root"
        )
