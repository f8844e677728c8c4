"""Trainer ranks on this machine as our own child processes: `meshtrain train --nproc-per-node N`
runs them with `run_local_ranks`, and `meshtrain up` builds its trainer with `local_ranks`.

    meshtrain train --nproc-per-node 2 --config deploy/configs/tiny.toml [--grace S] \\
        [train overrides]

Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port) but no torchrun agent between it and us. A stop
(SIGINT, SIGTERM or SIGHUP to us) reaches every rank once, as SIGTERM: it checkpoints after the
current step and exits 0, and we wait for that without a deadline unless `--grace` sets one (a
second signal stops the ranks at once, SIGKILL, no checkpoint). A rank that fails on its own
stops the others (SIGTERM, then SIGKILL after `FAILURE_GRACE_S`: they may hang in a collective).
We exit 0 when every rank exited 0, or was stopped by our SIGTERM before its training loop
began (nothing to checkpoint, as `meshtrain up` counts it), else 1 with one line naming the
ranks that did not, the first to fail first. torchrun's agent instead reported a SIGTERM as
its own failure (exit 1) and SIGKILLed the ranks 30 s after passing it on
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT), losing a long final checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO, TypeVar

from meshtrain.services.launcher.topology import Child, Topology, free_port, stop_on_signals

FAILURE_GRACE_S = 15.0
K = TypeVar("K")


def local_ranks(
    world: int, argv: list[str], name: str, grace_s: float, inherit_output: bool = False
) -> list[Child]:
    """The children running `argv` as ranks 0..world-1 of one job on this machine, in rank order.

    Args:
        world: how many ranks.
        argv: each rank's command (`meshtrain train ...`).
        name: their name ("trainer": "trainer-0", "trainer-1", ...; the name alone when world is 1,
            which gets no rendezvous environment and runs as a single process).
        grace_s: seconds a rank gets to checkpoint after SIGTERM before SIGKILL (`math.inf`: no
            limit).
        inherit_output: the ranks write to our stdout and stderr, unprefixed.
    """
    if world == 1:
        return [
            Child(name, list(argv), role="trainer", grace_s=grace_s, inherit_output=inherit_output)
        ]
    rendezvous = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: a value the user set stands
        rendezvous["OMP_NUM_THREADS"] = "1"  # K ranks each spawning a thread per core oversubscribe
    return [
        Child(
            f"{name}-{rank}",
            list(argv),
            env={**rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            role="trainer",
            grace_s=grace_s,
            inherit_output=inherit_output,
        )
        for rank in range(world)
    ]


def run_local_ranks(
    nproc: int, train_args: list[str], grace_s: float | None = None, out: TextIO | None = None
) -> int:
    """Run `meshtrain train TRAIN_ARGS` on `nproc` local ranks until they end, fail, or are stopped.

    Args:
        nproc: how many ranks.
        train_args: `meshtrain train` arguments (already validated by the caller).
        grace_s: seconds the ranks get to checkpoint and exit after a stop before SIGKILL
            (None: no limit).
        out: where the launcher's own lines go (stderr by default); the ranks write to our
            stdout and stderr.

    Returns:
        0 when every rank exited 0 (finished, or stopped with its checkpoint committed) or was
        stopped before its training loop began, else 1 after printing which ranks did not, with
        their exit statuses.
    """
    out = out or sys.stderr
    topo = Topology(out, label="meshtrain", failure_grace_s=FAILURE_GRACE_S)
    ranks = local_ranks(
        nproc,
        [sys.executable, "-m", "meshtrain.services.cli", "train", *train_args],
        "rank",
        math.inf if grace_s is None else grace_s,
        inherit_output=True,
    )
    stop = threading.Event()  # set by a signal
    with stop_on_signals(
        topo,
        stop,
        "passing SIGTERM to every rank: each checkpoints after its current step, "
        "then exits (again to stop at once)",
    ):
        try:
            for child in ranks:
                topo.start(child)
            topo.supervise(stop)
        finally:
            # A rank stopped by a signal (SIGSTOP, a debugger) is a hung peer: its connections stay
            # open, so the others fail only at their collective timeout and are named first.
            frozen = {
                rank
                for rank, child in enumerate(ranks)
                if child.process is not None and _is_stopped(child.process.pid)
            }
            statuses = topo.shutdown()
    failed = [rank for rank, child in enumerate(ranks) if statuses[child.name] != 0]
    stopped = stop.is_set() and not topo.urgent.is_set()
    if topo.failed is None:  # no rank died on its own: a stop that came early is a clean one
        early = stopped_before_training(
            topo, stop, {rank: statuses[ranks[rank].name] for rank in failed}
        )
        if early:
            topo.say(
                f"{', '.join(f'rank {rank}' for rank in early)} stopped before training started"
            )
        failed = [rank for rank in failed if rank not in early]
    if not failed:
        return 0
    first = topo.failed  # the first rank to die on its own, unless our own SIGTERM killed it
    if first is not None and stopped and statuses[first.name] == -signal.SIGTERM:
        first = None
    failed.sort(key=lambda rank: ranks[rank] is not first)  # the first to fail first, then by rank
    hung = "hung: stopped by a signal (SIGSTOP?) when the others failed, then "
    parts = [
        f"rank {rank} ({hung if rank in frozen else ''}"
        f"{_describe(statuses[ranks[rank].name], stopped)})"
        for rank in failed
    ]
    if (
        ranks[failed[0]] is first
    ):  # e.g. "rank 1 failed (killed by SIGKILL), then rank 0 (exit status 1)"
        line = parts[0].replace(" (", " failed (", 1) + (
            f", then {', '.join(parts[1:])}" if parts[1:] else ""
        )
    else:
        line = f"not every rank exited 0: {', '.join(parts)}"
    print(f"meshtrain: error: {line}", file=out, flush=True)
    return 1


def stopped_before_training(
    topo: Topology, stop: threading.Event, failed: Mapping[K, int | None]
) -> list[K]:
    """Of the ranks in `failed` (any key: exit status), those our own stop killed before their
    training loop began; none unless a stop was asked for (`stop` set, not the urgent second
    signal).

    Inside its loop a rank takes SIGTERM as "checkpoint and exit 0", so one that died of it had
    not reached the loop and had nothing to save: a stop asked for then is a clean stop, not a
    failure (`meshtrain up` and `train --nproc-per-node` both count it so).
    """
    if not stop.is_set() or topo.urgent.is_set():
        return []
    return [key for key, code in failed.items() if code == -signal.SIGTERM]


def _is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc: SIGSTOP, SIGTSTP) or traced (t)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _describe(code: int | None, stop_requested: bool) -> str:
    if code is None:  # its start failed
        return "never started"
    if code >= 0:
        return f"exit status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    if code == -signal.SIGTERM and stop_requested:
        # Inside its training loop SIGTERM means checkpoint and exit 0: this rank was not there yet.
        return "stopped by SIGTERM before its training loop began: nothing to checkpoint"
    return f"killed by {name}"
