"""The run directory's locks, shared by the trainer and `meshtrain up`: one owner at a time.

A trainer's rank 0 holds an exclusive flock on RUN_DIR/.train.lock (`TRAIN_LOCK`) and a
`meshtrain up` one on RUN_DIR/.up.lock (`UP_LOCK`), each file holding its holder's pid, so that
two runs never write into one folder; the kernel drops a flock with its process, so a crashed
run leaves nothing to clean up. `up` names its own pid to the trainer ranks it starts in
`UP_PID_ENV`, so that its lock does not refuse them. The trainer's side is
`services/trainer/run_dir.py`, `up`'s `services/launcher/up.py`.

    lock = lock_file(run_dir / UP_LOCK)         # the open file, or the holder's pid
    trainer = probe_lock(run_dir / TRAIN_LOCK)  # the pid of a trainer holding it, or None
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from meshtrain.services.common.errors import ConfigError

TRAIN_LOCK = ".train.lock"
UP_LOCK = ".up.lock"
UP_PID_ENV = "MESHTRAIN_UP_PID"  # set by `meshtrain up` for its trainer ranks: its own pid


def lock_file(path: Path, mode: int = fcntl.LOCK_EX):
    """`path` opened and flocked (`mode`: exclusive by default) without waiting: the open file,
    or the pid written in it when another process holds it.

    Raises:
        ConfigError: it cannot be opened.
    """
    try:
        lock = open(path, "a+")  # noqa: SIM115 -- held open for as long as the process runs
    except OSError as e:
        raise ConfigError(
            f"cannot lock the run directory {path.parent} ({path}): {e.strerror}"
        ) from None
    try:
        fcntl.flock(lock, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        return holder
    return lock


def probe_lock(path: Path) -> str | None:
    """The pid written in `path` if another process holds it exclusively, else None (a shared
    flock, dropped at once: two probes never refuse each other)."""
    if not path.exists():
        return None
    lock = lock_file(path, fcntl.LOCK_SH)
    if isinstance(lock, str):
        return lock
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    return None
