"""The checkpoint service's configs: the trainer's `[checkpoint]` section (`CheckpointConfig`:
where checkpoints go and where a run resumes from) and the service's own (`ServeConfig`: what
`meshtrain ckpt serve` runs with, and the flags that set it). `cli.py` and `rpc/server.py` both
build a `ServeConfig` from those flags, so the server never imports the CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from meshtrain.services.checkpoint.rpc.replicas import parse_addresses
from meshtrain.services.common.errors import CheckpointError, ConfigError
from meshtrain.services.common.security import add_server_arguments


@dataclass
class CheckpointConfig:
    """Where checkpoints go and where a run resumes from."""

    save: str | None = None
    """Checkpoint root: a folder or URL (file://, memory://, s3://bucket/prefix with
    AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment); unset:
    RUN_DIR/checkpoints."""
    load: str | None = None
    """Resume from the latest committed checkpoint under this root (the root `save` names,
    while it holds none yet: start at step 0)."""
    load_step: int | None = None
    """Resume from this step instead of the latest committed one."""
    finetune: bool = False
    """Start a new run from `load`'s weights (Megatron's --finetune): step 0, no samples
    consumed, fresh optimizer and RNG states; the loaded run's position and plan are not
    checked against this one's (SFT from a pretrained model, DPO from an SFT model)."""
    load_optim: bool = True
    """Load the optimizer state (Adam's moments) with the weights; false (Megatron's
    --no-load-optim): the optimizer starts afresh at the loaded step."""
    load_rng: bool = True
    """Load the RNG states (dropout, the sampler) with the weights; false (Megatron's
    --no-load-rng): each rank seeds them from train.seed as a fresh run does."""
    save_interval: int = 0
    """Save every this many steps (0: only at the end)."""
    async_save: bool = True
    """Return to training after the device-to-host copy; upload and commit in the background."""
    service_address: str | None = None
    """host:port of a CheckpointService to stream shards to (its root is the service's own;
    `save` must name the same root so the run can list and load it), or of several replicas of
    it serving one root: `host:port,host:port` or `dns:///name:port` (ranks are spread over
    them; a replica that fails is replaced by another, the save in flight carries on)."""
    service_direct: bool = False
    """With service_address: the direct data plane. Ranks store their shards straight into
    `save`, which must be the service's root, and the service only grants and commits each save
    (for clusters where the service would be the bottleneck; every rank needs the storage's
    credentials)."""
    keep_last: int = 0
    """Before each save, keep only the N checkpoints with the highest steps (0: keep all). The
    run's own most recent checkpoint is kept besides, even where an earlier run's higher
    steps outrank it (a root shared with `overwrite`)."""
    keep_every: int = 0
    """With keep_last: also keep every checkpoint whose step is a multiple of K."""
    overwrite: bool = False
    """Replace a committed checkpoint of the same step (a run restarted from scratch into a
    root that holds an earlier run's steps); off: such a save is an error."""
    save_attempts: int = 3
    """Least number of tries for each stored object, for a save's start and for its commit
    before the save is reported failed (storage and checkpoint-service errors; a refused
    request is not retried); `save_retry_timeout_s` may allow more."""
    save_retry_backoff_s: float = 0.2
    """Sleep before a save's first retry, in seconds; it doubles with each retry, to at most
    2 s (or this, if larger)."""
    save_retry_timeout_s: float = 60.0
    """Keep retrying a failing start, stored object or commit of a save for this many seconds
    (however many tries that takes) before the save is reported failed, naming the storage or
    the checkpoint service and what failed: long enough for `meshtrain up` to bring a crashed
    checkpoint service back, where the save in flight is then resumed (every rank resends its
    boxes, rank 0 commits). 0: `save_attempts` tries only."""

    def __post_init__(self) -> None:
        if self.load_step is not None and self.load is None:
            raise ConfigError("checkpoint.load_step needs checkpoint.load")
        if self.finetune and self.load is None:
            raise ConfigError(
                "checkpoint.finetune (--finetune) needs checkpoint.load: the weights to start from"
            )
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval must be >= 0, got {self.save_interval}")
        if self.keep_last < 0 or self.keep_every < 0:
            raise ConfigError("checkpoint.keep_last and checkpoint.keep_every must be >= 0")
        if self.save_attempts < 1:
            raise ConfigError(f"checkpoint.save_attempts must be >= 1, got {self.save_attempts}")
        if not 0 <= self.save_retry_backoff_s <= 3600:  # also refuses NaN
            raise ConfigError(
                "checkpoint.save_retry_backoff_s must be in [0, 3600], got "
                f"{self.save_retry_backoff_s}"
            )
        if not 0 <= self.save_retry_timeout_s <= 86400:  # also refuses NaN
            raise ConfigError(
                "checkpoint.save_retry_timeout_s must be in [0, 86400], got "
                f"{self.save_retry_timeout_s}"
            )
        if self.service_direct and not self.service_address:
            raise ConfigError(
                "checkpoint.service_direct needs checkpoint.service_address (the service that "
                "grants and commits the saves)"
            )
        if self.service_address:
            try:
                parse_addresses(self.service_address)
            except CheckpointError as e:
                raise ConfigError(f"checkpoint.service_address: {e}") from None
        if self.keep_every and not self.keep_last:
            raise ConfigError("checkpoint.keep_every needs checkpoint.keep_last")


@dataclass
class ServeConfig:
    """What a CheckpointService runs with (`rpc/server.run`); `add_serve_arguments` has each
    field's flag."""

    root: str
    """Checkpoint root URL it serves (folder, file://, s3://bucket/prefix)."""
    port: int = 0
    """TCP port (0: any free one)."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    max_streams: int = 16
    """Concurrent RPCs."""
    commit_timeout: float = 600.0
    """Seconds a commit waits for every writer before aborting."""
    max_chunk_mb: float = 4.0
    """Largest data chunk."""
    max_inflight_mb: float = 1024.0
    """Box data held in memory at once, over all streams."""
    stream_idle_timeout: float = 120.0
    """Seconds a writer's stream may send nothing before it is aborted (0: never)."""
    max_writers: int = 65536
    """Most writers one save may have."""
    max_commit_timeout: float = 3600.0
    """Longest a commit waits for its writers, whatever its client asks."""
    max_commits: int = 4
    """Commits waiting at once."""
    grace: float = 5.0
    """Seconds granted on SIGTERM."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free port); None: off."""
    token_file: str | None = None
    """Bearer tokens callers must send (`meshtrain.services.common.security`)."""
    tls_cert: str | None = None
    """PEM certificate the server presents (turns TLS on)."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: str | None = None
    """PEM CA that must have signed client certificates (mutual TLS)."""
    insecure: bool = False
    """Serve an address other than loopback without authentication."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        """From the flags `add_serve_arguments` defines."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `meshtrain ckpt serve` (and of `python -m
    meshtrain.services.checkpoint.rpc.server`), one per `ServeConfig` field."""
    p.add_argument("root", help="checkpoint root URL (folder, file://, s3://bucket/prefix)")
    p.add_argument("--port", type=int, default=0, help="TCP port (0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--max-streams", type=int, default=16, help="concurrent RPCs")
    p.add_argument(
        "--commit-timeout",
        type=float,
        default=600.0,
        help="seconds a commit waits for every writer before aborting",
    )
    p.add_argument("--max-chunk-mb", type=float, default=4.0, help="largest data chunk")
    p.add_argument(
        "--max-inflight-mb",
        type=float,
        default=1024.0,
        help="box data held in memory at once, over all streams",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=120.0,
        help="seconds a writer's stream may send nothing before it is aborted and its "
        "share of the in-flight memory freed for the other writers (0: never)",
    )
    p.add_argument(
        "--max-writers",
        type=int,
        default=65536,
        help="most writers one save may have (BeginSave's num_writers; default 65536)",
    )
    p.add_argument(
        "--max-commit-timeout",
        type=float,
        default=3600.0,
        help="longest a commit waits for its writers, whatever its client asks (default 3600 s)",
    )
    p.add_argument(
        "--max-commits",
        type=int,
        default=4,
        help="commits waiting at once; one more is refused with RESOURCE_EXHAUSTED, so waiting "
        "commits never take the slots health checks need (default 4)",
    )
    p.add_argument("--grace", type=float, default=5.0, help="seconds granted on SIGTERM")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics (requests, bytes, latency, queue depth) on this "
        "port at /metrics (0: any free port, printed); off unless given",
    )
    add_server_arguments(p)  # --token-file, --tls-cert, --tls-key, --tls-client-ca, --insecure
