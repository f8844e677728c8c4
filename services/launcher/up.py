"""`meshtrain up`: the whole training topology as local processes, in a health-checked order.

    meshtrain up --config deploy/configs/tiny.toml --data-workers 2 --nproc-per-node 4 \
        --tensor-model-parallel-size 2 [--s3 | --save s3://bucket/ckpt] [--metrics] \
        [--rollout-workers 2 --checkpoint.load SFT_ROOT]

Starts, each only once the one before answers its health check: with `--s3`, a local
S3-compatible object store (SeaweedFS, data in RUN_DIR/s3, checkpoints at
s3://meshtrain/checkpoints); N DataService workers; the checkpoint service for the trainer's
save root; N rollout workers (`meshtrain rollout serve`) for on-policy RL; then K trainer ranks
pointed at them (`--data-service-addresses`, `--checkpoint.service_address`,
`--train.control_port=0`, so `meshtrain status RUN_DIR` works; the rollout workers' addresses in
$MESHTRAIN_ROLLOUT_ADDRESSES, and as `--grpo.rollout_addresses` where the trainer's config has
that key). A rollout worker starts from the policy the trainer starts from: the newest committed
checkpoint under the save root when the run resumes, else `--checkpoint.load` (at
`--checkpoint.load_step`); it reads the steps the trainer publishes from the save root.
Every process's log lines carry its name. The ranks are started here directly with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...; `ranks.local_ranks`, as
`meshtrain train --nproc-per-node` does) rather than under torchrun's agent, so each rank gets
its own SIGTERM on shutdown (checkpoint, exit 0) and its own exit status. All
ports are free ports on 127.0.0.1. An `s3://` save root reads AWS_ENDPOINT_URL and credentials
from the environment (set by `--s3` for its own store), which every child inherits.
Each process gets a CPU thread budget in its environment (`threads.thread_budget`): one
intra-op thread per service, the rest of the cores shared by the trainer ranks.

Each run gets a fresh bearer token (`secrets.token_urlsafe`), written to RUN_DIR/auth.token
(mode 0600, as 'admin TOKEN') once the run directory is claimed: the services are started with
`--token-file` on it and the trainer with `--auth.token_file`, so every call between them,
and `meshtrain status|save|stop RUN_DIR` (which find the file through RUN_DIR/config.toml),
carries it; the token itself is in no argument, log line or config.

A launch whose save root already holds a committed checkpoint resumes from the newest one
(also when `--checkpoint.load` names another root; not with `--checkpoint.load_step` or
`--no-resume`): stopping `up` and running the same command again with the same
`--log.run_dir` continues the run. A run directory is one `up`'s at a time: a second `up` on it
is refused, naming the first one's pid, before it starts anything.

What each process runs, its command line and environment, is `up_plan.plan`'s; this module
claims the run directory, writes the token, starts the plan in order and supervises it.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher.health import wait_http, wait_serving
from meshtrain.services.launcher.ranks import stopped_before_training
from meshtrain.services.launcher.topology import (
    ChildFailed,
    StopRequested,
    Topology,
    stop_on_signals,
)
from meshtrain.services.launcher.up_plan import Plan, UpOptions, plan, start_rollouts_from


def write_token_file(path: Path) -> None:
    """A fresh admin token for this run in `path`, readable by its owner only (replacing an
    earlier run's: a token lives as long as one `up`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        f.write(f"admin {secrets.token_urlsafe(32)}\n")


def claim_run_dir(run_dir: Path):
    """Lock `run_dir` for this `up` (an exclusive flock on RUN_DIR/.up.lock, holding our pid),
    for as long as the returned file stays open; the lock goes when this process does.

    Two `up`s on one run directory would interleave their metrics.jsonl, the first to end would
    delete the other's control.addr, and their checkpoints would collide; so would an `up` and
    a trainer already running there (RUN_DIR/.train.lock, `services/trainer/run_dir.py`), which
    may be a `meshtrain train` or the trainer of an `up` that has died. Our own trainer ranks
    are told our pid (UP_PID_ENV), so that our lock does not refuse them.

    Raises:
        ConfigError: another `up` or a trainer holds it (naming its pid), or the folder cannot be
            created.
    """
    from meshtrain.services.common.run_locks import TRAIN_LOCK, UP_LOCK, lock_file, probe_lock

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"meshtrain up: cannot use the run directory {run_dir}: {e.strerror}"
        ) from None
    lock = lock_file(run_dir / UP_LOCK)
    if isinstance(lock, str):
        raise ConfigError(
            f"meshtrain up: {run_dir} is in use by another meshtrain up (pid {lock}); stop it "
            f"first (`meshtrain stop {run_dir}`) or give this run another --log.run_dir"
        )
    trainer = probe_lock(run_dir / TRAIN_LOCK)
    if trainer is not None:
        lock.close()
        raise ConfigError(
            f"meshtrain up: {run_dir} is in use by a trainer (pid {trainer}); stop it first "
            f"(`meshtrain stop {run_dir}`) or give this run another --log.run_dir"
        )
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _start_services(
    topo: Topology, p: Plan, options: UpOptions, stop: threading.Event
) -> int | None:
    """Start the object store (an S3 port that answers, then its bucket), then the services in
    order, each once the one before is healthy.

    Returns:
        The save root's step the trainer resumes from (`_resume_from`), if any.
    """
    if p.store is not None:
        assert p.store_child is not None  # `plan` makes them together
        topo.start(p.store_child, wait_http(options.start_timeout_s, stop))
        p.store.make_bucket(options.s3_bucket, options.start_timeout_s)
        topo.say(
            f"object store {p.store.endpoint} serving bucket {options.s3_bucket} "
            f"(data and keys in {p.store.folder})"
        )
    step = _resume_from(p, options)  # the store is up: its root can be listed
    if p.rollouts:
        root, at = start_rollouts_from(p, step)
        topo.say(
            f"rollout workers {', '.join(f'127.0.0.1:{c.port}' for c in p.rollouts)} start from "
            f"{root} {'step ' + str(at) if at is not None else '(newest step)'}"
        )
    serving = wait_serving(options.start_timeout_s, stop)
    for child in p.services:
        if stop.is_set():
            break
        topo.start(child, serving)
    return step


def _resume_from(p: Plan, options: UpOptions) -> int | None:
    """The newest committed step under the save root when the trainer should resume from it.

    The run's own checkpoints win over `--checkpoint.load` (where a run starts, e.g. imported
    weights): rerunning the command continues the run instead of starting it again (and then
    failing at its first save, whose step exists). An explicit `--checkpoint.load_step` wins.
    """
    if not options.resume or p.load_step:
        return None
    from meshtrain.services.checkpoint.reader import latest_step

    return latest_step(p.save)


def run_up(
    options: UpOptions, overrides: list[str], out=None, stop: threading.Event | None = None
) -> int:
    """Run the topology until the trainer finishes, SIGINT/SIGTERM, or a child fails.

    Args:
        options: the launcher's own options.
        overrides: `meshtrain train` arguments.
        out: where prefixed log lines go (stdout by default).
        stop: set it to stop the run from another thread (tests); signals set it too.

    Returns:
        0 when the trainer finished or stopped cleanly, 1 when a child failed.
    """
    p = plan(options, overrides)
    with claim_run_dir(p.run_dir):
        assert p.token_file is not None  # `plan` names it in the run directory
        try:
            write_token_file(p.token_file)
        except OSError as e:
            raise ConfigError(
                f"meshtrain up: cannot write the run's token file {p.token_file}: {e.strerror}"
            ) from None
        return _run_up(p, options, out, stop)


def _run_up(p: Plan, options: UpOptions, out, stop: threading.Event | None) -> int:
    topo = Topology(out)
    stop = stop or threading.Event()
    with stop_on_signals(
        topo, stop, "stopping (trainer first, it checkpoints; again to stop at once)"
    ):
        code, statuses = _run(topo, p, options, stop)
    failed = {n: c for n, c in statuses.items() if n.startswith("trainer") and c not in (0, None)}
    early = stopped_before_training(topo, stop, failed)
    if early:
        topo.say(f"{', '.join(early)} stopped before training started")
    failed = {n: c for n, c in failed.items() if n not in early}
    if failed and code == 0:
        topo.say(f"error: trainer exit statuses {failed}")
        code = 1
    topo.say(f"stopped (exit {code})")
    return code


def _run(
    topo: Topology, p: Plan, options: UpOptions, stop: threading.Event
) -> tuple[int, dict[str, int | None]]:
    """Start the plan's processes, supervise them, stop them: (exit status so far, each child's
    status)."""
    code = 1
    # The store's endpoint and keys, for this process (listing the save root) and every child.
    saved_env = {k: os.environ.get(k) for k in (p.store.env() if p.store else {})}
    if p.store is not None:
        os.environ.update(p.store.env())
    try:
        topo.say(f"run directory {p.run_dir}, checkpoints {p.save}")
        step = _start_services(topo, p, options, stop)
        if not stop.is_set():
            if step is not None:
                topo.say(f"{p.save} holds committed step {step}: the trainer resumes from it")
                for child in p.trainers:
                    child.argv.append(f"--checkpoint.load={p.save}")
            for child in p.trainers:
                topo.start(child)
            topo.say(
                f"trainer started: `meshtrain status {p.run_dir}` / `meshtrain stop {p.run_dir}`"
            )
            code = topo.supervise(stop, restart_wait=wait_serving(options.start_timeout_s, stop))
        else:
            code = 0
    except StopRequested as e:
        topo.say(str(e))
        code = 0
    except (ChildFailed, ConfigError) as e:
        topo.say(f"error: {e}; stopping the topology")
        code = 1
    finally:
        statuses = topo.shutdown()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code, statuses
