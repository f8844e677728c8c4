"""Exactly-once delivery while data workers are SIGKILLed mid-stream.

Three real worker processes serve on loopback; the worker currently streaming to a rank is
killed with SIGKILL (and restarted on its port in the background) every few steps. Every
micro-batch each rank receives must hash equal to the uninterrupted in-process run, in order:
none repeated, none missed. Halfway through, the "trainer" restarts from a checkpoint
(new clients starting at consumed_samples / global_batch_size) with a different
data-parallel size and the same global batch, and each step's global batch must still be
exactly the in-process one.
"""

import random
import threading

import pytest

from meshtrain.services.dataloader.loader import LocalBatchSource
from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.spec import open_dataset

from .conftest import WorkerProcess, batch_hash

GBS, MBS = 16, 2


def _global_rows(batches_by_rank):
    """The step's samples over all ranks, as a sorted list of rows (order across ranks is free)."""
    rows = [
        tuple(b.tokens[i].tolist()) + (int(b.labels[i, -1]),)
        for batches in batches_by_rank
        for b in batches
        for i in range(b.tokens.shape[0])
    ]
    return sorted(rows)


def _ready_unless_killed(worker):
    """Wait for a restarted worker; the test may legitimately SIGKILL it again while it starts."""
    try:
        worker.wait_ready()
    except RuntimeError:
        if worker.proc.wait(timeout=30) != -9:
            raise


def _run(spec, phases, kills_wanted, seed):
    """Run `phases` = [(dp_size, first_step, end_step), ...] with kills.

    Returns:
        (workers killed, streams the clients reopened after an error).
    """
    dataset = open_dataset(spec)
    reference = LocalBatchSource(dataset, MBS, GBS, 0, 1)
    workers = [WorkerProcess().wait_ready() for _ in range(3)]
    addresses = [w.address for w in workers]
    rng = random.Random(seed)
    kills, reconnects = 0, 0
    starting: dict[int, threading.Thread] = {}  # worker slot -> thread waiting for its restart
    total_steps = sum(end - start for _, start, end in phases)
    every = max(1, total_steps // (kills_wanted + 1))

    def kill_serving(client):
        nonlocal kills
        addr = client.current_address
        for i, w in enumerate(workers):
            if w.address != addr:
                continue
            # it just streamed to us, so it is up; its "listening" line may still be unread
            if i in starting:
                starting.pop(i).join(timeout=60)
            if w.proc.poll() is None:
                w.kill()
                kills += 1
                replacement = WorkerProcess(w.port)
                workers[i] = replacement
                t = threading.Thread(target=_ready_unless_killed, args=(replacement,), daemon=True)
                t.start()
                starting[i] = t
            return

    try:
        n = 0
        for dp_size, start, end in phases:
            # a fresh set of clients per phase is a trainer restart
            # from consumed_samples = start * GBS
            locals_ = [LocalBatchSource(dataset, MBS, GBS, r, dp_size) for r in range(dp_size)]
            clients = [
                ServiceBatchSource(
                    addresses,
                    spec,
                    MBS,
                    GBS,
                    r,
                    dp_size,
                    prefetch=2,
                    backoff_s=(0.01, 0.2),
                    give_up_s=60,
                )
                for r in range(dp_size)
            ]
            try:
                for step in range(start, end):
                    got = [c.micro_batches(step) for c in clients]
                    for r in range(dp_size):
                        assert [batch_hash(b) for b in got[r]] == [
                            batch_hash(b) for b in locals_[r].micro_batches(step)
                        ], (step, r)
                    assert _global_rows(got) == _global_rows([reference.micro_batches(step)]), step
                    n += 1
                    if kills < kills_wanted and n % every == 0:  # mid-stream: prefetch is full
                        kill_serving(clients[rng.randrange(dp_size)])
            finally:
                for c in clients:
                    reconnects += c.reconnects
                    c.close()
        for t in starting.values():
            t.join(timeout=60)
    finally:
        for w in workers:
            w.stop()
    return kills, reconnects


@pytest.mark.e2e
def test_sigkill_twenty_times_exactly_once_with_restart_and_dp_change(long_spec):
    kills, reconnects = _run(long_spec, [(2, 0, 30), (4, 30, 60)], kills_wanted=20, seed=0)
    assert kills >= 20
    assert reconnects >= kills  # each kill broke a live stream (retries may add more)


@pytest.mark.slow
@pytest.mark.e2e
def test_sigkill_hundred_times_exactly_once(long_spec):
    """Three passes over the data (restarts to step 0 are restarts from an earlier checkpoint)."""
    kills, reconnects = _run(
        long_spec, [(1, 0, 64), (2, 0, 64), (8, 0, 64)], kills_wanted=100, seed=1
    )
    assert kills >= 100 and reconnects >= kills
