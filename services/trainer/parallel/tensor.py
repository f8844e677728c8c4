"""Tensor (+ sequence) parallelism: `parallelize`, which shards a built GPT in place.

`parallelize(model, mesh, sequence_parallel)` swaps the single-device layers for their
tensor-parallel versions (`parallel/tensor_layers.py`) in place, slicing the full weights so the
sharded model computes the same function: fused QKV becomes column-parallel by query groups, the
attention output projection and fc2 row-parallel, fc1 column-parallel by halves (gate and up
each split), the word embedding vocab-parallel, and the LM head a vocab-parallel cross-entropy
that never gathers the full logits. Parameter names do not change; a parameter's `tp_split`
attribute says how it is sharded (see `TPSplit`) so checkpoints can gather or slice it. With
sequence parallelism, activations between blocks are (batch, seq/tp, hidden) and norm weights
and row-parallel biases (marked `sequence_parallel`) need their gradients summed over tp. The
fused QKV's bias (`model.qkv_bias`) splits with its rows; per-head q/k norm weights
(`model.qk_norm`) stay whole, and as each rank normalizes only its own heads they are marked to
be summed over tp with or without sequence parallelism.

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

import torch
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.checks import check_tensor_parallel
from meshtrain.services.trainer.model.moe import MoE
from meshtrain.services.trainer.parallel import async_tp
from meshtrain.services.trainer.parallel import mappings as M
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPSplit,
    VocabParallelEmbedding,
    VocabParallelHead,
    padded_rows,
    reshard_param,
    sharded_param,
    tp_split_of,
)


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
        out.weight = sharded_param(
            split.shard(
                padded_rows(out.weight, tp, cfg.make_vocab_size_divisible_by), mesh.tp_rank, tp
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
