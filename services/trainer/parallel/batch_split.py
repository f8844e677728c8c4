"""Hide the forward pass's tensor-parallel reductions behind compute by splitting the batch.

Each block's attention and MLP end in a row-parallel linear whose output is summed over tp
(all-reduce, or reduce-scatter along the sequence with sequence parallelism), and the residual
add after it needs the sum: on one batch the collective has nothing to overlap with. With
`parallel.tp_batch_split` every micro-batch is cut in two along the batch and the halves take
turns, one branch (attention or MLP) at a time:

    half A: attention -> launch sum      half B: attention -> launch sum
    half A: wait, residual, MLP -> launch  half B: wait, residual, MLP -> launch   ...

so A's collective is in flight while B computes, and the other way round (the idea of
DeepSpeed's Domino). Samples never interact inside a block, so each half computes exactly what
it would in the whole batch; only the weight gradients are summed in two parts. The
column-parallel input-gradient reductions of backward are overlapped separately
(`parallel.tp_async_grad_reduce`).

Under torch.compile, Inductor fuses independent kernels that read the same buffer into one
kernel. The halves' norms (same weight) and RoPE (same cos/sin) would be fused, and that
kernel needs both halves' reductions finished: the waits move up and half of the overlap is
gone (seen in the generated code). So the second half reads its own copies of those tensors,
made by an op Inductor cannot see through (`separate`); a few KB per block.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.func import functional_call

from meshtrain.services.trainer.parallel.mappings import PendingReduction


@torch.library.custom_op("meshtrain::separate", mutates_args=())
def separate(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` that the compiler cannot trace back to `x` (gradient: identity)."""
    return x.clone()


@separate.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


separate.register_autograd(lambda _ctx, grad: grad)


def _norm(norm: nn.Module, x: torch.Tensor, own_copy: bool) -> torch.Tensor:
    if not own_copy:
        return norm(x)
    return functional_call(norm, {name: separate(p) for name, p in norm.named_parameters()}, (x,))


def _attention(layer: nn.Module, x: torch.Tensor, rope, own_copy: bool) -> PendingReduction:
    return layer.attention(_norm(layer.input_norm, x, own_copy), rope)


def _mlp(layer: nn.Module, x: torch.Tensor, rope, own_copy: bool) -> PendingReduction:
    return layer.mlp(_norm(layer.pre_mlp_norm, x, own_copy))


def run_layers_interleaved(model: nn.Module, start: int, end: int, x: torch.Tensor, rope) -> torch.Tensor:
    """`GPT._run_layers` on the two halves of `x` (batch, ...), interleaved branch by branch.

    A micro-batch of one sample runs as one part (each reduction waited for at once).
    """
    parts = list(torch.tensor_split(x, min(2, x.shape[0]), dim=0))
    ropes = [rope] + [tuple(separate(t) for t in rope) if rope is not None else None] * (len(parts) - 1)
    pending: list[PendingReduction | None] = [None] * len(parts)
    dropout: list[nn.Module | None] = [None] * len(parts)
    for layer in model.layers[start:end]:
        for branch in (_attention, _mlp):
            for i, part in enumerate(parts):
                if pending[i] is not None:
                    part = parts[i] = part + dropout[i](pending[i].wait())
                pending[i], dropout[i] = branch(layer, part, ropes[i], own_copy=i > 0), layer.dropout
    for i, part in enumerate(parts):
        if pending[i] is not None:
            parts[i] = part + dropout[i](pending[i].wait())
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def interleave_halves(model: nn.Module) -> None:
    """Make `model` (a GPT whose row-parallel linears defer their reductions) run its blocks
    through `run_layers_interleaved`; recompute chunks keep working (each chunk splits and
    joins its halves)."""
    model._run_layers = types.MethodType(run_layers_interleaved, model)
