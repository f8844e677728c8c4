"""Megatron-LM command lines take Megatron-LM's defaults for what they leave out
(services/trainer/config/megatron_defaults.py): the table agrees with meshtrain's config classes
and with the installed megatron-core, examples/megatron_pretrain_gpt.sh resolves to it, and
meshtrain's own command lines keep meshtrain's defaults."""

import dataclasses
import logging
import re
import subprocess
from pathlib import Path

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.flags import accepted_flags
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.config.megatron import classify
from meshtrain.services.trainer.config.megatron_defaults import (
    DEFAULTS,
    MEGATRON_LM_COMMIT,
    REQUIRED_FLAGS,
    is_megatron_command_line,
)
from meshtrain.services.trainer.config.sections import JobConfig

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "megatron_pretrain_gpt.sh"
TINY = str(REPO / "deploy" / "configs" / "tiny.toml")


def resolved(job: JobConfig, dotted: str):
    section, _, key = dotted.partition(".")
    return getattr(getattr(job, section), key)


def example_args() -> list[str]:
    """The words examples/megatron_pretrain_gpt.sh gives `meshtrain train`, read by running it
    with a `meshtrain` that prints them."""
    proc = subprocess.run(
        [
            "bash",
            "-c",
            'meshtrain() { printf "%s\\n" "$@"; }; export -f meshtrain; bash "$0"',
            str(EXAMPLE),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    words = proc.stdout.splitlines()
    assert words[0] == "train"
    return words[1:]


def test_the_table_holds_meshtrain_defaults_as_the_config_classes_do():
    assert re.fullmatch(r"[0-9a-f]{40}", MEGATRON_LM_COMMIT)
    defaults = JobConfig()
    known = set(accepted_flags())
    for row in DEFAULTS:
        assert resolved(defaults, row.key) == row.meshtrain, row.key
        assert row.kind in ("taken", "kept", "same_result")
        if row.kind == "taken":
            assert row.value != row.meshtrain and not row.why, row.key
        else:
            assert row.value is None and row.why, row.key
        assert row.flag == "" or row.flag in known or classify(row.flag) is not None, row.flag
    assert len({row.key for row in DEFAULTS}) == len(DEFAULTS)


def test_the_table_agrees_with_the_installed_megatron_core():
    """megatron-core's config dataclasses hold the same defaults as Megatron-LM's parser for the
    settings they share (its version need not be the pinned commit's: these have not moved)."""
    pytest.importorskip("megatron.core")
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    transformer = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    optimizer = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    by_flag = {row.flag: row.megatron for row in DEFAULTS}
    for flag, fields in (
        ("--hidden-dropout", transformer),
        ("--attention-dropout", transformer),
        ("--fp8-recipe", transformer),
        ("--moe-grouped-gemm", transformer),
        ("--weight-decay", optimizer),
        ("--adam-beta2", optimizer),
    ):
        assert fields[flag[2:].replace("-", "_")] == by_flag[flag], flag


def test_the_example_script_resolves_to_megatron_lm_defaults(caplog):
    args = example_args()
    assert is_megatron_command_line(args, None)
    with caplog.at_level(logging.WARNING, logger="meshtrain.config"):
        job = load_config(args)
    given = {word for word in args if word.startswith("--")}
    taken = [row for row in DEFAULTS if row.kind == "taken" and row.flag not in given]
    assert {row.key for row in taken} == {
        "model.hidden_dropout",
        "model.attention_dropout",
        "optim.weight_decay",
        "optim.adam_beta2",
        "optim.min_lr",
        "optim.lr_decay_style",
        "optim.decay_embeddings",
        "train.fp8_recipe",
        "train.eval_iters",
        "log.log_interval",
    }
    for row in taken:
        assert resolved(job, row.key) == row.value, row.key
        assert re.search(rf"\n  {re.escape(row.key)} +{re.escape(repr(row.value))} ", caplog.text)
    # what the script gives stays its own; meshtrain's GELU is --openai-gelu's, so nothing is kept
    assert (job.model.num_layers, job.train.global_batch_size, job.train.eval_interval) == (
        4,
        16,
        25,
    )
    assert job.model.activation == "gelu" and "kept:" not in caplog.text
    assert caplog.text.count("a Megatron-LM command line") == 1


def test_a_key_the_command_line_sets_keeps_its_value(caplog):
    args = [
        *example_args(),
        "--hidden-dropout",
        "0.0",
        "--optim.weight_decay=0.2",
        "--global-batch-size",
        "8",
    ]
    with caplog.at_level(logging.WARNING, logger="meshtrain.config"):
        job = load_config([w for w in args if w != "--openai-gelu"])
    assert (job.model.hidden_dropout, job.optim.weight_decay, job.model.attention_dropout) == (
        0.0,
        0.2,
        0.1,
    )
    assert "model.hidden_dropout" not in caplog.text and "optim.weight_decay" not in caplog.text
    # without --openai-gelu the run says its GELU is not Megatron-LM's default one
    assert re.search(r"model\.activation +'gelu' +kept: Megatron-LM's default GELU", caplog.text)


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"],
        [
            "--config",
            TINY,
            "--num-layers=2",
            "--hidden-size=64",
            "--num-attention-heads=4",
            "--max-position-embeddings=256",
        ],  # fmt: skip
        ["--model.num_layers=2", "--train-iters", "5", "--tensor-model-parallel-size", "1"],
    ],
)
def test_meshtrain_command_lines_keep_meshtrain_defaults(args, caplog):
    """Without all of Megatron-LM's required flags, or with a meshtrain config file, nothing of
    Megatron-LM's is taken."""
    with caplog.at_level(logging.WARNING, logger="meshtrain.config"):
        job = load_config(args)
    base = load_config(["--config", TINY]) if "--config" in args else JobConfig()
    for row in DEFAULTS:
        assert resolved(job, row.key) == resolved(base, row.key), row.key
    assert "Megatron-LM command line" not in caplog.text


def test_the_rule_reads_both_spellings_of_the_required_flags():
    words = [f"{flag}=8" for flag in REQUIRED_FLAGS]
    assert is_megatron_command_line(words, None)
    assert not is_megatron_command_line(words, "a.toml")
    assert not is_megatron_command_line(words[:-1], None)


def test_openai_gelu_is_the_gelu_and_refused_with_swiglu():
    assert load_config(["--openai-gelu"]).model.activation == "gelu"
    with pytest.raises(ConfigError, match="--openai-gelu asks for a GELU MLP.*--swiglu"):
        load_config(["--swiglu", "--openai-gelu"])
