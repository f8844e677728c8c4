"""The run directory (DESIGN.md, "Run directory"): the folder a run writes into, and its
config.toml.

    run_dir = make_run_dir(job.log.run_dir, mesh)   # same path on every rank
    (run_dir / "config.toml").write_text(run_dir_toml(job, launcher_keys))
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import tomli_w
import torch.distributed as dist

from services.common import config as cfg
from services.trainer.config import JobConfig
from services.trainer.parallel.mesh import Mesh


def make_run_dir(configured: str | None, mesh: Mesh) -> Path:
    """Rank 0 picks (and creates) the run directory; every rank gets the same path."""
    if mesh.distributed:
        chosen = [str(_new_run_dir(configured)) if mesh.rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        return Path(chosen[0])
    return _new_run_dir(configured)


def _new_run_dir(configured: str | None) -> Path:
    if configured:
        path = Path(configured)
    else:
        path = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        n = 1
        while path.exists():
            path = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"
            n += 1
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_dir_toml(job: JobConfig, launcher_keys: list[str] | tuple[str, ...] = ()) -> str:
    """The run directory's config.toml: `job` resolved, less `launcher_keys`, which a header
    comment names (under `meshtrain up`: its data workers' and checkpoint service's addresses,
    dead once it exits, where `meshtrain train --config RUN/config.toml` would retry them)."""
    table = cfg.to_dict(job)
    left_out = [key for key in launcher_keys
                if table.get(key.partition(".")[0], {}).pop(key.partition(".")[2], None) is not None]
    text = tomli_w.dumps(table)
    if not left_out:
        return text
    note = (f"Left out: {', '.join(left_out)}, which `meshtrain up` pointed at its own services (they "
            "end with it). `meshtrain up --config` this file (or the command that started the run) resumes "
            "the run with new ones; `meshtrain train --config` this file reads the data in-process and "
            "writes checkpoints straight to checkpoint.save.")
    return textwrap.fill(note, 96, initial_indent="# ", subsequent_indent="# ") + "\n" + text
