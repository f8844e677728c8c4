"""What every rank process of `run_ranks` has imported before it forks off the server.

`run_ranks` starts its ranks from a forkserver that imports this module once per test process,
so a rank begins with torch, torch.distributed and the trainer already imported instead of
importing them from scratch (seconds per rank on a small machine, and every test starts two to
four ranks). The thread limits are set before anything is imported: a process with a BLAS or
OpenMP pool is not safe to fork, and the ranks run on one thread each anyway.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402,F401  (the test modules the ranks unpickle their functions from)
import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401

import meshtrain.services.checkpoint.reader  # noqa: E402,F401
import meshtrain.services.trainer.train  # noqa: E402,F401

torch.set_num_threads(1)

# The server's pid: a rank whose copy of this module holds another pid than its own was forked
# from the server with it imported (what tests/test_dist_utils.py checks).
LOADED_IN = os.getpid()
