"""The checkpoint config section (`[checkpoint]`): where checkpoints go and where a run resumes
from."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.services.checkpoint.rpc.replicas import parse_addresses
from meshtrain.services.common.errors import CheckpointError, ConfigError


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
