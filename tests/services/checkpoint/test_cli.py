"""`meshtrain ckpt serve | list | inspect | verify | delete` as a user runs them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.services.checkpoint.rpc.client import CheckpointClient
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.cli import main


def run(capsys, *args):
    code = main(["ckpt", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_verify_delete_and_retention(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    for step in (1, 2, 3, 4):
        save_checkpoint(root, step, {"layers.0.w": torch.ones(3), "layers.1.w": torch.zeros(3)})
    code, out = run(capsys, "verify", root, "--all")
    assert code == 0 and "step 4: 4 objects verified" in out
    path = Path(root) / "step_00000004/layers.w/c/1/0"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    code, out = run(capsys, "verify", root)
    assert code == 2 and "array 'layers.w' object 'c/1/0'" in out and "corrupt" in out
    code, out = run(capsys, "delete", root, "--step", 4)
    assert code == 0 and not os.path.exists(f"{root}/step_00000004")
    code, out = run(capsys, "delete", root, "--step", 4)
    assert code == 2 and "no checkpoint step 4" in out
    os.makedirs(f"{root}/step_00000009/w")  # uncommitted: a crash's leftover, or a live run's save
    code, out = run(capsys, "delete", root, "--keep-last", 1, "--keep-every", 2)
    assert code == 0 and "deleted steps [1]" in out and os.path.exists(f"{root}/step_00000009")
    code, out = run(capsys, "list", root)
    assert out.split() == ["2", "3"]
    code, out = run(capsys, "delete", root, "--collect-leftovers")  # only when asked
    assert (
        code == 0
        and "removed uncommitted leftovers [9]" in out
        and not os.path.exists(f"{root}/step_00000009")
    )
    code, out = run(capsys, "delete", root)
    assert code == 2 and "give --step N" in out


def test_verify_takes_a_step_or_all_not_both(tmp_path, capsys):
    # with both it verified the one step and ignored --all without a word
    root = str(tmp_path / "ckpt")
    for step in (1, 2, 3):
        save_checkpoint(root, step, {"w": torch.ones(2)})
    with pytest.raises(SystemExit) as e:
        main(["ckpt", "verify", root, "--step", "2", "--all"])
    assert (
        e.value.code == 2
        and "argument --all: not allowed with argument --step" in capsys.readouterr().err
    )


@pytest.mark.parametrize("keep_last", [[], ["--keep-last", 0]], ids=["absent", "zero"])
def test_keep_every_without_keep_last_deletes_nothing(tmp_path, capsys, keep_last):
    # alone it used to delete every non-multiple of K, the newest checkpoint included
    root = str(tmp_path / "ckpt")
    for step in (10, 20, 25):
        save_checkpoint(root, step, {"w": torch.ones(2)})
    code, out = run(capsys, "delete", root, "--keep-every", 10, *keep_last)
    assert code == 2 and "--keep-every 10 needs --keep-last N with N >= 1" in out
    assert run(capsys, "list", root)[1].split() == ["10", "20", "25"]


@pytest.mark.e2e
def test_serve_answers_and_stops_on_sigterm(tmp_path):
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 5, {"w": torch.ones(2)})
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "ckpt",
            "serve",
            root,
            "--port",
            "0",
            "--grace",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        with CheckpointClient(line.split()[-1]) as client:
            assert client.list() == [5]
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.e2e
def test_storage_errors_are_named_not_tracebacks(tmp_path, capsys, s3_root, monkeypatch):
    """A destination that is a file, and S3 keys the store refuses, are a user's setup errors:
    every `ckpt` command raised the storage library's own exception (NotADirectoryError,
    PermissionError) as a traceback. Now exit 2 with the command, its paths and the cause."""
    src = str(tmp_path / "ckpt")
    save_checkpoint(src, 3, {"layers.0.w": torch.ones(3)}, {})
    (tmp_path / "file").write_text("not a folder")
    code, out = run(capsys, "convert", src, tmp_path / "file")
    assert (
        code == 2
        and f"ckpt convert {src} {tmp_path / 'file'}: storage failed: NotADirectoryError" in out
    ), out
    assert "Traceback" not in out and (tmp_path / "file").read_text() == "not a folder"
    assert run(capsys, "convert", src, s3_root)[0] == 0
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    for command in (
        ["list", s3_root],
        ["verify", s3_root],
        ["convert", s3_root, tmp_path / "back"],
    ):
        code, out = run(capsys, *command)
        assert code == 2 and f"ckpt {command[0]} {s3_root}" in out and "PermissionError" in out, out


def test_verify_reports_a_step_whose_manifest_is_damaged(tmp_path, capsys):
    """A manifest is written whole (renamed into place), so one that does not parse is damage;
    every reader then takes the step for an uncommitted save and passes over it, and `verify`
    (--all, or the default: the latest) said every step was fine. A manifest of a format this
    reader does not know is named the same way."""
    root = str(tmp_path / "ckpt")
    for step in (1, 2, 3):
        save_checkpoint(root, step, {"layers.0.w": torch.ones(3)})
    manifest = tmp_path / "ckpt" / "step_00000002" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:50])
    code, out = run(capsys, "verify", root, "--all")
    assert code == 2 and "step 1: " in out and "step 3: " in out, out
    assert "checkpoint step 2 under" in out and "manifest.json is incomplete or not JSON" in out, (
        out
    )
    assert run(capsys, "verify", root)[0] == 0  # the latest, 3, is newer than the damage
    code, out = run(capsys, "list", root)  # listed: the readable steps; named: the damaged one
    assert code == 0 and out.split("warning")[0].split() == ["1", "3"], out
    assert "not listed: checkpoint step 2 under" in out, out
    newest = tmp_path / "ckpt" / "step_00000003" / "manifest.json"
    newest.write_text(newest.read_text().replace('"format_version": ', '"format_version": 9'))
    code, out = run(capsys, "verify", root)
    assert (
        code == 2
        and "step 1: " in out
        and "checkpoint step 3 under" in out
        and "format_version 9" in out
    ), out


@pytest.mark.parametrize("command", ["list", "inspect", "verify"])
def test_no_checkpoint_is_an_error_that_tells_a_missing_path_from_an_empty_folder(
    tmp_path, capsys, command
):
    code, out = run(capsys, command, tmp_path / "typo")
    assert code == 2 and "no such path" in out and len(out.strip().splitlines()) == 1
    code, out = run(capsys, command, tmp_path)
    assert (
        code == 2 and "no committed checkpoint under" in out and len(out.strip().splitlines()) == 1
    )


def test_list_allow_empty_lists_nothing_for_a_root_without_checkpoints(tmp_path, capsys):
    """deploy/train.sh starts a run in a root that may not exist yet: it asks with --allow-empty."""
    for root in (tmp_path / "not-yet", tmp_path):
        code, out = run(capsys, "list", "--allow-empty", root)
        assert code == 0 and out == ""


def test_export_and_import_default_format_to_hf(tmp_path, capsys):
    # --format was required though 'hf' is its only value: argparse stopped the command
    code, out = run(capsys, "export", tmp_path / "nothing", tmp_path / "out")
    assert code == 2 and "--format" not in out
