"""deploy/train.sh's resume decision, run for real with `meshtrain` and `torchrun`
stubbed on PATH."""

import os
import subprocess
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
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
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
