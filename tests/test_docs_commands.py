"""The shell commands README.md and docs/*.md show are commands that work as written.

Every line of a ```bash block is read. A `meshtrain` command (also as `python -m meshtrain`,
under torchrun or srun) must name a subcommand the CLI has and flags that subcommand (or, for
`train` and `up`, the trainer's config) knows; a synopsis's `[--flag]` and `A|B` are read the
same way. `make` targets must be the Makefile's, scripts must exist. The cheap commands (help,
the tokenizer and preprocessing of a tiny corpus, listing a fresh checkpoint root) are then run
in a subprocess in the installed environment, the interpreter's bin folder first on PATH, as a
user has it after `make run` and `source .venv/bin/activate`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.services.cli import build_parser
from meshtrain.services.common.config import describe_keys
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.flags import parse_overrides
from meshtrain.services.trainer.config.sections import JobConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Placeholders the pages write in capitals, and what a run of the command gets instead.
PLACEHOLDERS = {"ROOT": "ckpt", "CKPT": "ckpt", "RUN_DIR": "run", "OUT": "out"}


def shell_commands(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of every command in the page's ```bash blocks: continuation lines
    joined, comments dropped, here-document bodies skipped."""
    commands: list[tuple[int, str]] = []
    lines = page.read_text().splitlines()
    inside, heredoc, pending, start = False, None, "", 0
    for number, line in enumerate(lines, 1):
        if not inside:
            inside = line.strip() == "```bash"
            continue
        if line.strip() == "```":
            inside = False
            continue
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if not pending:
            start = number
        pending += line.rstrip("\\") + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        words = shlex.split(pending, comments=True)
        pending = ""
        marker = re.search(r"<<-?'?(\w+)'?", line)
        if marker:
            heredoc = marker.group(1)
        if words:
            commands.append((start, shlex.join(words)))
    return commands


ALL = [(page, n, cmd) for page in PAGES for n, cmd in shell_commands(page)]
IDS = [f"{page.name}:{n}" for page, n, _ in ALL]


def meshtrain_words(words: list[str]) -> list[str] | None:
    """The words after `meshtrain` (or `-m meshtrain`), None for another program."""
    for i, word in enumerate(words):
        if word == "meshtrain" and (i == 0 or words[i - 1] == "-m"):
            return words[i + 1 :]
    return None


def _subcommand(words: list[str]) -> tuple[list[str], argparse.ArgumentParser, list[str]]:
    """(subcommand path, its parser, the words after it)."""
    parser, path = build_parser(), []
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return path, parser, words
        assert words and words[0] in subs[0].choices, (
            f"meshtrain {' '.join(path)}: no subcommand {words[:1]}; have {sorted(subs[0].choices)}"
        )
        path.append(words[0])
        parser, words = subs[0].choices[words[0]], words[1:]


# A flag the pages show as a deliberate mistake (how an error reads); run, it must fail with 2.
MISTAKE = "--bogus"

CONFIG_KEYS = {key for key, *_ in describe_keys(JobConfig)}


def _trainer_knows(flag: str) -> bool:
    """Whether the trainer's command line takes `flag` (a config key, an alias, a switch)."""
    if flag == "--config":
        return True
    if "." in flag:
        return flag[2:] in CONFIG_KEYS
    try:
        parse_overrides([flag])
    except ConfigError as e:
        return not str(e).startswith("unknown flag")
    return True


def unknown_flags(words: list[str]) -> list[str]:
    """The flags of a meshtrain command that its subcommand does not know."""
    path, parser, rest = _subcommand(words)
    known = set(parser._option_string_actions)
    flags = []
    for word in rest:
        for part in word.split("|"):
            part = part.strip("[]()")
            if part.startswith("--"):
                flags.append(part.split("=", 1)[0])
    takes_overrides = path in (["train"], ["up"], ["dpo", "reference"])
    return [
        f
        for f in flags
        if f not in known
        and not f.startswith(MISTAKE)
        and not (takes_overrides and _trainer_knows(f))
    ]


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, re.M))


@pytest.mark.parametrize("page,line,command", ALL, ids=IDS)
def test_a_shown_command_names_what_exists(page, line, command):
    words = shlex.split(command)
    mesh = meshtrain_words(words)
    if mesh is not None:
        assert not unknown_flags(mesh), f"{page.name}:{line}: {command}: unknown flags"
    elif words[0] == "make":
        target = next((w for w in words[1:] if "=" not in w), None)
        assert target is None or target in make_targets(), f"{page.name}:{line}: {command}"
    elif words[0] == "source":
        venv = re.search(r"^VENV := (\S+)", (ROOT / "Makefile").read_text(), re.M)
        assert venv and words[1] == f"{venv.group(1)}/bin/activate", command
    elif words[0] in ("bash", "python") and words[1].endswith((".py", ".sh")):
        assert (ROOT / words[1]).is_file(), f"{page.name}:{line}: {command}"


def test_the_pages_show_commands_and_the_reader_finds_them():
    commands = [cmd for _, _, cmd in ALL]
    assert sum(meshtrain_words(shlex.split(c)) is not None for c in commands) >= 30
    assert "meshtrain train --help-config" in commands


def test_the_readme_says_how_to_reach_the_command():
    text = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in text and ".venv/bin/meshtrain" in text


def test_an_unknown_flag_is_found():
    assert unknown_flags(["train", "--nonsense", "--save", "X"]) == ["--nonsense"]
    assert unknown_flags(["ckpt", "list", "[--allow-empty]", "ROOT"]) == []
    assert unknown_flags(["ckpt", "verify", "ROOT", "[--step", "N", "|", "--al]"]) == ["--al"]
    assert unknown_flags(["train", "--model.num_layerz=2"]) == ["--model.num_layerz"]


# Model folders a page has the reader fetch from the Hugging Face Hub first.
DOWNLOADED_MODELS = {"Llama-3.2-1B-Instruct"}

# Cheap enough to run: help, and the own-data commands and listings on tiny inputs.
RUNNABLE = (
    ("train", "--help"),
    ("train", "--help-config"),
    ("data", "train-tokenizer"),
    ("data", "preprocess"),
    ("ckpt", "list"),
)


def _runnable(command: str) -> bool:
    mesh = meshtrain_words(shlex.split(command))
    if mesh is None or re.search(r"[\[|]|\.\.\.", command):  # not meshtrain, or a synopsis
        return False
    if "--help" in mesh or "--help-config" in mesh or MISTAKE in command:
        return True
    if mesh[:2] == ["data", "preprocess"] and "--tokenizer" not in mesh:
        return False  # a Megatron vocabulary file the test has not got
    if set(mesh) & DOWNLOADED_MODELS:
        return False  # its tokenizer is a model's folder the page has the reader download
    return tuple(mesh[:2]) in RUNNABLE


def _substitute(command: str) -> str:
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(command)]
    return shlex.join(words)


@pytest.mark.e2e
def test_the_cheap_shown_commands_run(tmp_path):
    """In one folder per page, in page order, so a page's tokenizer feeds its preprocessing."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "meshtrain").exists():
        pytest.skip(f"meshtrain is not installed next to {sys.executable}")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    ran = []
    for page in PAGES:
        work = tmp_path / page.stem
        (work / "corpus").mkdir(parents=True)
        (work / "ckpt").mkdir()
        docs = [
            {"text": f"document {i}: the quick brown fox jumps over the lazy dog"}
            for i in range(50)
        ]
        (work / "corpus" / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        shutil.copy(work / "corpus" / "a.jsonl", work / "corpus.jsonl")
        for _, line, command in [c for c in ALL if c[0] == page]:
            if not _runnable(command):
                continue
            out = subprocess.run(
                _substitute(command),
                shell=True,
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            where = f"{page.name}:{line}: {command}\n{out.stderr[-2000:]}"
            if MISTAKE in command:
                assert out.returncode == 2 and "meshtrain: error: unknown flag" in out.stderr, where
                ran.append(command)
                continue
            # A fresh root holds no step yet: `ckpt list` says so, exit 2, as the page says.
            empty = "ckpt list" in command and "no committed checkpoint under" in out.stderr
            assert out.returncode == 0 or (out.returncode == 2 and empty), where
            ran.append(command)
    assert any("--help-config" in c for c in ran)
    assert any("data preprocess" in c for c in ran)
    assert any(MISTAKE in c for c in ran)
