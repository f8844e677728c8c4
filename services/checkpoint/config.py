"""The checkpoint config section (`[checkpoint]`): where checkpoints go and where a run resumes from.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import ConfigError


@dataclass
class CheckpointConfig:
    """Where checkpoints go and where a run resumes from."""

    save: str | None = None
    """Checkpoint root (folder or file:// / memory:// URL); unset: RUN_DIR/checkpoints."""
    load: str | None = None
    """Resume from the latest committed checkpoint under this root."""
    load_step: int | None = None
    """Resume from this step instead of the latest committed one."""
    save_interval: int = 0
    """Save every this many steps (0: only at the end)."""

    def __post_init__(self) -> None:
        if self.load_step is not None and self.load is None:
            raise ConfigError("checkpoint.load_step needs checkpoint.load")
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval must be >= 0, got {self.save_interval}")
