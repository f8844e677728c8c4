"""The run directory (docs/architecture.md, "Run directory"): the folder a run writes into, and
its config.toml.

    run_dir = make_run_dir(job.log.run_dir, mesh)   # same path on every rank, locked by rank 0
    (run_dir / "config.toml").write_text(run_dir_toml(job, launcher_keys))
    ...
    release_run_dir(run_dir)                        # rank 0, once the run has ended

A run directory is one trainer's at a time: rank 0 holds an exclusive flock on
RUN_DIR/.train.lock (holding its pid) until its run ends (`release_run_dir`) or its process
exits, so a second `meshtrain train` into it is refused instead of interleaving metrics.jsonl
and replacing config.toml and control.addr. Outside `meshtrain up` the trainer also refuses a
folder that an `up` holds (RUN_DIR/.up.lock, `services/launcher/up.py`), whose own trainer may
be between runs; `up` names its pid to its trainer ranks in UP_PID_ENV. The locks themselves are
`services/common/run_locks.py`'s, shared with `up`.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import tomli_w
import torch.distributed as dist

from meshtrain.services.common import config as cfg
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.run_locks import (
    TRAIN_LOCK,
    UP_LOCK,
    UP_PID_ENV,
    lock_file,
    probe_lock,
)
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.parallel.mesh import Mesh

# The run directories this process holds (resolved path -> [the open lock file, how many
# claims]). A process may build several Trainers into one folder (tests, a resume in process):
# a second flock of its own would refuse it, so a claim is counted and the flock dropped with
# the last release (or by the kernel when the process exits).
_held: dict[Path, list] = {}
# The run directories this process created (resolved paths): only these may `release_run_dir`
# remove after a failed start; a folder that was there before is the user's.
_created: set[Path] = set()


def make_run_dir(configured: str | None, mesh: Mesh) -> Path:
    """Rank 0 picks, creates and locks the run directory; every rank gets the same path.

    Raises:
        ConfigError: (rank 0; the others fail in the broadcast when it exits) another trainer,
            or an `up` that is not ours, holds the folder, or it cannot be created.
    """
    if mesh.distributed:
        chosen = [str(_new_run_dir(configured)) if mesh.rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        assert chosen[0] is not None  # rank 0's choice
        return Path(chosen[0])
    return _new_run_dir(configured)


def _new_run_dir(configured: str | None) -> Path:
    if configured:
        path = Path(configured)
        try:
            path.mkdir(parents=True)
            created = True
        except FileExistsError:
            created = False
        except OSError as e:
            raise ConfigError(
                f"cannot create the run directory {path} (log.run_dir): {e.strerror}"
            ) from None
        if not path.is_dir():
            raise ConfigError(f"cannot create the run directory {path} (log.run_dir): a file")
    else:
        path, created = _new_default_run_dir(), True
    claim_run_dir(path)
    if created:
        _created.add(path.resolve())
    return path


def _new_default_run_dir() -> Path:
    """A new folder `runs/<time>[-N]`, created here (not just found absent), so that two
    trainers started in the same second do not both pick it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = Path("runs") / (stamp + (f"-{n}" if n else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"no free run directory name runs/{stamp}-N; set --log.run_dir")


def claim_run_dir(run_dir: Path) -> None:
    """Hold `run_dir` for this process until `release_run_dir` or the process exits: an
    exclusive flock on RUN_DIR/.train.lock, which names our pid; the kernel drops it with the
    process, so a crashed run leaves nothing to clean up. Outside `meshtrain up` (no UP_PID_ENV
    naming the `up` that holds the folder), a folder an `up` holds is refused too.

    Raises:
        ConfigError: the folder is held (naming the holder's pid and how to go on).
    """
    key = run_dir.resolve()
    if key in _held:
        _held[key][1] += 1
        return
    lock = lock_file(run_dir / TRAIN_LOCK)
    if isinstance(lock, str):
        raise ConfigError(
            f"run directory {run_dir} is in use by another trainer (pid {lock}); stop it first "
            f"(`meshtrain stop {run_dir}`) or give this run another --log.run_dir"
        )
    # Taken with ours held (and `up` takes its own before looking at ours), so of a trainer and
    # an `up` starting together at least one sees the other.
    up = probe_lock(run_dir / UP_LOCK)
    if up is not None and up != os.environ.get(UP_PID_ENV):
        lock.close()
        raise ConfigError(
            f"run directory {run_dir} is in use by meshtrain up (pid {up}); stop it first "
            f"(`meshtrain stop {run_dir}`, or Ctrl-C the up) or give this run another --log.run_dir"
        )
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _held[key] = [lock, 1]


def release_run_dir(run_dir: Path, failed_start: bool = False) -> None:
    """Undo one `claim_run_dir`; the last one drops the flock, so another process may train
    into the folder while this one lives on (a notebook, a test). The file stays: removing
    it would let a trainer flock a new file while another still holds the old one.

    failed_start: the run failed before it trained; a folder this process created that holds
    nothing but its lock, config.toml and empty folders is removed (while still locked), so a
    mistake leaves no empty run behind. A folder that was there before is left alone.
    """
    key = run_dir.resolve()
    held = _held.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _held[key]
        if key in _created:
            _created.discard(key)  # a later claim finds the folder there: not its own
            if failed_start:
                _remove_if_empty(run_dir)
        held[0].close()  # closing the last descriptor drops the flock


def _remove_if_empty(run_dir: Path) -> None:
    """Remove `run_dir` if it holds no file but its lock and config.toml (folders: empty)."""
    ours = {run_dir / TRAIN_LOCK, run_dir / "config.toml"}
    walk = list(os.walk(run_dir, topdown=False))
    if any(Path(top) / name not in ours for top, _, files in walk for name in files):
        return
    try:
        for path in ours:
            path.unlink(missing_ok=True)
        for top, _, _ in walk:
            os.rmdir(top)  # bottom-up; fails (and stops) on anything written meanwhile
    except OSError:
        pass


def run_dir_toml(job: JobConfig, launcher_keys: list[str] | tuple[str, ...] = ()) -> str:
    """The run directory's config.toml: `job` resolved, less `launcher_keys`, which a header
    comment names (under `meshtrain up`: its data workers' and checkpoint service's addresses,
    dead once it exits, where `meshtrain train --config RUN/config.toml` would retry them)."""
    table = cfg.to_dict(job)
    left_out = [
        key
        for key in launcher_keys
        if table.get(key.partition(".")[0], {}).pop(key.partition(".")[2], None) is not None
    ]
    text = tomli_w.dumps(table)
    if not left_out:
        return text
    note = (
        f"Left out: {', '.join(left_out)}, which `meshtrain up` pointed at its own services (they "
        "end with it). `meshtrain up --config` this file (or the command that started the run) "
        "resumes the run with new ones; `meshtrain train --config` this file reads the data "
        "in-process and writes checkpoints straight to checkpoint.save."
    )
    return textwrap.fill(note, 96, initial_indent="# ", subsequent_indent="# ") + "\n" + text
