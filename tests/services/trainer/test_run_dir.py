"""One run directory, one trainer: `meshtrain train` processes into a folder that another holds."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.trainer.config.load import load_config, replace
from meshtrain.services.trainer.rpc.server import ControlEndpoint
from meshtrain.services.trainer.run_dir import claim_run_dir, release_run_dir
from meshtrain.services.trainer.train import Trainer, train
from tests.services.trainer.conftest import small_job_args

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _meshtrain(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.services.cli", *map(str, args)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        **kw,
    )


def _wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.stat().st_size):
        if process.poll() is not None:
            pytest.fail(
                f"the first trainer exited ({process.returncode}) before writing {path}: "
                f"{process.communicate()[1][-3000:]}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"no {path} after {timeout_s} s")
        time.sleep(0.2)


@pytest.mark.e2e
def test_a_second_train_into_a_run_dir_in_use_is_refused_and_the_folder_is_free_once_the_first_ends(
    tmp_path, corpus_cache
):
    # Reproduced: a second `meshtrain train --log.run_dir R` beside a running one trained too; its
    # start dropped the first's metrics.jsonl rows and its config.toml replaced the first's.
    run = tmp_path / "run"
    args = small_job_args(
        corpus_cache,
        run,
        **{"train.train_iters": 100_000, "train.eval_interval": 0, "train.control_port": 0},
    )
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "train",
            *args,
            f"--checkpoint.save={tmp_path / 'a'}",
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(run / "control.addr", first)
        config = (run / "config.toml").read_text()
        # a short run: on the old code it trained to the end beside the first
        second = _meshtrain(
            "train",
            *small_job_args(corpus_cache, run, **{"train.train_iters": 3}),
            f"--checkpoint.save={tmp_path / 'b'}",
        )
        up = _meshtrain(
            "up",
            *[a for a in args if not a.startswith("--train.control_port")],
            "--data-workers",
            0,
        )
        status = _meshtrain("status", run)
    finally:
        stop = _meshtrain("stop", run)
        _, err = first.communicate(timeout=120)
    assert second.returncode == 2, second.stderr[-3000:]
    assert (
        f"run directory {run} is in use by another trainer (pid {first.pid}); stop it first "
        f"(`meshtrain stop {run}`) or give this run another --log.run_dir"
    ) in second.stderr, second.stderr
    assert not (tmp_path / "b").exists()
    assert up.returncode == 2 and f"{run} is in use by a trainer (pid {first.pid})" in up.stderr, (
        up.stderr
    )
    assert (run / "config.toml").read_text() == config
    assert status.returncode == 0 and "step" in status.stdout, status.stdout + status.stderr
    assert stop.returncode == 0, stop.stderr
    assert first.returncode == 0, err[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, steps[-1] + 1))  # the first's rows, all of them, once

    # The lock went with the process: resuming the run into its own folder is not refused.
    again = _meshtrain(
        "train",
        *small_job_args(
            corpus_cache, run, **{"train.train_iters": steps[-1] + 2, "train.eval_interval": 0}
        ),
        f"--checkpoint.load={tmp_path / 'a'}",
        f"--checkpoint.save={tmp_path / 'a'}",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr


@pytest.mark.e2e
def test_one_rank_holds_the_run_dir_of_a_multi_rank_launch(tmp_path, corpus_cache):
    """Every rank writes into one folder; only rank 0 locks it, so the ranks do not refuse
    each other, and a launch refused by another's run stops all its ranks."""
    run = tmp_path / "run"
    args = small_job_args(corpus_cache, run, **{"train.train_iters": 2, "train.eval_interval": 0})
    both = _meshtrain(
        "train", "--nproc-per-node", 2, *args, f"--checkpoint.save={tmp_path / 'ckpt'}"
    )
    assert both.returncode == 0, both.stderr[-3000:]
    assert (run / ".train.lock").exists()

    holder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "train",
            *small_job_args(
                corpus_cache,
                run,
                **{"train.train_iters": 100_000, "train.eval_interval": 0, "train.control_port": 0},
            ),
            f"--checkpoint.save={tmp_path / 'holder'}",
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(run / "control.addr", holder)
        refused = _meshtrain(
            "train", "--nproc-per-node", 2, *args, f"--checkpoint.save={tmp_path / 'other'}"
        )
    finally:
        _meshtrain("stop", run)
        holder.communicate(timeout=120)
    assert refused.returncode != 0
    assert (
        f"run directory {run} is in use by another trainer (pid {holder.pid})" in refused.stderr
    ), refused.stderr[-3000:]


def _holder_seen_from_another_process(run: Path) -> str:
    """The pid another process finds holding RUN/.train.lock, or 'None'."""
    code = (
        "import sys; from pathlib import Path; "
        "from meshtrain.services.common.run_locks import probe_lock; "
        "print(probe_lock(Path(sys.argv[1])))"
    )
    probe = subprocess.run(
        [sys.executable, "-c", code, str(run / ".train.lock")],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return probe.stdout.strip()


def test_a_run_in_a_living_process_releases_its_folder_when_it_ends(
    tmp_path, corpus_cache, monkeypatch
):
    # Reproduced: train() called from a notebook or a script that goes on kept RUN/.train.lock
    # until that process exited, so `meshtrain train --log.run_dir RUN` (a resume) was refused
    # naming a trainer that had finished long before; so did a Trainer whose construction failed.
    run = tmp_path / "run"
    job = load_config(
        small_job_args(corpus_cache, run, **{"train.train_iters": 2, "train.eval_interval": 0})
    )
    train(job)
    assert _holder_seen_from_another_process(run) == "None"

    with pytest.raises(CheckpointError):
        Trainer(replace(job, checkpoint={"load": str(tmp_path / "missing")}))
    assert _holder_seen_from_another_process(run) == "None"

    # With a control endpoint the folder is let go only once the endpoint has removed its
    # control.addr: a trainer let in before that would have its own address file removed.
    seen_while_stopping = []
    stop = ControlEndpoint.stop

    def spied_stop(endpoint, *args, **kwargs):
        seen_while_stopping.append(_holder_seen_from_another_process(run))
        return stop(endpoint, *args, **kwargs)

    monkeypatch.setattr(ControlEndpoint, "stop", spied_stop)
    monkeypatch.setenv("MESHTRAIN_METRICS_PORT", "0")
    train(replace(job, train={"control_port": 0}, checkpoint={"save": str(tmp_path / "second")}))
    assert seen_while_stopping == [str(os.getpid())]
    assert _holder_seen_from_another_process(run) == "None" and not (run / "control.addr").exists()

    # Two claims in one process (two Trainers into one folder):
    # the folder is held until both let go.
    claim_run_dir(run)
    claim_run_dir(run)
    release_run_dir(run)
    assert _holder_seen_from_another_process(run) == str(os.getpid())
    release_run_dir(run)
    assert _holder_seen_from_another_process(run) == "None"


def test_a_start_that_fails_removes_the_empty_run_dir_it_created_and_no_other(
    tmp_path, corpus_cache
):
    # Reproduced: a resume with a mistyped --checkpoint.load left runs/<time> holding only
    # config.toml and .train.lock, one more empty run for each try.
    missing = {"checkpoint.load": str(tmp_path / "missing")}
    new = tmp_path / "runs" / "new"
    with pytest.raises(CheckpointError):
        Trainer(load_config(small_job_args(corpus_cache, new, **missing)))
    assert not new.exists() and (tmp_path / "runs").is_dir()  # only the folder it made

    mine = tmp_path / "mine"  # the user's folder, there before: kept, with what the start wrote
    mine.mkdir()
    with pytest.raises(CheckpointError):
        Trainer(load_config(small_job_args(corpus_cache, mine, **missing)))
    assert mine.is_dir() and (mine / "config.toml").exists()
    (mine / "config.toml").unlink()
    claim_run_dir(mine)  # and free for the next run
    release_run_dir(mine, failed_start=True)
    assert mine.is_dir()
