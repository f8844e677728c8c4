"""Loading the trainer's job config: defaults, a TOML file, then command-line overrides.

Sources apply in order: defaults, the `--config FILE` TOML, then command-line overrides, either
`--section.key=value` or a Megatron-style alias (`--hidden-size 768`, `--bf16`; `flags.py`).
Unknown keys, wrong types and flags for features that are not built yet are errors that name
the key; keys of removed options are dropped or refused here (`REMOVED_KEYS`). `replace` copies
a job with some fields changed and validates it again; `config_help` lists every key.

    meshtrain train --config deploy/configs/tiny.toml --train-iters 50 --model.num_layers=4
    meshtrain train --help-config        # every key, its type, default and documentation
"""

from __future__ import annotations

import logging
from typing import Any

from meshtrain.services.common import config as cfg
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.flags import accepted_flags, parse_overrides
from meshtrain.services.trainer.config.megatron import NO_EFFECT
from meshtrain.services.trainer.config.megatron_defaults import (
    DEFAULTS,
    is_megatron_command_line,
    report,
    taken_table,
)
from meshtrain.services.trainer.config.sections import JobConfig

log = logging.getLogger("meshtrain.config")


REMOVED_KEYS: dict[str, tuple[Any, str]] = {
    "parallel.tp_batch_split": (
        False,
        "splitting each micro-batch to hide TP's forward reductions measured "
        "slower at llama-1b TP=2 on two H200s",
    ),
    "train.compile_overlap_scheduling": (
        False,
        "Inductor's overlap scheduler gained nothing at llama-1b TP=2 on two H200s",
    ),
    "train.matmul_sm_carveout": (
        0,
        "leaving SMs free of matmuls for NCCL measured slower at llama-1b TP=2 on two H200s",
    ),
    "parallel.tp_reduce_impl": (
        "nccl",
        "the symmetric-memory forward all-reduce was no faster than NCCL's end to "
        "end at llama-1b TP=2 on two H200s",
    ),
}
"""Options that were removed: the value every config written before held (their default) and
why they went (BENCHMARKS.md has the measurements). A run directory's config.toml holds every
key and is meant to be read again (`--config RUN/config.toml`), so that value is dropped with a
warning; any other value asked for the removed behaviour and is refused."""


def _drop_removed_keys(table: dict[str, Any]) -> dict[str, Any]:
    for dotted, (old_default, why) in REMOVED_KEYS.items():
        section, _, key = dotted.partition(".")
        values = table.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        if type(values[key]) is not type(old_default) or values[key] != old_default:
            raise ConfigError(
                f"{dotted}={values[key]!r}: the option was removed ({why}); remove the key"
            )
        log.warning(
            "%s=%r: the option was removed (%s); read as absent: remove the key",
            dotted,
            old_default,
            why,
        )
        table = {**table, section: {k: v for k, v in values.items() if k != key}}
    return table


def _leaves(table: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in table.items():
        out.extend(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key])
    return out


def _check_flag_keys(overrides: dict[str, Any]) -> None:
    """Refuse a mistyped `--section.key` flag here, where it can be named as the flag it was
    and matched against every key of every section (`--modle.num_layers` finds
    `--model.num_layers`), rather than later as a key of one section."""
    known = sorted(cfg.leaf_keys(JobConfig))
    allowed = set(known) | set(REMOVED_KEYS)
    for dotted in _leaves(overrides):
        parts = dotted.split(".")
        # a prefix that is a key is a table-valued field given a nested value: build checks it
        if any(".".join(parts[:i]) in allowed for i in range(1, len(parts) + 1)):
            continue
        near = cfg.close_matches(dotted, known)
        hint = (
            f"did you mean {' or '.join('--' + m for m in near)}?"
            if near
            else "`meshtrain train --help-config` lists the keys"
        )
        raise ConfigError(f"unknown flag --{dotted}; {hint}")


def load_config(args: list[str] | None = None, base: dict[str, Any] | None = None) -> JobConfig:
    """Build a JobConfig from a TOML file and command-line overrides.

    Args:
        args: command-line words after `meshtrain train` (may include `--config FILE`).
        base: an extra table applied before the file (used by tests and tools).

    Returns:
        The validated JobConfig.
    """
    args = list(args or [])
    config_file, overrides = parse_overrides(args)
    _check_flag_keys(overrides)
    table: dict[str, Any] = dict(base or {})
    if config_file:
        table = cfg.deep_merge(table, cfg.load_toml(config_file))
    table = cfg.deep_merge(table, overrides)
    taken: list[Any] = []
    if is_megatron_command_line(args, config_file):
        unset = {row.key for row in DEFAULTS if not _is_set(table, row.key)}
        note = report(unset)
        if note:
            log.warning("%s", note)
        taken = [row for row in DEFAULTS if row.kind == "taken" and row.key in unset]
        table = cfg.deep_merge(taken_table(), table)
    try:
        return cfg.build(JobConfig, _drop_removed_keys(table))
    except ConfigError as e:
        # A value the user never wrote is named as Megatron-LM's default, with the flag to change.
        named = [row for row in taken if row.key in str(e)]
        if not named:
            raise
        lines = [
            f"{row.key}={row.value!r} is Megatron-LM's default{' ' + row.flag if row.flag else ''}"
            ", taken because this is a Megatron-LM command line"
            + (f": give {row.flag} to choose another" if row.flag else f": give --{row.key}")
            for row in named
        ]
        raise ConfigError("\n".join([str(e), *lines])) from None


def _is_set(table: dict[str, Any], dotted: str) -> bool:
    section, _, key = dotted.partition(".")
    values = table.get(section)
    return isinstance(values, dict) and key in values


LAUNCHER_KEYS_ENV = "MESHTRAIN_LAUNCHER_KEYS"
"""Set by `meshtrain up` on the trainer it starts: the keys ("section.key", space-separated) it
pointed at its own services, whose addresses end with it; `run_dir.run_dir_toml` leaves them out."""


def replace(job: JobConfig, **sections: dict[str, Any]) -> JobConfig:
    """A copy of `job` with some section fields changed, re-validated (e.g. vocab_size)."""
    table = cfg.to_dict(job)
    for name, values in sections.items():
        table[name] = {**table[name], **values}
    return cfg.build(JobConfig, table)


def config_help() -> str:
    """Every key with its type, default and documentation, grouped by section."""
    lines = []
    for key, tp, default, doc in cfg.describe_keys(JobConfig):
        lines.append(f"  --{key}  ({tp}; default {default})")
        if doc:
            lines.extend(f"      {line}" for line in doc.splitlines())
    aliases = ", ".join(accepted_flags())
    no_effect = ", ".join(sorted(NO_EFFECT))
    return (
        "Config keys:\n" + "\n".join(lines) + f"\n\nMegatron aliases: {aliases}\n"
        f"\nMegatron flags accepted without effect (with a warning): {no_effect}\n"
    )
