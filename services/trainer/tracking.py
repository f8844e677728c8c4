"""Experiment trackers beside metrics.jsonl: TensorBoard event files and Weights & Biases runs.

`open_trackers(log_config, run_dir, config)` opens the trackers `log.tensorboard_dir`
(`--tensorboard-dir`) and `log.wandb_project` (`--wandb-project`) ask for; `MetricsLog` hands
each of them the numeric entries of every metrics.jsonl row (loss, lr, grad_norm, tokens_per_s,
step_time_s, mfu, memory, eval_loss, the MoE statistics) under the same names, at the row's step.
Only the rank that writes metrics.jsonl opens them. Both packages are optional extras
(`pip install 'meshtrain[tensorboard]'`, `'meshtrain[wandb]'`); asking for a tracker whose package
is missing is an error naming the extra. `WANDB_MODE=offline` writes the W&B run to disk only
(`wandb sync` uploads it later).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import secrets
import string
from pathlib import Path
from typing import Any, Protocol

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.sections import LogConfig

log = logging.getLogger("meshtrain.train")

_NOT_SCALARS = ("step", "time")
"""Entries of a metrics row that are its coordinates, not values to plot."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plottable entries of a metrics.jsonl row: finite numbers other than its step and time."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in _NOT_SCALARS
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars as TensorBoard events in `log_dir` (one event file per run, appended by resumes)."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                f"log.tensorboard_dir={log_dir!r} (--tensorboard-dir) needs the tensorboard "
                "package: pip install 'meshtrain[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crashed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Scalars as a Weights & Biases run. Its id is kept in RUN_DIR/wandb_run_id, so a run resumed
    into the same run directory continues the same W&B run."""

    def __init__(self, config: LogConfig, run_dir: Path, job_config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                f"log.wandb_project={config.wandb_project!r} (--wandb-project) needs the wandb "
                "package: pip install 'meshtrain[wandb]'"
            ) from None
        save_dir = Path(config.wandb_save_dir) if config.wandb_save_dir else run_dir / "wandb"
        save_dir.mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb_run_id"
        run_id = (
            id_file.read_text().strip()
            if id_file.is_file()
            else "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        )  # W&B's id alphabet
        self.run = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_entity,
            name=config.wandb_exp_name or run_dir.name,
            dir=str(save_dir),
            id=run_id,
            resume="allow",
            config=job_config,
        )
        id_file.write_text(run_id + "\n")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_PACKAGES = (("tensorboard_dir", "tensorboard", "tensorboard"), ("wandb_project", "wandb", "wandb"))
"""(log key, module, extra) of each tracker."""


def require_packages(config: LogConfig) -> None:
    """Refuse a tracker whose package is missing, without importing it (every rank can check,
    where only one opens the trackers).

    Raises:
        ConfigError: naming the key, its flag and the extra to install.
    """
    for key, module, extra in _PACKAGES:
        if getattr(config, key) and importlib.util.find_spec(module) is None:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"log.{key}={getattr(config, key)!r} ({flag}) needs the {module} package: "
                f"pip install 'meshtrain[{extra}]'"
            )


def open_trackers(config: LogConfig, run_dir: Path, job_config: dict[str, Any]) -> list[Tracker]:
    """The trackers `config` asks for, opened (none when it asks for none).

    Args:
        config: the job's log section.
        run_dir: the run directory (W&B's default folder and run name).
        job_config: the resolved job config as a table, recorded with the W&B run.

    Raises:
        ConfigError: a tracker is asked for and its package is not installed.
    """
    trackers: list[Tracker] = []
    try:
        if config.tensorboard_dir:
            trackers.append(TensorBoardTracker(config.tensorboard_dir))
            log.info("TensorBoard events: %s", config.tensorboard_dir)
        if config.wandb_project:
            trackers.append(WandbTracker(config, run_dir, job_config))
    except BaseException:
        close_trackers(trackers)
        raise
    return trackers


def close_trackers(trackers: list[Tracker]) -> None:
    """Close every tracker, even when one fails to (the failure is logged)."""
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as e:  # a tracker that fails to flush must not hide the run's own outcome
            log.warning("closing %s failed: %s", type(tracker).__name__, e)
