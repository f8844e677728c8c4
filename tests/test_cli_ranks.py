"""`meshtrain train --nproc-per-node 2` when a rank stops, dies or hangs: real ranks on gloo,
real signals; what the launcher does, what every rank logs, how long the job takes to end, and
what is left committed."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services.trainer.conftest import corpus_cache, small_job_args  # noqa: F401  (a fixture, found by name)
from tests.test_cli import ROOT, _errors, meshtrain


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the launcher's child processes with RANK in their environment (read from
    /proc, so it finds the ranks whichever way the launcher started them)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        ranks = [kv[5:] for kv in env if kv.startswith(b"RANK=")]
        if ranks:
            found[int(ranks[0])] = int(entry.name)
    return found


def _wait_while_running(proc, tmp_path: Path, ready, timeout: float) -> None:
    """Poll `ready()` until it is true; fail with the run's stderr (tmp_path/stderr) if the
    launcher `proc` exits or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, (
            tmp_path / "stderr"
        ).read_text()[-3000:]
        time.sleep(0.02)


def _both_ranks_started(proc, tmp_path: Path) -> dict[int, int]:
    """{rank: pid} once the launcher has started both ranks. What a scan found is kept: a rank
    caught while /proc could not read its environment (it was starting) drops out of the next."""
    found: dict[int, int] = {}

    def ready() -> bool:
        found.update(_rank_pids(proc.pid))
        return {0, 1} <= found.keys()

    _wait_while_running(proc, tmp_path, ready, 60)
    return found


def _steps_logged(proc, tmp_path: Path, metrics: Path, steps: int = 3, timeout: float = 60) -> None:
    """Return once `metrics` (a run's metrics.jsonl) holds `steps` records."""
    _wait_while_running(
        proc,
        tmp_path,
        lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= steps,
        timeout,
    )


def _signal_rank(proc, pid: int, sig: int, timeout: float) -> tuple[int, float]:
    """Send `sig` to a rank; (the launcher's exit status, seconds from the signal to its exit)."""
    os.kill(pid, sig)
    sent = time.monotonic()
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - sent


def _error_lines(tmp_path: Path) -> tuple[str, list[str]]:
    """(the run's stderr, tmp_path/stderr, and its 'meshtrain: error:' lines)."""
    err = (tmp_path / "stderr").read_text()
    return err, _errors(err)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _launch_two_ranks(tmp_path, cache):
    """`meshtrain train --nproc-per-node 2` (dp=2) on a ~0.2M-parameter model with a long schedule,
    returned once both ranks have logged step 3: (process, run directory, {rank: pid})."""
    run = tmp_path / "run"
    args = small_job_args(cache, run, **{"train.train_iters": 100_000, "train.eval_interval": 0})
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshtrain.services.cli",
                "train",
                "--nproc-per-node",
                "2",
                *args,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=err,
        )
    _steps_logged(proc, tmp_path, run / "metrics.jsonl", timeout=120)
    pids = _rank_pids(proc.pid)
    assert sorted(pids) == [0, 1], pids
    return proc, run, pids


@pytest.mark.e2e
@pytest.mark.dist
def test_nproc_per_node_sigterm_commits_a_checkpoint_and_exits_0(tmp_path, corpus_cache):  # noqa: F811
    """Preemption of a multi-rank launch: the launcher passes SIGTERM on to every rank, each
    checkpoints after the current step and exits 0, and so does the launcher (torchrun's agent
    reported its own SignalException instead: exit 1, "a rank failed")."""
    proc, run, pids = _launch_two_ranks(tmp_path, corpus_cache)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert code == 0, err[-3000:]
    steps = meshtrain("ckpt", "list", run / "checkpoints").stdout.split()
    assert len(steps) == 1 and 3 <= int(steps[0]) < 100_000, (steps, err[-3000:])
    # rank 0's summary reaches the launcher's stdout as it is
    assert (
        f"checkpoint    : {run / 'checkpoints'}/step_{int(steps[0]):08d}"
        in (tmp_path / "stdout").read_text()
    )
    assert all(_gone(pid) for pid in pids.values())


@pytest.mark.e2e
@pytest.mark.dist
def test_nproc_per_node_sigterm_to_one_rank_stops_all_and_every_rank_names_it(
    tmp_path, corpus_cache
):  # noqa: F811
    """SIGTERM to rank 1 alone (a node's agent, or a user's `kill`): the ranks agree to stop
    (one checkpoint, exit 0), and each rank's line names the rank and the signal; rank 0 said
    only "another rank's stop request" before."""
    proc, run, pids = _launch_two_ranks(tmp_path, corpus_cache)
    os.kill(pids[1], signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert code == 0, err[-3000:]
    stops = [line for line in err.splitlines() if "saving a checkpoint after step" in line]
    assert len(stops) == 2 and all("SIGTERM to rank 1: saving" in line for line in stops), err[
        -3000:
    ]
    assert len(meshtrain("ckpt", "list", run / "checkpoints").stdout.split()) == 1
    assert all(_gone(pid) for pid in pids.values())


@pytest.mark.e2e
@pytest.mark.dist
def test_nproc_per_node_rank_that_dies_stops_the_others_and_is_named(tmp_path, corpus_cache):  # noqa: F811
    """Rank 1 SIGKILLed (as the OOM killer would): the launcher stops rank 0, exits 1 and names
    rank 1 first on its error line; no rank is left running."""
    proc, _, pids = _launch_two_ranks(tmp_path, corpus_cache)
    os.kill(pids[1], signal.SIGKILL)
    code = proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert code == 1, err[-3000:]
    errors = _errors(err)
    assert len(errors) == 1 and re.match(
        r"meshtrain: error: rank 1 failed \(killed by SIGKILL\)", errors[0]
    ), err[-3000:]
    assert all(_gone(pid) for pid in pids.values())


@pytest.mark.e2e
@pytest.mark.dist
def test_nproc_per_node_stop_before_training_began_is_a_clean_stop(tmp_path, corpus_cache):  # noqa: F811
    """SIGTERM while the ranks are still starting (importing torch, before their training loop,
    where SIGTERM means "checkpoint and exit 0"): they die of it with nothing to save, and the
    launcher counts that as the stop it was asked for, as `meshtrain up` does: exit 0, no
    checkpoint, and a line saying which ranks stopped before training started."""
    run = tmp_path / "run"
    args = small_job_args(
        corpus_cache, run, **{"train.train_iters": 100_000, "train.eval_interval": 0}
    )
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshtrain.services.cli",
                "train",
                "--nproc-per-node",
                "2",
                *args,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    pids = _both_ranks_started(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert code == 0, err[-3000:]
    assert "rank 0, rank 1 stopped before training started" in err and "error" not in err, err[
        -3000:
    ]
    assert (
        not (run / "checkpoints").exists()
        or not meshtrain("ckpt", "list", run / "checkpoints").stdout.split()
    )
    assert all(_gone(pid) for pid in pids.values())


@contextlib.contextmanager
def _two_ranks(tmp_path: Path, args: list[str]):
    """`meshtrain train --nproc-per-node 2 ARGS` running, its stderr in tmp_path/stderr; every
    rank and the launcher are SIGKILLed on the way out (a stopped rank too)."""
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshtrain.services.cli",
                "train",
                "--nproc-per-node",
                "2",
                *args,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        yield proc
    finally:
        for pid in _rank_pids(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        proc.kill()


def _rank1_frozen_mid_save(proc, ckpt: Path, rank1: int, limit_s: float = 90.0) -> Path:
    """SIGSTOP rank 1 while it writes its shards of a save, before its fragment (what tells the
    committer it is done) is stored; returns that step's folder. A save that rank 1 had already
    finished when frozen is let go (SIGCONT) and the next one tried."""
    deadline, seen = time.monotonic() + limit_s, set()
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the launch ended before a save could be caught"
        fresh = [p for p in ckpt.glob("step_*") if p.name not in seen] if ckpt.exists() else []
        if not fresh:
            time.sleep(0.001)
            continue
        step = fresh[0]
        seen.add(step.name)
        os.kill(rank1, signal.SIGSTOP)
        if (
            not list(step.glob("_fragments/*/writer_00001.json"))
            and not (step / "manifest.json").exists()
        ):
            return step
        os.kill(rank1, signal.SIGCONT)
    raise AssertionError(
        f"no save of {ckpt} caught with rank 1's fragment still unwritten in {limit_s:.0f} s"
    )


@pytest.mark.e2e
@pytest.mark.dist
def test_nproc_per_node_rank_killed_mid_save_fails_fast_and_commits_nothing(tmp_path, corpus_cache):  # noqa: F811
    """Rank 1 SIGKILLed while its shards of an asynchronous save are being written (tp=2, so it
    owns half the boxes): rank 0, the committer, used to wait the commit's 600 s for rank 1's
    fragment in its shutdown, where SIGTERM is only logged, so the launcher SIGKILLed it 15 s
    later and its own error (the broken collective) was never printed. Now the failing run gives
    the save up at once: rank 0 exits 1 by itself within seconds, saying the save of that step
    was abandoned, and the step is not committed (`ckpt list` does not show it)."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = small_job_args(
        corpus_cache,
        run,
        **{
            "train.train_iters": 100_000,
            "train.eval_interval": 0,
            "model.hidden_size": 128,
            "parallel.tp": 2,
            "checkpoint.save": str(ckpt),
            "checkpoint.save_interval": 2,
        },
    )
    with _two_ranks(tmp_path, args) as proc:
        pids = _both_ranks_started(proc, tmp_path)
        step = _rank1_frozen_mid_save(proc, ckpt, pids[1])
        code, took = _signal_rank(proc, pids[1], signal.SIGKILL, 60)
    err, errors = _error_lines(tmp_path)
    assert code == 1 and errors == [
        "meshtrain: error: rank 1 failed (killed by SIGKILL), then rank 0 (exit status 1)"
    ], err[-3000:]
    assert took < 10, (took, err[-3000:])
    assert re.search(
        rf"save \w+ of step {int(step.name[5:])} under .* abandoned: "
        r"writers \[1\] had not reported when the run failed",
        err,
    ), err[-3000:]
    committed = meshtrain("ckpt", "list", ckpt).stdout.split()
    assert str(int(step.name[5:])) not in committed, committed
    assert all(_gone(pid) for pid in pids.values())


@pytest.mark.slow  # waits out a distributed timeout
@pytest.mark.e2e
@pytest.mark.dist
def test_nproc_per_node_hung_rank_ends_the_job_after_the_distributed_timeout(
    tmp_path, corpus_cache
):  # noqa: F811
    """Rank 1 SIGSTOPped (a hung peer: its connections stay open, so nothing fails at once):
    rank 0's next collective raises after parallel.distributed_timeout_minutes (here 6 s), it
    exits 1 and the launcher SIGKILLs the hung rank 15 s later. The tp and dp groups used to take
    torch's 30-minute default instead of the world group's timeout, so the job hung 30 min."""
    run = tmp_path / "run"
    args = small_job_args(
        corpus_cache,
        run,
        **{
            "train.train_iters": 100_000,
            "train.eval_interval": 0,
            "parallel.distributed_timeout_minutes": 0.1,
        },
    )
    with _two_ranks(tmp_path, args) as proc:
        _steps_logged(proc, tmp_path, run / "metrics.jsonl")
        pids = _rank_pids(proc.pid)
        code, took = _signal_rank(proc, pids[1], signal.SIGSTOP, 45)
    err, errors = _error_lines(tmp_path)
    expected = (
        "meshtrain: error: rank 0 failed (exit status 1), then rank 1 "
        "(hung: stopped by a signal (SIGSTOP?) when the others failed, then killed by SIGKILL)"
    )
    assert code == 1 and errors == [expected], err[-3000:]
    assert "Timed out waiting 6000ms" in err, err[-3000:]
    assert 6 <= took < 6 + 15 + 10, took
    assert all(_gone(pid) for pid in pids.values())
