"""Process-wide test setup, before any test module is imported.

Without a GPU, Triton's kernels run under its interpreter (numpy on the CPU), which needs
TRITON_INTERPRET=1 before `triton` is first imported. Any module that imports the trainer
imports `kernels` and with it Triton, so the variable is set here, at the root, where it
precedes every test directory's collection whatever their order (tests/benchmarks is collected
before tests/kernels).

Tests that run meshtrain without `--data.cache_dir` (and the subprocesses they start, which
inherit the environment) build the embedded corpus in the checkout's ignored `.cache/meshtrain`
instead of the user's cache: kept between test runs, and never mixed with a user's own runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault(
    "MESHTRAIN_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "meshtrain")
)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _in_process_data_workers_serve_the_test_folders(monkeypatch):
    """A data worker started in a test without `allow_roots` serves what a worker started there
    by hand would (its directory and the user's cache) and the temporary folders tests write
    their datasets in, so a test that is not about `--allow-root` need not name them."""
    import tempfile

    from meshtrain.services.dataloader import served_roots
    from meshtrain.services.dataloader.rpc import servicer

    defaults = served_roots.default_roots() + [tempfile.gettempdir()]
    monkeypatch.setattr(servicer, "default_roots", lambda: defaults)
