"""run_ranks itself: results by rank, a failing rank's traceback, the timeout, and what a rank
process starts with (forked from the preloaded server, one thread, the test's environment)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_ranks

pytestmark = pytest.mark.dist


def _sum_ranks(rank, world, scale):
    t = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": t}


def test_every_rank_runs_and_results_come_back_by_rank():
    results = run_ranks(_sum_ranks, 2, torch.tensor([2.0]))
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    assert all(torch.equal(r["sum"], torch.tensor([6.0])) for r in results)


def _process_facts(rank, world, name):
    import tests.rank_server

    return {
        "pid": os.getpid(),
        "server": tests.rank_server.LOADED_IN,
        "threads": torch.get_num_threads(),
        "omp": os.environ["OMP_NUM_THREADS"],
        "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
        "set_by_test": os.environ.get(name),
        "removed_by_test": "MESHTRAIN_TEST_REMOVED" in os.environ,
        "cwd": os.getcwd(),
    }


def test_a_rank_forks_from_the_preloaded_server_with_the_tests_environment(monkeypatch, tmp_path):
    # A first run starts the server, so the environment below is changed after it started.
    monkeypatch.setenv("MESHTRAIN_TEST_REMOVED", "1")
    run_ranks(_process_facts, 1, "unused")
    monkeypatch.delenv("MESHTRAIN_TEST_REMOVED")
    monkeypatch.setenv("MESHTRAIN_TEST_SET", "after the server started")
    monkeypatch.chdir(tmp_path)
    facts = run_ranks(_process_facts, 2, "MESHTRAIN_TEST_SET")
    for rank, f in enumerate(facts):
        # Imported in another process (the server) than the rank's own: it came with the fork.
        assert f["server"] != f["pid"]
        assert f["pid"] != os.getpid()
        assert f["threads"] == 1 and f["omp"] == "1"
        assert f["rank_env"] == (str(rank), "2", str(rank))
        assert f["set_by_test"] == "after the server started"
        assert not f["removed_by_test"]
        assert f["cwd"] == str(tmp_path)


def _rank_one_fails(rank, world):
    if rank == 1:
        raise ValueError("rank one's own message")
    return rank


def test_a_failing_ranks_traceback_is_raised_in_the_test():
    with pytest.raises(RuntimeError) as err:
        run_ranks(_rank_one_fails, 2)
    text = str(err.value)
    assert text.startswith("rank 1 failed:")
    assert "Traceback" in text and "_rank_one_fails" in text
    assert "ValueError: rank one's own message" in text


def test_errors_return_gives_each_failed_ranks_traceback_and_the_others_results():
    before = time.monotonic()
    ok, failed = run_ranks(_rank_one_fails, 2, errors="return")
    assert ok == 0
    assert "ValueError: rank one's own message" in failed["error"]
    assert before <= failed["at"] <= time.monotonic()


def _rank_one_hangs(rank, world, folder):
    with open(os.path.join(folder, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)
    return rank


def test_a_rank_that_outlives_the_timeout_is_named_and_every_rank_ends(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 2 s"):
        run_ranks(_rank_one_hangs, 2, str(tmp_path), timeout=2)
    # The hung rank is killed at once; rank 0, waiting for it in the closing barrier, then fails.
    assert time.monotonic() - start < 10
    pids = [int((tmp_path / f"pid-{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                pids.remove(pid)
        time.sleep(0.1)
    assert not pids, f"rank processes {pids} are still running"


def _start_own_process(rank, world):
    # What megatron-core's checkpoint writer does: a process of the rank's own.
    child = multiprocessing.get_context("fork").Process(target=sys.exit, args=(rank + 3,))
    child.start()
    child.join(30)
    return child.exitcode


def test_a_non_daemon_rank_starts_processes_of_its_own():
    assert run_ranks(_start_own_process, 2, daemon=False) == [3, 4]


def test_a_daemon_rank_may_not():
    with pytest.raises(RuntimeError, match="daemonic processes are not allowed to have children"):
        run_ranks(_start_own_process, 1)
