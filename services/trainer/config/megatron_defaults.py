"""Megatron-LM's defaults where they differ from meshtrain's, and the rule for when they apply.

A command line is a Megatron-LM one when it gives all four arguments Megatron-LM's
`pretrain_gpt.py` requires (`REQUIRED_FLAGS`) and no `--config` file: then the keys it leaves
unset take Megatron-LM's default (the rows of `DEFAULTS` marked "taken"), so a pasted script
trains what Megatron-LM would, and `load.load_config` logs once a table of what it took. Any
other command line keeps meshtrain's defaults. The values were read from Megatron-LM's parser
(`megatron/training/arguments.py` and the config dataclasses it builds flags from) at commit
`MEGATRON_LM_COMMIT`; `tests/services/trainer/test_megatron_defaults.py` checks every
meshtrain default named here against the config classes.

    is_megatron_command_line(["--num-layers", "2", ...], config_file=None)  # -> True or False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

MEGATRON_LM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
"""NVIDIA/Megatron-LM main, 2026-08-22: the commit the defaults below were read from."""

REQUIRED_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--max-position-embeddings",
)
"""The arguments Megatron-LM refuses to start without (`required_args` of its validate_args)."""


@dataclass(frozen=True)
class Default:
    """One setting whose default differs between Megatron-LM and meshtrain."""

    flag: str
    """The Megatron-LM flag that sets it; "" where no flag does."""
    megatron: Any
    """Megatron-LM's default, as its parser holds it (None: unset, worked out later)."""
    key: str
    """The meshtrain key ("section.key")."""
    meshtrain: Any
    """meshtrain's default of that key."""
    kind: Literal["taken", "kept", "same_result"]
    """taken: a Megatron-LM command line gets Megatron-LM's default (`value`). kept: meshtrain's
    stays, and the run says so (it cannot compute Megatron-LM's, or Megatron-LM has none to
    give). same_result: meshtrain's stays without a word: it changes speed or timing, not what
    is trained."""
    value: Any = None
    """taken: Megatron-LM's default in meshtrain's terms, the value the key gets."""
    why: str = ""
    """kept and same_result: why meshtrain's default stays."""


DEFAULTS: tuple[Default, ...] = (
    Default("--hidden-dropout", 0.1, "model.hidden_dropout", 0.0, "taken", 0.1),
    Default("--attention-dropout", 0.1, "model.attention_dropout", 0.0, "taken", 0.1),
    Default("--weight-decay", 0.01, "optim.weight_decay", 0.1, "taken", 0.01),
    Default("--adam-beta2", 0.999, "optim.adam_beta2", 0.95, "taken", 0.999),
    Default("--min-lr", 0.0, "optim.min_lr", 3e-5, "taken", 0.0),
    Default("--lr-decay-style", "linear", "optim.lr_decay_style", "cosine", "taken", "linear"),
    # Megatron-LM's no_weight_decay_cond spares biases and 1-D parameters alone: the embedding
    # tables are decayed like every other matrix.
    Default("", "decayed", "optim.decay_embeddings", False, "taken", True),
    Default("--fp8-recipe", "delayed", "train.fp8_recipe", "tensorwise", "taken", "delayed"),
    Default("--eval-iters", 100, "train.eval_iters", 10, "taken", 100),
    Default("--log-interval", 100, "log.log_interval", 10, "taken", 100),
    Default(
        "--openai-gelu",
        False,
        "model.activation",
        "gelu",
        "kept",
        why="Megatron-LM's default GELU is the exact (erf) one; meshtrain's is the tanh "
        "approximation, --openai-gelu's (they differ by at most 4.7e-4 per activation)",
    ),
    Default(
        "--global-batch-size",
        None,
        "train.global_batch_size",
        32,
        "kept",
        why="Megatron-LM makes it micro-batch size x data-parallel size, known only at launch: "
        "give --global-batch-size",
    ),
    Default(
        "--eval-interval",
        None,
        "train.eval_interval",
        50,
        "kept",
        why="Megatron-LM has no default to take (pretrain_gpt.py fails building the validation "
        "set without one): give --eval-interval",
    ),
    Default(
        "--moe-grouped-gemm",
        False,
        "model.moe_grouped_gemm",
        True,
        "same_result",
        why="the experts' grouped GEMM computes what a loop over them does, faster",
    ),
    Default(
        "--no-gradient-accumulation-fusion",
        True,
        "train.gradient_accumulation_fusion",
        None,
        "same_result",
        why="where the weight gradients accumulate changes speed, not values",
    ),
    Default(
        "--ddp-bucket-size",
        None,
        "parallel.ddp_bucket_size",
        40_000_000,
        "same_result",
        why="the bucket size changes how gradients are reduced, not their values",
    ),
    Default(
        "--async-save",
        False,
        "checkpoint.async_save",
        True,
        "same_result",
        why="an asynchronous save writes the same checkpoint while training goes on",
    ),
)


def is_megatron_command_line(args: list[str], config_file: str | None) -> bool:
    """True when `args` give every flag of `REQUIRED_FLAGS` (as `--flag value` or `--flag=value`)
    and no `--config` file names meshtrain's own settings."""
    if config_file is not None:
        return False
    given = {word.partition("=")[0] for word in args if word.startswith("--")}
    return all(flag in given for flag in REQUIRED_FLAGS)


def taken_table() -> dict[str, Any]:
    """The nested table of every taken default: {"model": {"hidden_dropout": 0.1, ...}, ...}."""
    table: dict[str, Any] = {}
    for row in DEFAULTS:
        if row.kind == "taken":
            section, _, key = row.key.partition(".")
            table.setdefault(section, {})[key] = row.value
    return table


def report(unset: set[str]) -> str:
    """The lines the run logs once: each taken default of a key in `unset` (the keys neither the
    command line nor a base table set), then each kept one."""
    taken = [r for r in DEFAULTS if r.kind == "taken" and r.key in unset]
    kept = [r for r in DEFAULTS if r.kind == "kept" and r.key in unset]
    if not taken and not kept:
        return ""
    lines = [
        "a Megatron-LM command line (it gives "
        + ", ".join(REQUIRED_FLAGS)
        + "): what it leaves out takes Megatron-LM's defaults (docs/training.md, "
        '"Megatron-LM command lines")'
    ]
    width = max((len(r.key) for r in taken + kept), default=0)
    lines += [
        f"  {r.key:<{width}}  {r.value!r:<10} ({r.flag or 'no flag'}; meshtrain's default: "
        f"{r.meshtrain!r})"
        for r in taken
    ]
    lines += [f"  {r.key:<{width}}  {r.meshtrain!r:<10} kept: {r.why}" for r in kept]
    return "\n".join(lines)
