"""Tensor-parallel layers and how a parameter is split over the tp ranks.

`TPSplit` says how a sharded parameter was cut (its `tp_split` attribute), so checkpoints,
optimizers and data parallelism can gather (`gather_tp`) or slice it. The layers hold a shard
of a single-device layer's weights and compute the same function: `ColumnParallelLinear`
(output features split; input copied into, or under sequence parallelism all-gathered into,
the region), `RowParallelLinear` (input features split; output summed, or reduce-scattered
along the sequence), `VocabParallelEmbedding` and `VocabParallelHead`, whose cross-entropy
never gathers the full logits. `parallel/tensor.py`'s `parallelize` swaps them into a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.services.trainer.parallel import async_tp
from meshtrain.services.trainer.parallel import mappings as M
from meshtrain.services.trainer.parallel.mesh import Mesh


@dataclass(frozen=True)
class TPSplit:
    """How a parameter is split over tp ranks: along `dim`, contiguously or per half.

    `halves`: the tensor is [A; B] along `dim` (SwiGLU's gate and up) and each rank holds
    [A_r; B_r]. `vocab`: the dim is the (padded) vocabulary.
    """

    dim: int
    halves: bool = False
    vocab: bool = False

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's part of the full tensor."""
        if self.halves:
            return torch.cat(
                [h.chunk(size, self.dim)[rank] for h in full.chunk(2, self.dim)], self.dim
            )
        return full.chunk(size, self.dim)[rank]

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order."""
        if self.halves:
            halves = [p.chunk(2, self.dim) for p in parts]
            return torch.cat(
                [
                    torch.cat([h[0] for h in halves], self.dim),
                    torch.cat([h[1] for h in halves], self.dim),
                ],
                self.dim,
            )
        return torch.cat(parts, self.dim)


def sharded_param(
    t: torch.Tensor, split: TPSplit | None = None, sequence_parallel: bool = False
) -> nn.Parameter:
    p = nn.Parameter(t.detach().clone().contiguous())
    p.tp_split = split  # type: ignore[attr-defined]
    p.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
    return p


LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""(x, weight, bias) -> y, the GEMM of a parallel linear: F.linear, or one that defers dW."""

SHARD_ATTRS = ("tp_split", "sequence_parallel", "expert_shard")
"""The attributes saying how a parameter is sharded; a parameter cut again keeps them."""


def reshard_param(old: nn.Parameter, t: torch.Tensor, **attrs) -> nn.Parameter:
    """A new parameter holding `t` (a slice of `old`), with `old`'s sharding attributes and
    `attrs`."""
    p = nn.Parameter(t.detach().clone().contiguous(), requires_grad=old.requires_grad)
    for name in SHARD_ATTRS:
        if hasattr(old, name):
            setattr(p, name, getattr(old, name))
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


class _ColumnLinearAsyncGrad(torch.autograd.Function):
    """Column-parallel linear whose backward reduces the input gradient during the dW GEMM.

    forward:  y = G(x) W^T + b     G: all-gather along the sequence (sp) or identity
    backward: dx = G*(dy W)        G*: reduce-scatter (sp) or all-reduce, launched first
              dW = dy^T G(x), db = sum(dy)   computed while G* is in flight
    The same arithmetic as the unfused path, in another order (as Megatron's asynchronous
    tensor-parallel all-reduce). The gathered input is kept for dW, as autograd keeps it
    for F.linear on the unfused path.
    """

    @staticmethod
    def forward(ctx, x, w, b, group, sp):
        full = M.all_gather(x, M.SEQ_DIM, group) if sp else x
        ctx.save_for_backward(full, w)
        ctx.group, ctx.sp, ctx.has_bias = group, sp, b is not None
        return F.linear(full, w, b)

    @staticmethod
    def backward(ctx, dy):
        full, w = ctx.saved_tensors
        dy = dy.contiguous()
        pending = M.launch_sum(dy @ w, ctx.group, ctx.sp)  # garbage until wait_sum
        flat_dy = dy.flatten(0, -2)
        dw = flat_dy.t() @ full.flatten(0, -2)
        db = flat_dy.sum(0) if ctx.has_bias else None
        return M.wait_sum(pending, ctx.sp), dw, db, None, None


class ColumnParallelLinear(nn.Module):
    """y = x W_r^T + b_r: output features split over tp; input replicated (or seq-gathered)."""

    def __init__(
        self,
        full: nn.Linear,
        mesh: Mesh,
        sequence_parallel: bool,
        halves: bool = False,
        overlap: bool = False,
        async_grad: bool = False,
        in_region: bool = False,
    ):
        """`in_region`: inside a region that gathered the input already and reduces its gradient
        (a MoE block): no collective here."""
        super().__init__()
        self.group, self.sp, self.overlap, self.async_grad = (
            mesh.group("tp"),
            sequence_parallel,
            overlap,
            async_grad,
        )
        self.in_region = in_region
        self.linear: LinearFn = F.linear  # a zero-bubble pipeline swaps in one that defers dW
        split = TPSplit(0, halves=halves)
        self.weight = sharded_param(split.shard(full.weight, mesh.tp_rank, mesh.tp), split)
        self.bias = (
            sharded_param(split.shard(full.bias, mesh.tp_rank, mesh.tp), split)
            if full.bias is not None
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s/tp or s, in) -> (b, s, out/tp)."""
        if self.in_region:
            return self.linear(x, self.weight, self.bias)
        if self.overlap:
            assert self.group is not None  # overlap is chosen only with a tp group
            return async_tp.gather_linear(x, self.weight, self.bias, self.group)
        if self.async_grad:
            x, w, b = async_tp.cast_for_linear(x, self.weight, self.bias)
            with torch.autocast(x.device.type, enabled=False):
                return _ColumnLinearAsyncGrad.apply(x, w, b, self.group, self.sp)
        x = M.to_compute_dtype(x)  # gather (and reduce the gradient) in bf16 under autocast
        if self.sp and getattr(self.linear, "gathers_sequence", False):
            return self.linear(
                x, self.weight, self.bias
            )  # an FP8 GEMM gathers the chunks itself, in FP8
        x = M.gather_from_sequence(x, self.group) if self.sp else M.copy_to_region(x, self.group)
        return self.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: input features split over tp; output reduced or reduce-scattered."""

    def __init__(
        self,
        full: nn.Linear,
        mesh: Mesh,
        sequence_parallel: bool,
        overlap: bool = False,
        in_region: bool = False,
    ):
        """`in_region`: inside a region that reduces the output itself (a MoE block): the output
        is this rank's share, bias/tp included (the bias's gradient is then a share too)."""
        super().__init__()
        self.group, self.sp, self.overlap = mesh.group("tp"), sequence_parallel, overlap
        self.in_region, self.tp = in_region, mesh.tp
        self.linear: LinearFn = F.linear  # a zero-bubble pipeline swaps in one that defers dW
        split = TPSplit(1)
        self.weight = sharded_param(split.shard(full.weight, mesh.tp_rank, mesh.tp), split)
        # The bias is added after the reduction, once: replicated (per seq shard under SP).
        self.bias = (
            sharded_param(full.bias, None, sequence_parallel or in_region)
            if full.bias is not None
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, in/tp) -> (b, s/tp or s, out); `in_region`: (b, s, out), this rank's share."""
        if self.in_region:
            y = self.linear(x, self.weight, None)
            return y + (self.bias / self.tp).to(y.dtype) if self.bias is not None else y
        if self.overlap:
            assert self.group is not None  # overlap is chosen only with a tp group
            y = async_tp.linear_reduce_scatter(x, self.weight, self.group)
        else:
            y = self.linear(x, self.weight, None)
            if self.sp:
                y = M.reduce_scatter_to_sequence(y, self.group)
            else:
                y = M.reduce_from_region(y, self.group)
        # in y's dtype: an fp32 bias added to autocast's bf16 output would promote the residual
        # stream to fp32 from here on (one process adds it inside autocast's linear, in bf16)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def padded_rows(weight: torch.Tensor, tp: int, multiple: int) -> torch.Tensor:
    """Pad vocabulary rows with zeros so they split evenly (and stay aligned) over tp."""
    step = multiple * tp
    rows = -(-weight.shape[0] // step) * step
    if rows == weight.shape[0]:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over tp; each rank looks up its rows, then all-reduce."""

    def __init__(self, full: nn.Embedding, mesh: Mesh, multiple: int):
        super().__init__()
        self.group = mesh.group("tp")
        split = TPSplit(0, vocab=True)
        self.weight = sharded_param(
            split.shard(padded_rows(full.weight, mesh.tp, multiple), mesh.tp_rank, mesh.tp), split
        )
        self.start = mesh.tp_rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) -> (b, s, hidden), full on every rank."""
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)
        return M.reduce_from_region(emb, self.group)


IGNORE_INDEX = -100  # a label that adds no loss and no gradient (F.cross_entropy's default)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy over vocab-sharded logits: max, target logit and sum-exp all-reduced.

    Like the single-device path, label -100 counts nothing, and a label outside the vocabulary
    (padding rows included) is an error, checked on the device without a host sync.
    """

    @staticmethod
    def forward(ctx, logits, labels, start, vocab_size, group):
        # logits: (n, V/tp) fp32, this rank's columns [start, start + V/tp)
        ignored = labels == IGNORE_INDEX
        torch._assert_async(
            ((labels >= 0) & (labels < vocab_size) | ignored).all(),
            "a label is outside the vocabulary (and not the ignore index -100)",
        )
        n, width = logits.shape
        cols = torch.arange(start, start + width, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))  # padding never counts
        vmax = logits.max(dim=-1).values
        M.all_reduce_max(vmax, group)
        shifted = logits - vmax.unsqueeze(-1)
        local = labels - start
        mine = (local >= 0) & (local < width)
        picked = shifted.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
        target = torch.where(
            mine, picked, torch.zeros_like(picked)
        )  # where, not *: picked may be -inf
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        both = torch.stack([target, sum_exp])
        both = M.all_reduce(both, group)
        target, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local.clamp(0, width - 1), mine, ignored)
        return torch.where(ignored, torch.zeros_like(target), sum_exp.log() - target)

    @staticmethod
    def backward(ctx, g):
        softmax, local, mine, ignored = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(1, local.unsqueeze(1), -mine.to(grad.dtype).unsqueeze(1))
        return (
            grad * torch.where(ignored, torch.zeros_like(g), g).unsqueeze(-1),
            None,
            None,
            None,
            None,
        )


class VocabParallelHead(nn.Module):
    """LM head over a vocab-sharded weight: loss without gathering logits, which it gathers on
    demand."""

    def __init__(self, vocab_size: int, mesh: Mesh, sequence_parallel: bool):
        super().__init__()
        self.vocab_size, self.group, self.sp = vocab_size, mesh.group("tp"), sequence_parallel
        self.rank = mesh.tp_rank

    def _local_logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = M.to_compute_dtype(h)
        h = M.gather_from_sequence(h, self.group) if self.sp else M.copy_to_region(h, self.group)
        logits = h @ weight.t()  # (b, s, V/tp)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def loss(self, h, weight, labels, loss_mask):
        logits = self._local_logits(h, weight)
        start = self.rank * weight.shape[0]
        losses = _VocabParallelCE.apply(
            logits.flatten(0, 1), labels.flatten(), start, self.vocab_size, self.group
        )
        if loss_mask is None:
            return losses.mean()
        mask = loss_mask.flatten().to(losses.dtype)
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)

    def token_logps(self, h, weight, labels):
        """(batch, seq) fp32 log-probabilities of `labels`, exact over the vocab shards."""
        logits = self._local_logits(h, weight)
        start = self.rank * weight.shape[0]
        losses = _VocabParallelCE.apply(
            logits.flatten(0, 1), labels.flatten(), start, self.vocab_size, self.group
        )
        return -losses.view(labels.shape)

    def logits(self, h, weight):
        full = M.gather_from_region(self._local_logits(h, weight), self.group)
        return full[..., : self.vocab_size]


def gather_tp(local: torch.Tensor, param: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The full tensor (vocabulary still padded) from every tp rank's shard of `param`'s kind.

    Args:
        local: this rank's shard (the parameter itself, its gradient, an Adam moment).
        param: the parameter, whose `tp_split` says how `local` was cut.
        mesh: the layout (collective over tp).
    """
    split = tp_split_of(param)
    if split is None or mesh.tp == 1:
        return local
    parts = M.all_gather(local.contiguous(), 0, mesh.group("tp")).chunk(
        mesh.tp, 0
    )  # each rank's shard
    return split.unshard(list(parts))


def tp_split_of(param: torch.Tensor) -> TPSplit | None:
    """The TPSplit a parameter carries (None: replicated over tp)."""
    return getattr(param, "tp_split", None)
