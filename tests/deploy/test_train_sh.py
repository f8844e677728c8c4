"""deploy/train.sh's resume decision, run for real with `meshtrain` and `torchrun`
stubbed on PATH."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def run_train_sh(
    tmp_path, steps_output: str | None, *args: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ckpt_list = (
        f"printf '{steps_output}'"
        if steps_output is not None
        else "echo 'meshtrain: error: could not connect' >&2; exit 2"
    )
    # without --allow-empty, `ckpt list` of a root with no checkpoint is an error (exit 2)
    allow_empty = (
        '[ "$3" = --allow-empty ] || '
        '{ echo "meshtrain: error: no committed checkpoint" >&2; exit 2; }'
    )
    (bin_dir / "meshtrain").write_text(f"#!/bin/sh\n{allow_empty}\n{ckpt_list}\n")
    (bin_dir / "torchrun").write_text(
        '#!/bin/sh\necho "shutdown timeout: ${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-unset}" >&2\n'
        'for a in "$@"; do echo "$a"; done\n'
    )
    # the write probe: succeeds unless PROBE_STATUS says otherwise
    (bin_dir / "probe-python").write_text(
        '#!/bin/sh\necho "probed: $*" >&2\nexit "${PROBE_STATUS:-0}"\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": str(bin_dir / "probe-python"),
        "SAVE_ROOT": "s3://b/run1/ckpt",
        **(env or {}),
    }
    return subprocess.run(
        ["sh", str(REPO / "deploy/train.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_requeued_job_resumes_from_its_own_latest_checkpoint_over_a_starting_load(tmp_path):
    r = run_train_sh(
        tmp_path, "5\\n10\\n", "--config", "c.toml", "--load", "/models/init", "--ckpt-step", "3"
    )
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split()
    assert argv[-6:] == [
        "--save",
        "s3://b/run1/ckpt",
        "--load",
        "s3://b/run1/ckpt",
        "--ckpt-step",
        "10",
    ]
    assert "resuming from s3://b/run1/ckpt step 10" in r.stderr


def test_a_fresh_root_starts_from_the_callers_arguments(tmp_path):
    r = run_train_sh(
        tmp_path, "", "--load", "/models/init"
    )  # what `ckpt list --allow-empty` prints there
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split()
    assert argv[-4:] == ["--load", "/models/init", "--save", "s3://b/run1/ckpt"]


@pytest.mark.parametrize("args", [(), ("--load", "/models/init")])
def test_a_root_that_cannot_be_listed_stops_the_job_instead_of_starting_over(tmp_path, args):
    r = run_train_sh(tmp_path, None, *args)
    assert r.returncode == 1 and r.stdout == ""
    assert "cannot list s3://b/run1/ckpt; not starting" in r.stderr


def test_torchrun_leaves_the_ranks_the_deployments_grace_to_checkpoint_not_its_30_s(tmp_path):
    """torchrun SIGKILLs its ranks `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (default 30) s after passing
    SIGTERM on: a final checkpoint that takes longer was lost. The ranks get nearly compose's
    stop_grace_period (torchrun must still kill before Docker does) and a caller's value wins."""
    compose = yaml.safe_load((REPO / "deploy/compose.yaml").read_text())
    grace = int(compose["services"]["trainer"]["stop_grace_period"].rstrip("s"))
    r = run_train_sh(tmp_path, "")
    assert r.returncode == 0, r.stderr
    assert "shutdown timeout: unset" not in r.stderr, "torchrun would SIGKILL the ranks after 30 s"
    timeout = int(r.stderr.split("shutdown timeout: ")[1].split()[0])
    assert 120 <= timeout < grace  # 120: what Slurm's --signal=B:TERM@120 leaves
    r = run_train_sh(tmp_path, "", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600"})
    assert "shutdown timeout: 600" in r.stderr


def test_a_root_that_takes_no_write_stops_the_job_with_74_before_training(tmp_path):
    """Under compose's restart policy (or a requeue) a run whose checkpoint storage takes no
    write trained up to its first save, failed there and started again from step 0, forever:
    train.sh asks the storage first and exits 74 (checkpoint storage failed) without training."""
    r = run_train_sh(tmp_path, "", env={"PROBE_STATUS": "74"})
    assert r.returncode == 74 and r.stdout == "", r.stderr  # torchrun never ran
    assert "probed: -m meshtrain.services.checkpoint.write_probe s3://b/run1/ckpt" in r.stderr
    assert "s3://b/run1/ckpt takes no write; not starting (exit status 74" in r.stderr
    skipped = run_train_sh(tmp_path, "", env={"PROBE_STATUS": "74", "CHECK_SAVE_ROOT": "0"})
    assert skipped.returncode == 0 and "probed" not in skipped.stderr


def test_the_write_probe_itself_on_a_folder_that_takes_writes_and_one_that_does_not(tmp_path):
    python = [sys.executable, "-m", "meshtrain.services.checkpoint.write_probe"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    good = subprocess.run(
        [*python, str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=60
    )
    assert good.returncode == 0, good.stderr
    assert list((tmp_path / "ckpt").iterdir()) == []  # the probe object is removed
    (tmp_path / "file").write_text("")
    bad = subprocess.run(
        [*python, str(tmp_path / "file" / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 74
    assert f"checkpoint storage failed: {tmp_path / 'file' / 'ckpt'} takes no write" in bad.stderr
