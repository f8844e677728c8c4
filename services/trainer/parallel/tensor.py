"""Tensor (+ sequence) parallelism: parallel layers and `parallelize`, which shards a built GPT.

`parallelize(model, mesh, sequence_parallel)` swaps the single-device layers for their
tensor-parallel versions in place, slicing the full weights so the sharded model computes the
same function: fused QKV becomes column-parallel by query groups, the attention output
projection and fc2 row-parallel, fc1 column-parallel by halves (gate and up each split), the
word embedding vocab-parallel, and the LM head a vocab-parallel cross-entropy that never
gathers the full logits. Parameter names do not change; a parameter's `tp_split` attribute
says how it is sharded (see `TPSplit`) so checkpoints can gather or slice it. With sequence
parallelism, activations between blocks are (batch, seq/tp, hidden) and norm weights and
row-parallel biases (marked `sequence_parallel`) need their gradients summed over tp. The fused
QKV's bias (`model.qkv_bias`) splits with its rows; per-head q/k norm weights (`model.qk_norm`)
stay whole, and as each rank normalizes only its own heads they are marked to be summed over tp
with or without sequence parallelism.

A mixture-of-experts block is one tensor-parallel region (`parallelize_moe`): its input is
gathered whole over tp (all-gathered along the sequence under sequence parallelism), every tp
rank routes the same tokens with the replicated router, each expert's inner width is split as
the dense MLP's (fc1 by halves on dim 1, fc2 on dim 2 of the stacked weights), and the block's
output, a per-rank partial sum, is reduced once (reduce-scattered under sequence parallelism).
Everything inside the region computes a share: the replicated router and shared-expert gate
get per-rank shares of their gradients (marked `sequence_parallel`, summed over tp like the
norms), and the auxiliary losses are injected 1/tp on each rank.

A vision encoder (`model.vision`) is split the same way, by heads and MLP width, without
sequence parallelism (its patches are a sequence of their own, whole on every rank); the
projector is column- then row-parallel (one Linear: replicated), so the image features reach the
embedding whole, before its sequence-parallel scatter. The encoder's replicated weights (patch
convolution, positions, norms) see the same input and gradient on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.checks import check_tensor_parallel
from meshtrain.services.trainer.model.moe import MoE
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


def _param(
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
        self.weight = _param(split.shard(full.weight, mesh.tp_rank, mesh.tp), split)
        self.bias = (
            _param(split.shard(full.bias, mesh.tp_rank, mesh.tp), split)
            if full.bias is not None
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s/tp or s, in) -> (b, s, out/tp)."""
        if self.in_region:
            return self.linear(x, self.weight, self.bias)
        if self.overlap:
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
        self.weight = _param(split.shard(full.weight, mesh.tp_rank, mesh.tp), split)
        # The bias is added after the reduction, once: replicated (per seq shard under SP).
        self.bias = (
            _param(full.bias, None, sequence_parallel or in_region)
            if full.bias is not None
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, in/tp) -> (b, s/tp or s, out); `in_region`: (b, s, out), this rank's share."""
        if self.in_region:
            y = self.linear(x, self.weight, None)
            return y + (self.bias / self.tp).to(y.dtype) if self.bias is not None else y
        if self.overlap:
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


def _padded_rows(weight: torch.Tensor, tp: int, multiple: int) -> torch.Tensor:
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
        self.weight = _param(
            split.shard(_padded_rows(full.weight, mesh.tp, multiple), mesh.tp_rank, mesh.tp), split
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


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    sequence_parallel: bool = False,
    comm_overlap: bool = False,
    device: torch.device | None = None,
    async_grad_reduce: bool = False,
) -> nn.Module:
    """Shard `model` (a GPT built with full weights) over mesh.tp, in place; returns it.

    Args:
        model: the single-device GPT.
        mesh: the layout.
        sequence_parallel: shard the activations between blocks along the sequence.
        comm_overlap: under sequence parallelism, overlap the linears' collectives with their
            matmuls (`async_tp`; CUDA + NCCL only).
        device: where the model will run (checked for `comm_overlap`).
        async_grad_reduce: column-parallel linears reduce their input gradient while computing
            their weight gradient (ignored where `comm_overlap` fuses the two already).

    Mixture-of-experts blocks become tensor-parallel regions (`parallelize_moe`); their experts
    are split over ep by `expert.parallelize_experts`, before or after this.

    Raises:
        ConfigError: a mesh with cp > 1 and a model not made context parallel first
            (`context.parallelize_context`: else each cp rank attends within its own tokens);
            head or group counts that tp does not divide, sequence parallelism with a sequence
            length tp does not divide, or comm_overlap where it cannot run.
    """
    _check_mesh_and_overlap(model, mesh, sequence_parallel, comm_overlap, device)
    tp = mesh.tp
    cfg = model.config
    if tp == 1:
        if sequence_parallel:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
        return model
    check_tensor_parallel(cfg, tp, sequence_parallel)
    check_moe_tensor_parallel(cfg, tp)
    with torch.no_grad():
        _shard_vocabulary(model, mesh, sequence_parallel)
        for layer in model.layers:
            _shard_block(layer, mesh, sequence_parallel, comm_overlap, async_grad_reduce)
        if getattr(model, "vision", None) is not None:
            _shard_vision(model, mesh)
        if sequence_parallel:
            for name, p in model.named_parameters():
                if "norm" in name and not name.startswith("vision."):
                    p.sequence_parallel = True  # type: ignore[attr-defined]
            group = mesh.group("tp")
            model.embedding.register_forward_hook(
                lambda _m, _i, out: M.scatter_to_sequence(out, group)
            )
    return model


def _check_mesh_and_overlap(
    model: nn.Module,
    mesh: Mesh,
    sequence_parallel: bool,
    comm_overlap: bool,
    device: torch.device | None,
) -> None:
    """Refuse a cp mesh for a model not made context parallel, and comm_overlap where it cannot
    run (without sequence parallelism, off CUDA + NCCL)."""
    if mesh.cp > 1 and getattr(model, "context", None) is None:
        raise ConfigError(
            f"the mesh has cp={mesh.cp}: make the model context parallel first "
            "(parallel.context.parallelize_context), or each cp rank attends only within its own "
            "tokens"
        )
    if comm_overlap:
        if not sequence_parallel:
            raise ConfigError("parallel.tp_comm_overlap needs parallel.sequence_parallel")
        why = async_tp.check_available(mesh.group("tp"), device or torch.device("cpu"))
        if why:
            raise ConfigError(f"parallel.tp_comm_overlap: {why}")


def _shard_vocabulary(model: nn.Module, mesh: Mesh, sequence_parallel: bool) -> None:
    """The word embeddings, the output layer (untied) and the loss head split over tp by
    vocabulary rows (padded to a multiple of make_vocab_size_divisible_by x tp)."""
    tp, cfg = mesh.tp, model.config
    emb = model.embedding
    emb.word_embeddings = VocabParallelEmbedding(
        emb.word_embeddings, mesh, cfg.make_vocab_size_divisible_by
    )
    if model.output_layer is not None:
        out = model.output_layer
        split = TPSplit(0, vocab=True)
        out.weight = _param(
            split.shard(
                _padded_rows(out.weight, tp, cfg.make_vocab_size_divisible_by), mesh.tp_rank, tp
            ),
            split,
        )
    model.head = VocabParallelHead(cfg.vocab_size, mesh, sequence_parallel)


def _shard_block(
    layer: nn.Module, mesh: Mesh, sequence_parallel: bool, overlap: bool, async_grad: bool
) -> None:
    """One transformer block over tp: attention by heads, the MLP column- then row-parallel (a
    MoE block as a tensor-parallel region, `parallelize_moe`)."""
    tp = mesh.tp
    att = layer.attention
    att.qkv = ColumnParallelLinear(
        att.qkv, mesh, sequence_parallel, overlap=overlap, async_grad=async_grad
    )
    att.proj = RowParallelLinear(att.proj, mesh, sequence_parallel, overlap=overlap)
    att.heads, att.groups = att.heads // tp, att.groups // tp
    for norm in (att.q_norm, att.k_norm):  # replicated, but each rank's heads give a share
        for p in norm.parameters() if norm is not None else ():
            p.sequence_parallel = True  # type: ignore[attr-defined]  # summed over tp
    if isinstance(layer.mlp, MoE):
        parallelize_moe(layer.mlp, mesh, sequence_parallel)
        return
    layer.mlp.fc1 = ColumnParallelLinear(
        layer.mlp.fc1,
        mesh,
        sequence_parallel,
        halves=layer.mlp.swiglu,
        overlap=overlap,
        async_grad=async_grad,
    )
    layer.mlp.fc2 = RowParallelLinear(layer.mlp.fc2, mesh, sequence_parallel, overlap=overlap)


def _shard_vision(model: nn.Module, mesh: Mesh) -> None:
    """The vision encoder's blocks and the projector over tp (no sequence parallelism)."""
    v, tp = model.config.vision, mesh.tp
    if v.num_attention_heads % tp or v.ffn_hidden_size % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide model.vision.num_attention_heads="
            f"{v.num_attention_heads} and model.vision.ffn_hidden_size={v.ffn_hidden_size}"
        )
    for layer in model.vision.layers:
        att = layer.attention
        att.qkv = ColumnParallelLinear(att.qkv, mesh, False)  # rows per head: whole heads
        att.proj = RowParallelLinear(att.proj, mesh, False)
        att.heads //= tp
        layer.mlp.fc1 = ColumnParallelLinear(layer.mlp.fc1, mesh, False)
        layer.mlp.fc2 = RowParallelLinear(layer.mlp.fc2, mesh, False)
    proj = model.projector
    if proj.fc2 is not None:
        proj.fc1 = ColumnParallelLinear(proj.fc1, mesh, False)
        proj.fc2 = RowParallelLinear(proj.fc2, mesh, False)


def check_moe_tensor_parallel(cfg, tp: int) -> None:
    """ConfigError unless tp divides each expert's and the shared expert's inner width."""
    if cfg.num_experts is None or tp == 1:
        return
    for key, width in (
        ("model.moe_ffn_hidden_size", cfg.moe_ffn_size),
        ("model.moe_shared_expert_intermediate_size", cfg.moe_shared_expert_intermediate_size),
    ):
        if width is not None and width % tp:
            raise ConfigError(
                f"parallel.tp={tp} (the expert tensor-parallel size) must divide {key}={width}"
            )


def parallelize_moe(moe: MoE, mesh: Mesh, sequence_parallel: bool) -> None:
    """Make one MoE block a tensor-parallel region over mesh.tp, in place (see module docstring).

    The stacked expert weights keep their leading (local) expert axis: fc1 (experts, 2*ffn/tp or
    ffn/tp, hidden) split on dim 1 by halves for SwiGLU, fc2 (experts, hidden, ffn/tp) on dim 2.
    They are marked `expert_shard` (first global expert, experts) if expert parallelism has not
    already done so.
    """
    tp, rank, group = mesh.tp, mesh.tp_rank, mesh.group("tp")
    check_moe_tensor_parallel(moe.config, tp)
    ex = moe.experts
    if tp_split_of(ex.fc1.weight) is not None:
        raise ConfigError("this MoE block is tensor parallel already (parallelize ran on it twice)")
    shard = (ex.first_expert, moe.num_experts)
    fc1, fc2 = TPSplit(1, halves=ex.swiglu), TPSplit(2)
    ex.fc1.weight = reshard_param(
        ex.fc1.weight,
        fc1.shard(ex.fc1.weight, rank, tp),
        tp_split=fc1,
        expert_shard=getattr(ex.fc1.weight, "expert_shard", shard),
    )
    ex.fc2.weight = reshard_param(
        ex.fc2.weight,
        fc2.shard(ex.fc2.weight, rank, tp),
        tp_split=fc2,
        expert_shard=getattr(ex.fc2.weight, "expert_shard", shard),
    )
    if moe.shared_expert is not None:
        se = moe.shared_expert
        se.fc1 = ColumnParallelLinear(
            se.fc1, mesh, sequence_parallel, halves=se.swiglu, in_region=True
        )
        se.fc2 = RowParallelLinear(se.fc2, mesh, sequence_parallel, in_region=True)
    # Replicated, but each rank's gradient is its share (the outputs they scale are partial).
    moe.router.weight.sequence_parallel = True  # type: ignore[attr-defined]
    if moe.shared_expert_gate is not None:
        moe.shared_expert_gate.weight.sequence_parallel = True  # type: ignore[attr-defined]
    if sequence_parallel:  # (b, s/tp, h) in and out; the block sees (b, s, h)
        moe.register_forward_pre_hook(
            lambda _m, args: (M.gather_from_sequence(args[0], group), *args[1:])
        )
        moe.register_forward_hook(lambda _m, _args, y: M.reduce_scatter_to_sequence(y, group))
    else:
        moe.register_forward_pre_hook(
            lambda _m, args: (M.copy_to_region(args[0], group), *args[1:])
        )
        moe.register_forward_hook(lambda _m, _args, y: M.reduce_from_region(y, group))
    moe.tp_region = tp  # type: ignore[attr-defined]
    set_moe_shares(moe, mesh)


def set_moe_shares(moe: MoE, mesh: Mesh) -> None:
    """Point a MoE block's statistics at the ranks sharing its global micro-batch and scale its
    auxiliary-loss share so the data-parallel gradient comes out as one process's.

    The load-balancing counts and token totals are summed over the dp x cp group (every rank's
    share of the loss then adds up to the global micro-batch's loss); DataParallel sums the
    gradients over dp x cp and divides by dp, so each share is injected dp times, and 1/tp more
    inside a tensor-parallel region, whose gradients are summed over tp.
    """
    moe.stats_group = mesh.group("dp_cp") if mesh.size("dp_cp") > 1 else None
    moe.aux_share_scale = mesh.dp / getattr(moe, "tp_region", 1)


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
