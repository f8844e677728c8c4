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
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshtrain.services.common.config import load_toml
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher.health import wait_http, wait_serving
from meshtrain.services.launcher.objectstore import AccessKeys, ObjectStore, require_weed
from meshtrain.services.launcher.ranks import local_ranks, stopped_before_training
from meshtrain.services.launcher.threads import thread_budget
from meshtrain.services.launcher.topology import (
    Child,
    ChildFailed,
    StopRequested,
    Topology,
    free_port,
    stop_on_signals,
)
from meshtrain.services.trainer.config.flags import parse_overrides

PYTHON = [sys.executable, "-m", "meshtrain.services.cli"]


@dataclass
class UpOptions:
    """What `meshtrain up` runs besides the trainer's own config.

    Attributes:
        data_workers: DataService workers (0: the trainer reads data in-process).
        nproc_per_node: trainer ranks.
        checkpoint_service: save through the checkpoint service (else ranks write the root
            directly).
        metrics: give every service a Prometheus port (announced in its log).
        trainer_grace_s: seconds the trainer gets to checkpoint after SIGTERM before SIGKILL.
        start_timeout_s: seconds a service may take to report SERVING.
        s3: run a local S3-compatible store (SeaweedFS) first and checkpoint into it.
        s3_bucket: the bucket `s3` creates and saves under.
        resume: resume from the newest committed checkpoint under the save root, if any.
        trainer_threads: CPU threads per trainer rank (None: `threads.thread_budget` picks).
        rollout_workers: rollout workers (`meshtrain rollout serve`; 0: none).
        rollout_args: further flags of every rollout worker (`--device cpu --eod-id 0`).
    """

    data_workers: int = 1
    nproc_per_node: int = 1
    checkpoint_service: bool = True
    metrics: bool = False
    trainer_grace_s: float = 120.0
    start_timeout_s: float = 120.0
    s3: bool = False
    s3_bucket: str = "meshtrain"
    resume: bool = True
    trainer_threads: int | None = None
    rollout_workers: int = 0
    rollout_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.rollout_workers < 0:
            raise ConfigError(f"up needs --rollout-workers >= 0 (got {self.rollout_workers})")
        if self.rollout_args and not self.rollout_workers:
            raise ConfigError("up: --rollout-args without --rollout-workers N starts nothing")
        if self.trainer_threads is not None and self.trainer_threads < 1:
            raise ConfigError(f"up needs --trainer-threads >= 1 (got {self.trainer_threads})")
        if self.nproc_per_node < 1 or self.data_workers < 0:
            raise ConfigError(
                f"up needs --nproc-per-node >= 1 (got {self.nproc_per_node}) and "
                f"--data-workers >= 0 (got {self.data_workers})"
            )


@dataclass
class Plan:
    """What `run_up` starts, in order, and where the run's files go.

    Attributes:
        services: the data workers, the checkpoint service and the rollout workers, in start
            order.
        trainers: the trainer ranks.
        run_dir: the run directory.
        save: the checkpoint root.
        store: the local object store (None without `--s3`).
        store_child: its process, started before the services (None without `--s3`).
        loads: whether the trainer config already names a checkpoint to load.
        load_step: whether it also names the step to load.
        token_file: the run's token file (written by `run_up`, once the run directory is its own).
        rollouts: the rollout workers (also in `services`); `start_rollouts_from` completes their
            command with the checkpoint they start from, known once the store is up.
        start_from: the checkpoint the trainer's config starts from, (root, step or None).
    """

    services: list[Child]
    trainers: list[Child]
    run_dir: Path
    save: str
    store: ObjectStore | None = None
    store_child: Child | None = None
    loads: bool = False
    load_step: bool = False
    token_file: Path | None = None
    rollouts: list[Child] = field(default_factory=list)
    start_from: tuple[str, int | None] | None = None


TOKEN_FILE = "auth.token"


def write_token_file(path: Path) -> None:
    """A fresh admin token for this run in `path`, readable by its owner only (replacing an
    earlier run's: a token lives as long as one `up`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        f.write(f"admin {secrets.token_urlsafe(32)}\n")


def plan(options: UpOptions, overrides: list[str]) -> Plan:
    """The children of the topology, in start order, without starting any (a default run
    directory, `runs/<time>-up`, is created here, so that it is this run's alone).

    Args:
        options: the launcher's own options.
        overrides: `meshtrain train` arguments (`--config FILE`, `--section.key=value`, aliases).

    Raises:
        ConfigError: a bad trainer argument, or `--s3` with a save root outside the store.
    """
    from meshtrain.services.common.run_locks import UP_PID_ENV
    from meshtrain.services.trainer.config.load import LAUNCHER_KEYS_ENV, load_config

    _refuse_owned_flags(
        overrides,
        data_workers=options.data_workers > 0,
        service=options.checkpoint_service,
        rollout=options.rollout_workers > 0,
    )
    from meshtrain.services.rollout.config import ADDRESSES_ENV, check_serve_arguments

    check_serve_arguments(options.rollout_args, ROLLOUT_OWNED, "meshtrain up --rollout-args")
    # A bad key fails here, before any process starts; checked with the control endpoint up
    # gives the trainer, which train.metrics_port needs.
    job = load_config([*overrides, "--train.control_port=0"])
    run_dir = Path(job.log.run_dir) if job.log.run_dir else _new_default_run_dir()
    store = store_child = None
    if options.s3:
        if job.checkpoint.save and not job.checkpoint.save.startswith(f"s3://{options.s3_bucket}/"):
            raise ConfigError(
                f"--s3 keeps checkpoints in its own store under s3://{options.s3_bucket}/; "
                f"checkpoint.save={job.checkpoint.save!r} is elsewhere (leave it unset, "
                "or drop --s3 to use an existing store)"
            )
        folder = run_dir / "s3"
        store = ObjectStore(require_weed(), folder, AccessKeys.load_or_create(folder))
        # weed takes ~25 s to exit on SIGTERM; what it acknowledged is on disk, so 3 s will do.
        store_child = Child("s3", store.argv(), port=store.port, role="store", grace_s=3.0)
    save = job.checkpoint.save or (
        f"s3://{options.s3_bucket}/checkpoints" if store else str(run_dir / "checkpoints")
    )
    metrics = ["--metrics-port", "0"] if options.metrics else []
    token_file = Path(
        os.path.abspath(run_dir / TOKEN_FILE)
    )  # absolute: config.toml outlives this cwd
    auth = ["--token-file", str(token_file)]
    services: list[Child] = []
    roots = [arg for root in data_roots(job.data) for arg in ("--allow-root", root)]
    for i in range(options.data_workers):
        port = free_port()
        # Stateless and interchangeable: if one dies the trainer fails over to its peers and
        # the launcher brings it back on the same port.
        services.append(
            Child(
                f"data-{i}",
                PYTHON + ["data", "serve", "--port", str(port), *roots, *metrics, *auth],
                port=port,
                restart=True,
                grace_s=5.0,
            )
        )
    trainer_args = [
        *overrides,
        f"--log.run_dir={run_dir}",
        f"--checkpoint.save={save}",
        "--train.control_port=0",
        f"--auth.token_file={token_file}",
    ]
    if services:  # the data workers only, so far
        trainer_args += ["--data-service-addresses", *[f"127.0.0.1:{c.port}" for c in services]]
    if options.checkpoint_service:
        port = free_port()
        # Its state is in storage (the committed checkpoints stay): brought back on its port, it
        # takes a save in flight when it died up again, as the ranks retry it for
        # checkpoint.save_retry_timeout_s (resending their boxes), and the run's next save finds it.
        services.append(
            Child(
                "ckpt",
                PYTHON + ["ckpt", "serve", save, "--port", str(port), *metrics, *auth],
                port=port,
                restart=True,
                grace_s=15.0,
            )
        )
        trainer_args.append(f"--checkpoint.service_address=127.0.0.1:{port}")
    if options.rollout_workers and job.checkpoint.load is None and not options.resume:
        raise ConfigError(
            "meshtrain up: --rollout-workers needs a policy to start from: give "
            "--checkpoint.load ROOT (e.g. the SFT checkpoint), or drop --no-resume to resume "
            f"from the save root {save}"
        )
    rollouts = []
    for i in range(options.rollout_workers):
        port = free_port()
        # Stateless apart from its weights: brought back on its port, it holds the starting
        # policy until the trainer's next publication, and refuses requests for newer versions
        # meanwhile, which the trainer's client sends to its peers.
        rollouts.append(
            Child(
                f"rollout-{i}",
                PYTHON
                + ["rollout", "serve", "--port", str(port), *options.rollout_args, *auth]
                + ["--checkpoint-root", save],
                port=port,
                restart=True,
                grace_s=10.0,
            )
        )
    services += rollouts
    rollout_addresses = [f"127.0.0.1:{c.port}" for c in rollouts]
    grpo_key = _grpo_rollout_addresses_arg(job, rollout_addresses) if rollouts else None
    if grpo_key:
        trainer_args.append(grpo_key)
    trainers = local_ranks(
        options.nproc_per_node,
        PYTHON + ["train", *trainer_args],
        "trainer",
        options.trainer_grace_s,
    )
    # Addresses of our own services, which end with us: kept out of RUN/config.toml.
    launcher_keys = ["data.service_addresses"] * (options.data_workers > 0)
    launcher_keys += ["checkpoint.service_address"] * options.checkpoint_service
    launcher_keys += ["grpo.rollout_addresses"] * bool(grpo_key)
    threads = thread_budget(
        options.nproc_per_node,
        options.data_workers,
        options.trainer_threads,
        rollout_workers=options.rollout_workers,
    )
    for child in services:
        child.env.update(threads.service_env())
    for child in trainers:
        child.env.update(threads.trainer_env())
        child.env[LAUNCHER_KEYS_ENV] = " ".join(launcher_keys)
        child.env[UP_PID_ENV] = str(os.getpid())  # the holder of RUN_DIR/.up.lock (claim_run_dir)
        if rollout_addresses:
            child.env[ADDRESSES_ENV] = ",".join(rollout_addresses)
    if not options.resume:  # from scratch into a root that may hold an earlier run's steps
        for child in trainers:
            child.argv.append("--checkpoint.overwrite=true")
    return Plan(
        services,
        trainers,
        run_dir,
        save,
        store,
        store_child,
        loads=job.checkpoint.load is not None,
        load_step=job.checkpoint.load_step is not None,
        token_file=token_file,
        rollouts=rollouts,
        start_from=(
            (job.checkpoint.load, job.checkpoint.load_step) if job.checkpoint.load else None
        ),
    )


ROLLOUT_OWNED = {
    "--load": "the policy the trainer starts from (--checkpoint.load, or the run's own newest "
    "checkpoint when it resumes)",
    "--step": "the step the trainer starts from (--checkpoint.load_step)",
    "--checkpoint-root": "the trainer's save root, where it publishes its steps",
    "--version": "0 for a run that starts from --checkpoint.load, the step when it resumes",
    "--port": "a free port on 127.0.0.1",
    "--host": "127.0.0.1",
    "--token-file": "the run's token file",
    "--insecure": "workers bind 127.0.0.1 with the run's token",
    "--tls-cert": "the launcher checks and calls its workers over loopback without TLS",
    "--tls-key": "the launcher checks and calls its workers over loopback without TLS",
    "--tls-client-ca": "the launcher checks and calls its workers over loopback without TLS",
}
"""Flags of `meshtrain rollout serve` that `up` sets itself, refused in `--rollout-args`."""


def _grpo_rollout_addresses_arg(job, addresses: list[str]) -> str | None:
    """The trainer flag handing a GRPO run that generates through the rollout service its
    workers (`grpo.rollout_addresses`); None for any other run (the addresses still reach it in
    $MESHTRAIN_ROLLOUT_ADDRESSES)."""
    if job.train.objective != "grpo" or job.grpo.rollout != "service":
        return None
    return "--grpo.rollout_addresses=[" + ", ".join(f'"{a}"' for a in addresses) + "]"


def start_rollouts_from(p: Plan, resume_step: int | None) -> tuple[str, int | None]:
    """Complete the rollout workers' commands with the checkpoint they start from, the one the
    trainer starts from: the save root's newest committed step when the trainer resumes from it,
    else the config's `checkpoint.load` (at `checkpoint.load_step`, else its newest step).

    Returns:
        (root, step or None: the newest).

    Raises:
        ConfigError: the trainer starts from no checkpoint (random weights: nothing to sample
            from that the trainer's first publication would not replace).
    """
    step: int | None
    if resume_step is not None:
        root, step = p.save, resume_step
    elif p.start_from is not None:
        root, step = p.start_from
    else:
        raise ConfigError(
            f"--rollout-workers needs a policy to start from, and {p.save} holds no committed "
            "checkpoint to resume from: give --checkpoint.load ROOT (e.g. the SFT checkpoint)"
        )
    # Versions are the trainer's steps: resumed, the run's own step; started from another run's
    # checkpoint (an SFT policy), the run counts from 0, and so must the workers' weights.
    version = [] if resume_step is not None else ["--version", "0"]
    for child in p.rollouts:
        child.argv += (
            ["--load", root] + (["--step", str(step)] if step is not None else []) + version
        )
    return root, step


def data_roots(data) -> list[str]:
    """What this run's data workers serve (`data serve --allow-root`): the folders holding the
    files of each `data.data_path` prefix (resolved, so a linked dataset's target is served) or
    the URL prefix itself, and `data.cache_dir`, where the default corpus is built."""
    from meshtrain.services.dataloader.spec import parse_data_path

    roots = [os.path.abspath(data.cache_dir)]
    for prefix in parse_data_path(data.data_path)[0] if data.data_path else []:
        if "://" in prefix and not prefix.startswith("file://"):
            roots.append(prefix)
            continue
        for ext in (".idx", ".bin"):
            roots.append(os.path.dirname(os.path.realpath(prefix.removeprefix("file://") + ext)))
    return list(dict.fromkeys(roots))


def _new_default_run_dir() -> Path:
    """A new folder `runs/<time>-up[-N]`, created here, so no other `up` started in the same
    second picks it too."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = Path("runs") / (f"{stamp}-up" + (f"-{n}" if n else ""))
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(
                f"meshtrain up: cannot create the run directory {path}: {e.strerror}"
            ) from None
    raise ConfigError(
        f"meshtrain up: no free run directory name runs/{stamp}-up-N; set --log.run_dir"
    )


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


def _refuse_owned_flags(
    overrides: list[str], data_workers: bool, service: bool, rollout: bool = False
) -> None:
    """`up` sets where the trainer finds its services and serves its endpoint; the same flags
    (or keys of the `--config` file) from the user would be overridden without a word, so they
    are refused instead."""
    owned = {
        "--train.control_port": (
            "up serves the control endpoint on a free port (see RUN_DIR/control.addr)"
        )
    }
    if data_workers:
        owned["--data-service-addresses"] = (
            "up points the trainer at its own data workers (--data-workers 0: none)"
        )
        owned["--data.service_addresses"] = owned["--data-service-addresses"]
    if service:
        owned["--checkpoint.service_address"] = (
            "up points the trainer at its own checkpoint service (--no-checkpoint-service: none)"
        )
    if rollout:
        owned["--grpo.rollout_addresses"] = (
            "up points the trainer at its own rollout workers (--rollout-workers 0: none)"
        )
    for arg in overrides:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and "." in flag:  # the loader reads --section.some-key as some_key
            flag = "--" + flag[2:].replace("-", "_")
        if flag in owned:
            raise ConfigError(f"meshtrain up: {flag} is set by up itself: {owned[flag]}")
    config_file, _ = parse_overrides(overrides)
    if config_file:
        _refuse_owned_keys(config_file, owned)


def _refuse_owned_keys(config_file: str, owned: dict[str, str]) -> None:
    """The keys of `owned` (as `--section.key` flags) in the `--config` file, refused likewise.

    A run directory's own `config.toml` (the resolved config a run writes, whose `log.run_dir`
    is the folder it is in) passes: the keys it holds are that run's wiring (under `up`,
    `train.control_port = 0`; the addresses of its services, gone since, are left out of it, but
    not by runs before that), so `up --config RUN/config.toml` reruns the run with its own.
    """
    table = load_toml(config_file)
    log = table.get("log")
    run_dir = log.get("run_dir") if isinstance(log, dict) else None
    if (
        isinstance(run_dir, str)
        and Path(config_file).resolve() == (Path(run_dir) / "config.toml").resolve()
    ):
        return
    for flag, why in owned.items():
        section, _, key = flag[2:].partition(".")
        if key and isinstance(table.get(section), dict) and key in table[section]:
            raise ConfigError(
                f"meshtrain up: {section}.{key} in {config_file} is set by up itself: {why}"
            )


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
