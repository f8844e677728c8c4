"""What `meshtrain up` starts: each child's command line and environment, before any starts.

`plan` turns the launcher's options (`UpOptions`) and the trainer's arguments into a `Plan`: the
optional S3 store, the data workers, the checkpoint service, the rollout workers and the
trainer ranks, each a `topology.Child` with its argv (free ports on 127.0.0.1, the run's token
file, the flags pointing the trainer at its services) and its environment (the CPU thread
budget, the keys the launcher owns, our pid for the run directory's lock). It refuses, before
anything starts, the trainer flags and `--config` keys that `up` sets itself, and picks (and
creates) a default run directory. `start_rollouts_from` completes the rollout workers' commands
once the checkpoint they start from is known; `up` runs the plan.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain.services.common.config import load_toml
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher.objectstore import AccessKeys, ObjectStore, require_weed
from meshtrain.services.launcher.ranks import local_ranks
from meshtrain.services.launcher.threads import thread_budget
from meshtrain.services.launcher.topology import Child, free_port
from meshtrain.services.trainer.config.flags import parse_overrides

if TYPE_CHECKING:
    from meshtrain.services.trainer.config.sections import JobConfig

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
    """What `up.run_up` starts, in order, and where the run's files go.

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
        token_file: the run's token file (written by `up.run_up`, once the run directory is its
            own).
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


def plan(options: UpOptions, overrides: list[str]) -> Plan:
    """The children of the topology, in start order, without starting any (a default run
    directory, `runs/<time>-up`, is created here, so that it is this run's alone).

    Args:
        options: the launcher's own options.
        overrides: `meshtrain train` arguments (`--config FILE`, `--section.key=value`, aliases).

    Raises:
        ConfigError: a bad trainer argument, or `--s3` with a save root outside the store.
    """
    from meshtrain.services.trainer.config.load import load_config

    _refuse_owned_flags(
        overrides,
        data_workers=options.data_workers > 0,
        service=options.checkpoint_service,
        rollout=options.rollout_workers > 0,
    )
    from meshtrain.services.rollout.config import check_serve_arguments

    check_serve_arguments(options.rollout_args, ROLLOUT_OWNED, "meshtrain up --rollout-args")
    # A bad key fails here, before any process starts; checked with the control endpoint up
    # gives the trainer, which train.metrics_port needs.
    job = load_config([*overrides, "--train.control_port=0"])
    run_dir = Path(job.log.run_dir) if job.log.run_dir else _new_default_run_dir()
    store, store_child = _object_store(options, job, run_dir)
    save = job.checkpoint.save or (
        f"s3://{options.s3_bucket}/checkpoints" if store else str(run_dir / "checkpoints")
    )
    # Absolute: config.toml outlives this cwd.
    token_file = Path(os.path.abspath(run_dir / TOKEN_FILE))
    data, ckpt, rollouts = _services(options, job, save, token_file)
    rollout_addresses = [f"127.0.0.1:{c.port}" for c in rollouts]
    grpo_key = _grpo_rollout_addresses_arg(job, rollout_addresses) if rollouts else None
    trainers = _trainers(options, overrides, run_dir, save, token_file, data, ckpt, grpo_key)
    services = data + ([ckpt] if ckpt is not None else []) + rollouts
    _set_environments(options, services, trainers, bool(grpo_key), rollout_addresses)
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


def _object_store(
    options: UpOptions, job: JobConfig, run_dir: Path
) -> tuple[ObjectStore | None, Child | None]:
    """With `--s3`, the local object store (data in RUN_DIR/s3) and its process; else neither.

    Raises:
        ConfigError: the config's `checkpoint.save` is outside the store's bucket.
    """
    if not options.s3:
        return None, None
    if job.checkpoint.save and not job.checkpoint.save.startswith(f"s3://{options.s3_bucket}/"):
        raise ConfigError(
            f"--s3 keeps checkpoints in its own store under s3://{options.s3_bucket}/; "
            f"checkpoint.save={job.checkpoint.save!r} is elsewhere (leave it unset, "
            "or drop --s3 to use an existing store)"
        )
    folder = run_dir / "s3"
    store = ObjectStore(require_weed(), folder, AccessKeys.load_or_create(folder))
    # weed takes ~25 s to exit on SIGTERM; what it acknowledged is on disk, so 3 s will do.
    return store, Child("s3", store.argv(), port=store.port, role="store", grace_s=3.0)


def _services(
    options: UpOptions, job: JobConfig, save: str, token_file: Path
) -> tuple[list[Child], Child | None, list[Child]]:
    """The data workers, the checkpoint service (None without one) and the rollout workers, each
    on a free port, with the run's token file (and a metrics port with `--metrics`, but for the
    rollout workers).

    Raises:
        ConfigError: rollout workers without a policy to start from.
    """
    metrics = ["--metrics-port", "0"] if options.metrics else []
    auth = ["--token-file", str(token_file)]
    roots = [arg for root in data_roots(job.data) for arg in ("--allow-root", root)]
    data = []
    for i in range(options.data_workers):
        port = free_port()
        # Stateless and interchangeable: if one dies the trainer fails over to its peers and
        # the launcher brings it back on the same port.
        data.append(
            Child(
                f"data-{i}",
                PYTHON + ["data", "serve", "--port", str(port), *roots, *metrics, *auth],
                port=port,
                restart=True,
                grace_s=5.0,
            )
        )
    ckpt = None
    if options.checkpoint_service:
        port = free_port()
        # Its state is in storage (the committed checkpoints stay): brought back on its port, it
        # takes a save in flight when it died up again, as the ranks retry it for
        # checkpoint.save_retry_timeout_s (resending their boxes), and the run's next save finds it.
        ckpt = Child(
            "ckpt",
            PYTHON + ["ckpt", "serve", save, "--port", str(port), *metrics, *auth],
            port=port,
            restart=True,
            grace_s=15.0,
        )
    if options.rollout_workers and job.checkpoint.load is None and not options.resume:
        raise ConfigError(
            "meshtrain up: --rollout-workers needs a policy to start from: give "
            "--checkpoint.load ROOT (e.g. the SFT checkpoint), or drop --no-resume to resume "
            f"from the save root {save}"
        )
    return data, ckpt, _rollout_workers(options, save, auth)


def _rollout_workers(options: UpOptions, save: str, auth: list[str]) -> list[Child]:
    """`options.rollout_workers` rollout workers, each on a free port, reading the steps the
    trainer publishes under `save` (their starting checkpoint is `start_rollouts_from`'s)."""
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
    return rollouts


def _trainers(
    options: UpOptions,
    overrides: list[str],
    run_dir: Path,
    save: str,
    token_file: Path,
    data: list[Child],
    ckpt: Child | None,
    grpo_key: str | None,
) -> list[Child]:
    """The trainer ranks, pointed at the run directory, the save root, the token file and the
    services (`grpo_key`: `_grpo_rollout_addresses_arg`'s flag, or None)."""
    trainer_args = [
        *overrides,
        f"--log.run_dir={run_dir}",
        f"--checkpoint.save={save}",
        "--train.control_port=0",
        f"--auth.token_file={token_file}",
    ]
    if data:
        trainer_args += ["--data-service-addresses", *[f"127.0.0.1:{c.port}" for c in data]]
    if ckpt is not None:
        trainer_args.append(f"--checkpoint.service_address=127.0.0.1:{ckpt.port}")
    if grpo_key:
        trainer_args.append(grpo_key)
    return local_ranks(
        options.nproc_per_node,
        PYTHON + ["train", *trainer_args],
        "trainer",
        options.trainer_grace_s,
    )


def _set_environments(
    options: UpOptions,
    services: list[Child],
    trainers: list[Child],
    grpo_key: bool,
    rollout_addresses: list[str],
) -> None:
    """Each child's CPU thread budget; the trainer ranks' also names the keys that `up` sets
    (`grpo_key`: whether `--grpo.rollout_addresses` is one), our pid and the rollout workers."""
    from meshtrain.services.common.run_locks import UP_PID_ENV
    from meshtrain.services.rollout.config import ADDRESSES_ENV
    from meshtrain.services.trainer.config.load import LAUNCHER_KEYS_ENV

    # Addresses of our own services, which end with us: kept out of RUN/config.toml.
    launcher_keys = ["data.service_addresses"] * (options.data_workers > 0)
    launcher_keys += ["checkpoint.service_address"] * options.checkpoint_service
    launcher_keys += ["grpo.rollout_addresses"] * grpo_key
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
