"""Whether a training checkpoint can be trusted and fits the model that loads it.

Before a restore reads a tensor: the step is a committed meshtrain training checkpoint, no newer
step holds a damaged manifest that a resume of "the latest" would silently pass over, its recorded
position (iteration, consumed samples, optimizer step) agrees with itself, its tensors are the
model's, and the saved model config agrees with the model where shapes cannot tell them apart (the
attention heads; RoPE, norm and routing settings warn). A mismatch is a CheckpointError led by the
model settings in which the run differs from the saved config, which is what a user can fix.
"""

from __future__ import annotations

import logging
from dataclasses import fields

from torch import nn

from meshtrain.services.checkpoint.layout import NON_PARAMETER
from meshtrain.services.checkpoint.reader import (
    latest_step,
    list_checkpoints,
    read_manifest,
    unreadable_manifests,
)
from meshtrain.services.common.config import to_dict
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.trainer.checkpoint_state import FORMAT, TrainedModel, model_parameter_names
from meshtrain.services.trainer.parallel.mesh import Mesh

log = logging.getLogger("meshtrain.checkpoint")


def training_manifest(root: str, step: int | None) -> tuple[int, dict]:
    """(step, manifest) of training checkpoint `step` under `root` (latest committed if None)."""
    if step is None:
        step = latest_step(root)
        refuse_damaged_newer(root, step)
        if step is None:
            raise CheckpointError(f"no committed checkpoint under {root!r}")
    elif step not in list_checkpoints(root):
        raise CheckpointError(f"no committed checkpoint for step {step} under {root!r}")
    manifest = read_manifest(root, step)
    meta = manifest.get("metadata", {})
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{root}: not a meshtrain training checkpoint (format {meta.get('format')!r})"
        )
    _check_position(root, step, meta)
    return step, manifest


def _check_position(root: str, step: int, meta: dict) -> None:
    """Refuses a checkpoint whose recorded position disagrees with itself: a resume starts at
    `iteration` and skips `consumed_samples`, so a wrong one would repeat or skip data in
    silence. The manifest's digest catches an edit; this catches a writer that got them wrong."""

    def count(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    iteration = meta.get("iteration")
    if iteration != step:
        raise CheckpointError(
            f"{root}: checkpoint step {step} records iteration {iteration!r}; a resume would "
            "start from the wrong step"
        )
    for key in ("consumed_samples", "optimizer_step"):
        if not count(meta.get(key)):
            raise CheckpointError(
                f"{root}: checkpoint step {step} records {key} {meta.get(key)!r}, not a count"
            )


def check_names(
    root: str, model: TrainedModel, params: dict[str, nn.Parameter], stored: set[str], mesh: Mesh
) -> None:
    """Refuse a checkpoint that lacks a parameter of the model or holds one it does not have."""
    missing = [n for n in params if n not in stored]
    if missing:
        raise CheckpointError(
            f"{root}: checkpoint lacks parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    # A pipeline stage holds some of the model's parameters: compare with the whole model's names.
    names = params if mesh.pp == 1 else model_parameter_names(model.config)
    extra = [n for n in stored if not n.startswith(NON_PARAMETER) and n not in names]
    if extra:
        raise CheckpointError(f"{root}: checkpoint has tensors the model does not: {extra[:5]}")


def check_model(root: str, meta: dict, model: TrainedModel) -> None:
    """Compares the saved model config with `model` where the shapes cannot tell them apart.

    Refuses a model that would read the checkpoint's attention heads as other heads: the fused
    QKV weight has (heads + 2*groups) * hidden/heads rows, the same for every head count at a
    fixed heads/groups ratio (3*hidden for plain MHA), so GPT-2's 12 heads load into a 4-head
    model with every shape matching and the rows read as other heads' queries, keys and values.
    Warns when the RoPE base or scaling, the norm epsilon or a MoE model's routing (top-k, score
    function, pre-softmax, scaling) differ: the weights then compute another function (an imported
    Llama 3 resumed without rope_theta=500000), but a new RoPE base is also how a context is
    extended on purpose.
    """
    saved = (meta.get("config") or {}).get("model")
    if not isinstance(saved, dict) or "num_attention_heads" not in saved:
        return  # not saved by the trainer or an import: nothing to compare with
    heads = saved["num_attention_heads"]
    groups = saved.get("num_query_groups") or heads
    c = model.config
    if (heads, groups) != (c.num_attention_heads, c.groups):
        raise CheckpointError(
            f"{root}: the checkpoint's model has num_attention_heads={heads} in {groups} query "
            f"groups, but model.num_attention_heads={c.num_attention_heads} in {c.groups} query "
            "groups here: its attention weights would be read as other heads (the shapes happen "
            "to match); set model.num_attention_heads and model.num_query_groups as saved "
            "(`meshtrain ckpt inspect` shows the saved config)"
        )
    rope = [
        "rotary_base",
        "rope_scaling_factor",
        "rope_scaling_low_freq_factor",
        "rope_scaling_high_freq_factor",
        "rope_scaling_original_max_positions",
    ]
    keys = ["norm_epsilon"] + (rope if c.position_embedding_type == "rope" else [])
    if c.num_experts is not None:  # the routing: same weights, other experts chosen or weighted
        keys += [
            "moe_router_topk",
            "moe_router_score_function",
            "moe_router_pre_softmax",
            "moe_router_topk_scaling_factor",
        ]
    defaults = {f.name: f.default for f in fields(c)}  # a saved config leaves out keys set to None
    for key in keys:
        value = saved.get(key, defaults[key])
        if value != getattr(c, key):
            log.warning(
                "%s: the checkpoint's model was saved with model.%s=%s, this run has %s: the "
                "weights compute another function from here on (set it as saved unless the change "
                "is meant)",
                root,
                key,
                value,
                getattr(c, key),
            )


def _model_differences(saved: dict, config) -> list[str]:
    """`model.KEY=NOW (VALUE saved)` for each key of the saved model config `saved` (the
    checkpoint metadata's config.model) that `config` sets otherwise."""
    now = to_dict(config)
    return [
        f"model.{key}={now.get(key)} ({saved.get(key)} saved)"
        for key in [f.name for f in fields(config)]
        if saved.get(key) != now.get(key)
    ]


def naming_the_settings(
    error: CheckpointError, root: str, meta: dict, model: TrainedModel
) -> CheckpointError:
    """`error` (a tensor the model lacks, or of another shape), led by the model settings in which
    this run differs from the checkpoint's recorded config, which a user knows and can fix: most
    often a resume without the run's own config. Unchanged where the checkpoint records none."""
    saved = (meta.get("config") or {}).get("model")
    differ = _model_differences(saved, model.config) if isinstance(saved, dict) else []
    if not differ:
        return error
    detail = str(error).removeprefix(f"{root}: ")
    shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
    return CheckpointError(
        f"{root}: this run's model differs from the checkpoint's in {shown}; resume with the run's "
        "own config (--config RUN/config.toml, RUN the run directory that saved it) or set these "
        f"keys as saved. In detail: {detail}"
    )


def fresh_score(root: str, meta: dict, model: TrainedModel, optimizer) -> set[str]:
    """{"score.weight"} where a reward model starts from the weights of a language model (its
    saved config has no reward head, and only the weights are loaded): the scalar head keeps its
    initialization. Else nothing."""
    saved = (meta.get("config") or {}).get("model") or {}
    if getattr(model.config, "reward_head", False) and not saved.get("reward_head"):
        if optimizer is not None:
            raise CheckpointError(
                f"{root}: a language model's checkpoint (no scalar head) resumed as a reward "
                "model: start from its weights with checkpoint.finetune (--finetune)"
            )
        log.info("%s: a language model's weights; the reward head starts fresh", root)
        return {"score.weight"}
    return set()


def refuse_damaged_newer(root: str, latest: int | None) -> None:
    """Raise if a step newer than `latest` (the newest committed one, None: none) has a
    manifest.json no reader accepts.

    A manifest is written whole or not at all, so one that does not parse (or is of a format
    this version cannot read) is storage damage or a newer writer's. Readers pass over such a
    step as uncommitted, so resuming "the latest" would quietly go back to an older step, and
    the run would fail hours later when its save of the damaged step finds the folder taken.
    That is the operator's call: resume the older step on purpose, or delete the damaged one.
    """
    damaged = {
        s: why for s, why in unreadable_manifests(root).items() if latest is None or s > latest
    }
    if not damaged:
        return
    first = min(damaged)
    older = "no committed step" if latest is None else f"committed step {latest}"
    choices = (
        [] if latest is None else [f"resume step {latest} on purpose with --ckpt-step {latest}"]
    )
    choices.append(f"delete the damaged step (meshtrain ckpt delete {root} --step {first})")
    raise CheckpointError(
        f"{root}: checkpoint step(s) {sorted(damaged)}, newer than {older}, hold a manifest.json "
        f"that cannot be read ({damaged[first]}); "
        + " or ".join(choices)
        + f", after `meshtrain ckpt verify {root} --all`"
    )
