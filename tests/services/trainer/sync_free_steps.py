"""A few training steps of any layout in CUDA's sync-debug 'error' mode (one process per rank).

    torchrun --standalone --nproc-per-node 2 -m tests.services.trainer.sync_free_steps [config args]

Used by test_gpu.py: the single-GPU test covers the plain step, this one the sharded ones
(tensor-parallel collectives, the bucketed gradient reduction, the distributed optimizer's
reduce-scatter, norm and all-gather), where a stray `.item()` or pageable copy would make every
step wait for the GPU to drain. Exits non-zero (a RuntimeError naming the synchronizing call)
if a step synchronizes.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import Trainer

WARMUP = 2  # lazy initialization (cuBLAS handles, NCCL communicators, compiled graphs) may sync


def main(argv: list[str]) -> None:
    trainer = Trainer(load_config(argv))
    if trainer.device.type != "cuda":
        raise SystemExit("sync_free_steps: needs train.device=cuda (the sync-debug mode is CUDA's)")
    try:
        for step in range(WARMUP):
            trainer.train_step(step)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            try:  # the mode is in force: a read-back must fail, or the steps below prove nothing
                torch.ones(1, device=trainer.device).item()
            except RuntimeError:
                pass
            else:
                raise SystemExit(
                    "sync_free_steps: CUDA's sync-debug 'error' mode let .item() through"
                )
            for step in range(WARMUP, WARMUP + 3):
                trainer.train_step(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    finally:
        trainer.checkpointer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
