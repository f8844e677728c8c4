"""How many CPU threads each process of `meshtrain up` may use, as the environment it starts with.

torch (and the OpenMP/MKL libraries under it) starts one intra-op thread per core in every
process. `up` runs data workers, rollout workers, the checkpoint service and K trainer ranks on the
same cores, so with the defaults they all spin a thread per core and take cores from each other.
The services mostly wait on the network and storage: one thread each is enough. The trainer ranks
share what is left: the cores this process may run on, less one per data worker (which prepares
batches while the ranks step) and one per rollout worker (which samples while they train),
divided by the ranks, at least one each. The checkpoint service
reserves none: it works during saves only. An OMP_NUM_THREADS set in our own environment is
the user's choice for the trainer ranks and stands (as under torchrun), as does an explicit
`--trainer-threads`, which wins over both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

SERVICE_THREADS = 1
"""Intra-op threads of each data worker, rollout worker and of the checkpoint service."""

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""The variables torch's CPU thread pools read at start (torch sets its intra-op count from
OMP_NUM_THREADS, MKL its own from MKL_NUM_THREADS)."""


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, which taskset and cpusets narrow),
    else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadBudget:
    """The thread counts of one `up`.

    Attributes:
        service: intra-op threads of each service process.
        trainer: intra-op threads of each trainer rank (None: the user's OMP_NUM_THREADS stands).
    """

    service: int
    trainer: int | None

    def service_env(self) -> dict[str, str]:
        """What each service's environment adds."""
        return {var: str(self.service) for var in THREAD_VARS}

    def trainer_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """What each trainer rank's environment adds: nothing for a variable the user set (when
        the count is theirs), else the budget."""
        if self.trainer is None:
            environ = os.environ if environ is None else environ
            user = environ["OMP_NUM_THREADS"]
            return {var: user for var in THREAD_VARS if var not in environ}
        return {var: str(self.trainer) for var in THREAD_VARS}


def thread_budget(
    ranks: int,
    data_workers: int,
    trainer_threads: int | None = None,
    cores: int | None = None,
    environ: Mapping[str, str] | None = None,
    rollout_workers: int = 0,
) -> ThreadBudget:
    """The budget for `ranks` trainer ranks beside `data_workers` data workers and
    `rollout_workers` rollout workers.

    Args:
        ranks: trainer ranks on this machine.
        data_workers: data workers on this machine.
        trainer_threads: threads per rank the user asked for (`up --trainer-threads`), or None.
        cores: the CPUs to share (default: `usable_cores()`).
        environ: the launcher's environment (default: ours), for a user-set OMP_NUM_THREADS.
        rollout_workers: rollout workers on this machine.
    """
    environ = os.environ if environ is None else environ
    if trainer_threads is not None:
        return ThreadBudget(SERVICE_THREADS, trainer_threads)
    if environ.get("OMP_NUM_THREADS"):
        return ThreadBudget(SERVICE_THREADS, None)
    cores = usable_cores() if cores is None else cores
    free = cores - (data_workers + rollout_workers) * SERVICE_THREADS
    return ThreadBudget(SERVICE_THREADS, max(1, free // max(1, ranks)))
