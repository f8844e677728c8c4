"""Trainer ranks on this machine as our own child processes, with torchrun's environment but no
torchrun agent between them and us: `meshtrain up` builds its trainer with `local_ranks`.

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and
MASTER_PORT=a free port, so a stop reaches each rank as its own SIGTERM (it checkpoints after
the current step and exits 0) and each rank's exit status is ours to see.
"""

from __future__ import annotations

import os

from services.launcher.topology import Child, free_port


def local_ranks(world: int, argv: list[str], name: str, grace_s: float,
                inherit_output: bool = False) -> list[Child]:
    """The children running `argv` as ranks 0..world-1 of one job on this machine, in rank order.

    Args:
        world: how many ranks.
        argv: each rank's command (`meshtrain train ...`).
        name: their name ("trainer": "trainer-0", "trainer-1", ...; the name alone when world is 1,
            which gets no rendezvous environment and runs as a single process).
        grace_s: seconds a rank gets to checkpoint after SIGTERM before SIGKILL (`math.inf`: no limit).
        inherit_output: the ranks write to our stdout and stderr, unprefixed.
    """
    if world == 1:
        return [Child(name, list(argv), role="trainer", grace_s=grace_s, inherit_output=inherit_output)]
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                  "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: a value the user set stands
        rendezvous["OMP_NUM_THREADS"] = "1"  # K ranks each spawning a thread per core oversubscribe
    return [Child(f"{name}-{rank}", list(argv), env={**rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                  role="trainer", grace_s=grace_s, inherit_output=inherit_output)
            for rank in range(world)]
