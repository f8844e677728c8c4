"""Process-wide test setup, before any test module is imported.

Without a GPU, Triton's kernels run under its interpreter (numpy on the CPU), which needs
TRITON_INTERPRET=1 before `triton` is first imported. Any module that imports the trainer
imports `kernels` and with it Triton, so the variable is set here, at the root, where it
precedes every test directory's collection whatever their order (tests/benchmarks is collected
before tests/kernels).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
