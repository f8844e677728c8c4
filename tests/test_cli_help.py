"""`meshtrain train --help` shows --config and the options most runs set first, each one a flag
the trainer accepts (the trainer parses them itself, so argparse would not notice a stale one)."""

import re

from meshtrain.services.cli import TRAIN_FIRST_OPTIONS, build_parser
from meshtrain.services.trainer.config.flags import ALIASES


def _train_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")  # the subcommands
    return sub.choices["train"].format_help()


def test_train_help_lists_the_first_options_and_points_to_help_config():
    text = _train_help()
    assert "--config FILE" in text and "--help-config" in text
    assert TRAIN_FIRST_OPTIONS.splitlines()[0] in text


def test_every_option_train_help_names_is_a_flag_the_trainer_accepts():
    named = set(re.findall(r"(--[a-z][a-z0-9-]*)", TRAIN_FIRST_OPTIONS)) - {"--help-config"}
    assert len(named) >= 12
    unknown = sorted(f for f in named if f != "--config" and f not in ALIASES)
    assert not unknown, unknown
