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

import torch

os.environ.setdefault(
    "MESHTRAIN_CACHE", str(Path(__file__).resolve().parents[1] / ".cache" / "meshtrain")
)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
