"""The data-parallel wrapper for loops written by hand: an ordinary backward / optimizer.step().

`DataParallel` (data_parallel.py) exposes the gradient-sync sequence that the trainer drives step by
step (no_sync on all but the last micro-batch, finish_grad_sync, clip, step, gather_params,
zero_grad). Here that sequence hides behind a module and an optimizer, as Megatron Core's DDP
wrapper and the distributed optimizer beside it do:

    model = DistributedDataParallel(
        parallelize(GPT(cfg), mesh), mesh, optim_cfg, distributed_optimizer=True
    )
    optimizer = model.optimizer
    for step in range(steps):
        for tokens, labels, mask in model.accumulate(micro_batches):  # no_sync on all but the last
            (model(tokens, labels, mask) / len(micro_batches)).backward()
        grad_norm = optimizer.step()   # reduce gradients, clip, update, gather the parameters
        optimizer.zero_grad()

One process (no torch.distributed) works too: nothing is communicated, the sequence is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
from torch import nn

from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.optim.optimizer import build_optimizer
from meshtrain.services.trainer.parallel.data_parallel import DataParallel, forward_units
from meshtrain.services.trainer.parallel.mesh import Mesh

T = TypeVar("T")


class DistributedOptimizer:
    """AdamW whose `step()` first completes the gradient reduction and clips, then gathers the
    updated parameters (ZeRO-1: each rank updates its 1/dp slice).

    Args:
        ddp: the model's gradient synchronization.
        inner: the torch optimizer over the parameters (ZeRO-1: over this rank's slices).
        clip_grad: clip the global gradient norm to this (0: no clipping; the norm is still
            returned by `step`).
    """

    def __init__(self, ddp: DataParallel, inner: torch.optim.Optimizer, clip_grad: float):
        self.ddp, self.inner, self.clip_grad = ddp, inner, clip_grad

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (set the learning rate here: `set_lr(optimizer, lr)`)."""
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self) -> torch.Tensor:
        """Finish the gradient reduction, clip, update, all-gather the parameters.

        Returns:
            The global gradient norm before clipping (over every tp and dp rank), on the device.
        """
        self.ddp.finish_grad_sync()
        norm = self.ddp.grad_norm_and_clip(self.clip_grad)
        self.inner.step()
        self.ddp.gather_params()
        return norm

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place: they are views into the flat buckets the reduction
        sends, so they are never set to None (`set_to_none` is accepted and ignored)."""
        del set_to_none
        self.ddp.zero_grad()


class DistributedDataParallel(nn.Module):
    """Wraps a (tensor-parallel) GPT for data parallelism over `mesh.dp`.

    Calling it calls the model. Gradients are reduced over the data-parallel ranks (and the
    sequence-parallel ones summed over tp) by `optimizer.step()`, or during the last
    micro-batch's backward with `overlap_grad_reduce`; wrap all but a step's last micro-batch
    in `no_sync()`, or iterate them through `accumulate()`, which does that. Parameters stay
    fp32 (bf16 comes from autocast).

    Args:
        module: the model, already sharded by `parallelize` where tp > 1.
        mesh: the layout.
        optim: AdamW settings (lr, betas, weight decay, clip_grad).
        distributed_optimizer: ZeRO-1: Adam state sharded over dp.
        overlap_grad_reduce: reduce each gradient bucket as soon as backward has finished it.
        overlap_param_gather: ZeRO-1: all-gather each block's parameters just before its forward.
        bucket_size: elements per gradient bucket.
        reduce_dtype: what the reduction sends: torch.float32, or torch.bfloat16 (half the bytes).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        optim: OptimConfig,
        *,
        distributed_optimizer: bool = False,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        bucket_size: int = 40_000_000,
        reduce_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.module, self.mesh = module, mesh
        self.ddp = DataParallel(
            module,
            mesh,
            optim,
            distributed_optimizer=distributed_optimizer,
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather,
            bucket_size=bucket_size,
            reduce_dtype=reduce_dtype,
            gather_units=forward_units(module) if isinstance(module, GPT) else None,
        )
        inner = (
            self.ddp.optimizer if self.ddp.optimizer is not None else build_optimizer(module, optim)
        )
        self.optimizer = DistributedOptimizer(self.ddp, inner, optim.clip_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers still in flight. With `overlap_param_gather` the
        updated parameters of `optimizer.step()` arrive during the next forward; read them
        outside a forward (after the last step, say) only after this. `state_dict()` and
        `save_checkpoint` call it themselves."""
        self.ddp.wait_param_gather()

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return super().state_dict(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate gradients without communicating (all but a step's last micro-batch)."""
        return self.ddp.no_sync()

    def accumulate(self, micro_batches: Iterable[T]) -> Iterator[T]:
        """Yield a step's micro-batches; the body of the loop runs under `no_sync()` for all but
        the last, so gradients are reduced once per step."""
        items = list(micro_batches)
        for i, item in enumerate(items):
            if i < len(items) - 1:
                with self.ddp.no_sync():
                    yield item
            else:
                yield item
