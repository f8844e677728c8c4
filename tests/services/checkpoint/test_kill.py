"""SIGKILL writers at random points of a save: committed checkpoints always load, partial
ones are never listed.

Each round starts the two writers of a save as real processes (a forkserver with the
checkpoint modules preloaded, so a start costs milliseconds, not a torch import), kills one
or both at a random moment within twice one save's measured duration (stratified, see
`kill_delays`), lets the survivor finish or time out, and then checks every listed step bit
for bit. Both outcomes (committed / not committed) must occur, or the kill times did not land
inside saves and the test proves nothing.
"""

import os
import random
import signal
import threading
import time

import grpc
import pytest
import torch

from meshtrain.services.checkpoint.multiwriter import begin_save
from meshtrain.services.checkpoint.reader import list_checkpoints, read_box, read_manifest
from meshtrain.services.checkpoint.rpc.client import CheckpointClient, ServiceUnavailableError
from meshtrain.services.common.errors import CheckpointError
from tests.dist_utils import forkserver_context
from tests.services.checkpoint import killable
from tests.services.checkpoint.s3server import free_port

COMMIT_TIMEOUT = 0.15


@pytest.fixture(scope="module")
def ctx():
    # The test process's one forkserver, shared with the multi-process tests' ranks.
    return forkserver_context(
        "tests.services.checkpoint.killable", "meshtrain.services.checkpoint.rpc.server"
    )


def start_save(ctx, root, step):
    save_id = begin_save(root, step)
    procs = [
        ctx.Process(
            target=killable.run_writer, args=(root, step, save_id, w, COMMIT_TIMEOUT), daemon=True
        )
        for w in range(killable.NUM_WRITERS)
    ]
    for p in procs:
        p.start()
    return procs


def check_root(root, committed_before):
    """Every listed step loads and equals what was saved; nothing committed was lost."""
    steps = list_checkpoints(root)
    assert set(committed_before) <= set(steps)
    shape = (killable.LAYERS, killable.ROWS, killable.COLS)
    for step in steps:
        assert read_manifest(root, step)["metadata"] == {"step": step}
        got = read_box(root, step, killable.ARRAY, (0, 0, 0), shape)
        assert torch.equal(got.view(torch.int16), killable.expected(step).view(torch.int16))
    return steps


def kill_delays(rng, rounds, horizon):
    """One delay per round, stratified over [0, horizon): round i's delay is uniform in its own
    slice of that range, the slices in random order. Plain uniform draws can put every kill
    early (all saves aborted) on a run where saves are slower than the one measured; the
    slices place kills across the whole range whatever the draws."""
    width = horizon / rounds
    slices = list(range(rounds))
    rng.shuffle(slices)
    return [(i + rng.random()) * width for i in slices]


def kill_rounds(ctx, root, rounds, seed):
    rng = random.Random(seed)
    warm = ctx.Process(target=killable.noop)
    warm.start()
    warm.join(60)
    # One uninterrupted save measures how long a save takes here (forkserver already up).
    start = time.perf_counter()
    for p in start_save(ctx, root, 0):
        p.join(30)
    duration = time.perf_counter() - start
    committed = check_root(root, [])
    assert committed == [0]
    outcomes = {"committed": 0, "aborted": 0}
    for step, delay in enumerate(kill_delays(rng, rounds, 2 * duration), start=1):
        procs = start_save(ctx, root, step)
        victims = rng.choice([[procs[0]], [procs[1]], procs])
        time.sleep(delay)
        for p in victims:
            if p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it had already finished
        for p in procs:
            p.join(30)
            assert p.exitcode is not None, "a writer hung"
        steps = check_root(root, committed)
        outcomes["committed" if step in steps else "aborted"] += 1
        committed = steps
    return outcomes


@pytest.mark.e2e
def test_sigkill_writers_at_random_points(ctx, tmp_path):
    outcomes = kill_rounds(ctx, str(tmp_path / "ckpt"), rounds=50, seed=1)
    assert outcomes["committed"] > 0 and outcomes["aborted"] > 0, outcomes


@pytest.mark.slow
def test_sigkill_writers_many_times(ctx, tmp_path):
    outcomes = kill_rounds(ctx, str(tmp_path / "ckpt"), rounds=400, seed=2)
    assert outcomes["committed"] > 0 and outcomes["aborted"] > 0, outcomes


@pytest.mark.e2e
def test_killed_save_can_be_redone(ctx, tmp_path):
    """A step whose save was killed is saved again from scratch by the next attempt."""
    root = str(tmp_path / "ckpt")
    procs = start_save(ctx, root, 3)
    os.kill(procs[1].pid, signal.SIGKILL)
    for p in procs:
        p.join(30)
    assert list_checkpoints(root) == []
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        read_manifest(root, 3)
    for p in start_save(ctx, root, 3):
        p.join(30)
    assert check_root(root, []) == [3]


def service_save(client, step):
    """A whole save through the service: two writer threads, writer 0 commits.

    Returns the threads, the errors they met, and `times`: perf_counter() just before
    writer 0 sent Commit ("commit_sent") and just after Commit returned ("committed")."""
    save_id = client.begin_save(step, num_writers=killable.NUM_WRITERS)
    errors, times = [], {}

    def run(w):
        try:
            writer = client.writer(step, save_id, w, killable.NUM_WRITERS)
            for spec, data in killable.boxes(step, w):
                writer.write(spec, data)
            writer.finish()
            if w == 0:
                times["commit_sent"] = time.perf_counter()
                client.commit(step, save_id, killable.NUM_WRITERS, {"step": step}, timeout=2)
                times["committed"] = time.perf_counter()
        except (CheckpointError, ServiceUnavailableError) as e:  # the service was killed under us
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(killable.NUM_WRITERS)]
    for t in threads:
        t.start()
    return threads, errors, times


def start_service(ctx, root):
    port = free_port()
    proc = ctx.Process(target=killable.serve, args=(root, port), daemon=True)
    proc.start()
    client = CheckpointClient(f"127.0.0.1:{port}")
    grpc.channel_ready_future(client.channel).result(timeout=30)
    return proc, client


def service_kill_rounds(ctx, root, rounds, seed):
    """Kills the service at a random moment of each of `rounds` saves (on a fresh service).

    The delays span twice the measured length of a save, so about half of them land inside
    a save and the rest after it: both outcomes occur even when saves on a fresh service run
    well slower than the one measured. Where the outcome is determined it is checked exactly:
    killed and reaped before Commit was sent, the step must not be listed; killed after Commit
    returned, it must be."""
    rng = random.Random(seed)
    proc, client = start_service(ctx, root)
    start = time.perf_counter()
    threads, errors, _ = service_save(client, 0)
    for t in threads:
        t.join(30)
    duration = time.perf_counter() - start
    assert not errors and check_root(root, []) == [0]
    committed, outcomes = [0], {"committed": 0, "aborted": 0}
    for step, delay in enumerate(kill_delays(rng, rounds, 2 * duration), start=1):
        if proc is None:
            proc, client = start_service(ctx, root)
        threads, _, times = service_save(client, step)
        time.sleep(delay)
        killed_at = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        dead_at = time.perf_counter()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a client hung after the service died"
        client.close()
        proc = None
        steps = check_root(root, committed)
        if times.get("commit_sent", float("inf")) > dead_at:
            assert step not in steps, f"step {step} listed, though the service died before Commit"
        if times.get("committed", float("inf")) < killed_at:
            assert step in steps, f"step {step} lost, though Commit had returned before the kill"
        outcomes["committed" if step in steps else "aborted"] += 1
        committed = steps
    return outcomes


@pytest.mark.e2e
def test_sigkill_the_service_at_random_points(ctx, tmp_path):
    outcomes = service_kill_rounds(ctx, str(tmp_path / "ckpt"), rounds=12, seed=3)
    assert outcomes["committed"] > 0 and outcomes["aborted"] > 0, outcomes


@pytest.mark.slow
def test_sigkill_the_service_many_times(ctx, tmp_path):
    outcomes = service_kill_rounds(ctx, str(tmp_path / "ckpt"), rounds=150, seed=4)
    assert outcomes["committed"] > 0 and outcomes["aborted"] > 0, outcomes
