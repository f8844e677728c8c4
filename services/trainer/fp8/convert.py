"""Which layers train in FP8, putting them there, and the per-step update of delayed scaling.

`apply_fp8` turns the transformer blocks' dense linear layers (fused QKV, the attention output
projection, fc1 and fc2) into FP8 layers, after tensor parallelism has sharded them and before a
pipeline splits the model; with `experts` (train.fp8_experts) the MoE blocks' grouped expert
GEMMs too (`Fp8GroupedExperts`, row-scaled e4m3 whatever the recipe: fp8/experts.py), after
expert parallelism picked each rank's experts. Always bf16: the output layer (its logits feed
the loss) and the embeddings; the MoE routers and shared experts (the latter a dense MLP inside
the MoE block, outside `DENSE_LINEARS`); the grouped expert GEMMs without `experts`; the first and
last `bf16_layers_at_start/end` blocks when asked; and any weight whose local shape cuBLAS's FP8
GEMM refuses (a dimension not a multiple of 16), named in the log. With fused casts (tensorwise
and delayed), the norms and activations before those layers write their output's FP8 copy or amax
in the same kernel (`fused_inputs`). Parameters, their names and
the state dict do not change, so checkpoints of FP8 and bf16 runs load into each other.

Delayed scaling keeps one stacked state for the model (`DelayedState`); `Fp8Model.step_end()`,
called once per optimizer step after the backward, reduces the step's amaxes to their max over
the ranks holding the same layers (tensor and data/context parallel peers), turns the histories
into the next step's scales and starts a new history entry. The reduction over dp makes each
entry the max over all of the step's micro-batches, as one process's history is, whatever the
number of replicas, and keeps every replica casting alike. The history is not checkpointed (a
resumed run rebuilds it, its first step scaling by the current amax as a new run's does), so
checkpoints stay free of the layout; a resumed run's scales follow the uninterrupted run's
again once the history is full.

Amax groups (`Groups`, by `_activation_group`): an activation or output gradient that cp (and
tp, where it splits that tensor) cuts into pieces has its current amax max-reduced over those
ranks, so the first delayed step and every tensorwise cast use one process's scale. Weights are
whole but for tp (fully sharded data parallelism gathers them before the forward), so their
amaxes are reduced over tp alone.

    fp8 = apply_fp8(model, Recipe("hybrid", "delayed"), mesh)   # None: no layer qualified
    ...backward of every micro-batch...
    fp8.step_end()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.fp8.experts import Fp8GroupedExperts
from meshtrain.services.trainer.fp8.fused_inputs import fuse_input_casts
from meshtrain.services.trainer.fp8.linear import (
    DelayedState,
    Fp8Gemm,
    Fp8Linear,
    Groups,
    fp8_ready_shape,
)
from meshtrain.services.trainer.fp8.scaling import Recipe, roll_history, scale_from_history
from meshtrain.services.trainer.model.moe import MoE
from meshtrain.services.trainer.parallel.mesh import Mesh

log = logging.getLogger(__name__)

DENSE_LINEARS = (("attention", "qkv"), ("attention", "proj"), ("mlp", "fc1"), ("mlp", "fc2"))
"""(submodule, linear) of each block that may run in FP8."""


@dataclass
class Fp8Model:
    """What `apply_fp8` did: the FP8 layers' names and the delayed-scaling state (if any)."""

    recipe: Recipe
    layers: list[str]
    kept: list[str] = field(default_factory=list)  # dense linears left in bf16, with the reason
    delayed: DelayedState | None = None
    groups: tuple[dist.ProcessGroup | None, ...] = ()
    experts: list[str] = field(default_factory=list)
    """The MoE blocks' `GroupedExperts` made `Fp8GroupedExperts` (train.fp8_experts)."""
    fused_inputs: list[str] = field(default_factory=list)
    """The norms and MLPs whose kernels hand the FP8 linear after them its input already cast
    (train.fp8_fused_casts, eager; `fp8.fused_inputs`)."""

    @torch.no_grad()
    def step_end(self) -> None:
        """Delayed scaling: the next step's scales from the history, after every backward of
        this step (a no-op for the dynamic recipes)."""
        state = self.delayed
        if state is None:
            return
        current = state.history[..., 0].contiguous()  # (layers, 3)
        for group in self.groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
        state.history[..., 0] = current
        role_max = torch.tensor(self.recipe.dtypes.role_max(), device=current.device)
        state.scale.copy_(
            scale_from_history(
                state.history,
                role_max,
                self.recipe.amax_compute_algo,
                self.recipe.margin,
                state.scale,
            )
        )
        roll_history(state.history)
        state.ready = True

    def describe(self) -> str:
        text = f"FP8 {self.recipe.format} {self.recipe.recipe} on {len(self.layers)} linear layers"
        if self.experts:
            text += f" and rowwise e4m3 on the experts of {len(self.experts)} MoE blocks"
        return text


def _blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    layers = model.layers
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(f"FP8 converts a GPT's blocks; model.layers is a {type(layers).__name__}")
    items = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    return [(int(i), block) for i, block in items]


def build_fp8(model: nn.Module, train, mesh: Mesh, device: torch.device) -> Fp8Model | None:
    """`apply_fp8` as the job's `train` section asks (None when train.fp8 is unset)."""
    if train.fp8 is None:
        return None
    recipe = Recipe(
        train.fp8,
        train.fp8_recipe,
        train.fp8_amax_history_len,
        train.fp8_amax_compute_algo,
        train.fp8_margin,
        train.fp8_fused_casts,
        train.fp8_fused_casts_compiled,
    )
    first_last = train.fp8_bf16_first_last
    return apply_fp8(
        model,
        recipe,
        mesh,
        train.fp8_bf16_layers_at_start if first_last else 0,
        train.fp8_bf16_layers_at_end if first_last else 0,
        device,
        all_gather=train.fp8_all_gather,
        experts=train.fp8_experts,
    )


def apply_fp8(
    model: nn.Module,
    recipe: Recipe,
    mesh: Mesh,
    bf16_layers_at_start: int = 0,
    bf16_layers_at_end: int = 0,
    device: torch.device | None = None,
    all_gather: bool = True,
    experts: bool = False,
) -> Fp8Model | None:
    """Put the eligible linear layers of `model` (a GPT, tensor-parallel or not) on FP8.

    `device`: where the model will train (the delayed state lives there); default: the weights'.
    `all_gather`: under sequence parallelism, column-parallel layers all-gather their input in FP8
    (tensorwise and delayed recipes; train.fp8_all_gather).
    `experts`: the MoE blocks' grouped expert GEMMs too (`convert_experts`; train.fp8_experts),
    but for the bf16 blocks at the start and end.

    Returns:
        The `Fp8Model` handle, or None when no layer qualified (logged).

    Raises:
        ConfigError: a layer is already FP8, or the bf16 blocks cover the whole model.
    """
    blocks = _blocks(model)
    n = len(blocks)
    if bf16_layers_at_start + bf16_layers_at_end >= n:
        raise ConfigError(
            f"train.fp8: {bf16_layers_at_start} first and {bf16_layers_at_end} last blocks kept in "
            f"bf16 leave none of the model's {n} blocks for FP8"
        )
    in_fp8 = range(bf16_layers_at_start, n - bf16_layers_at_end)
    chosen, kept = _choose_dense(blocks, in_fp8)
    fp8_experts = (
        convert_experts(
            [(i, b) for i, b in blocks if i in in_fp8],
            recipe.margin,
        )
        if experts
        else []
    )
    if not chosen and not fp8_experts:
        log.warning("train.fp8: no linear layer qualifies for FP8; the run trains in bf16")
        return None
    state = (
        DelayedState(
            len(chosen),
            recipe.amax_history_len,
            device if device is not None else chosen[0][1].weight.device,
        )
        if recipe.recipe == "delayed" and chosen
        else None
    )
    for index, (name, layer) in enumerate(chosen):
        delayed = (state, index) if state is not None else None
        _convert_dense(name, layer, mesh, recipe, delayed, all_gather)
    fused_inputs = []
    if recipe.fused_casts and recipe.recipe != "rowwise":  # see fp8/fused_inputs.py
        for i, block in blocks:
            fused_inputs += [f"layers.{i}.{name}" for name in fuse_input_casts(block)]
    amax_groups = (mesh.group("tp"), mesh.group("dp_cp")) if state is not None else ()
    return Fp8Model(
        recipe,
        [name for name, _ in chosen],
        kept,
        state,
        amax_groups,
        fp8_experts,
        fused_inputs,
    )


def _choose_dense(
    blocks: list[tuple[int, nn.Module]], in_fp8: range
) -> tuple[list[tuple[str, Any]], list[str]]:
    """The blocks' dense linears that go FP8 (name, layer: nn.Linear or a tensor-parallel layer),
    and those that stay bf16 with the reason (logged): outside `in_fp8`, or a local weight shape
    cuBLAS's FP8 GEMM refuses."""
    chosen: list[tuple[str, Any]] = []
    kept: list[str] = []
    for i, block in blocks:
        for sub, name in DENSE_LINEARS:
            layer = getattr(getattr(block, sub, None), name, None)
            if layer is None:  # a mixture-of-experts block has no fc1/fc2
                continue
            full = f"layers.{i}.{sub}.{name}"
            if i not in in_fp8:
                kept.append(f"{full} (bf16 block)")
                continue
            out_f, in_f = layer.weight.shape
            if not fp8_ready_shape(in_f, out_f):
                kept.append(f"{full} (local weight {out_f}x{in_f}: FP8 GEMMs need multiples of 16)")
                continue
            chosen.append((full, layer))
    if kept:
        log.info(
            "FP8: %d dense linear layers stay bf16: %s",
            len(kept),
            "; ".join(kept[:6]) + (f"; and {len(kept) - 6} more" if len(kept) > 6 else ""),
        )
    return chosen, kept


def _convert_dense(
    name: str,
    layer: Any,
    mesh: Mesh,
    recipe: Recipe,
    delayed: tuple[DelayedState, int] | None,
    all_gather: bool,
) -> None:
    """Make one chosen dense linear FP8 in place: an `nn.Linear` becomes an `Fp8Linear`; a
    tensor-parallel layer gets an FP8 GEMM as its `linear`."""
    if isinstance(layer, Fp8Linear) or isinstance(getattr(layer, "linear", None), Fp8Gemm):
        raise ConfigError(f"{name} is already an FP8 layer")
    if type(layer) is nn.Linear:  # no tensor parallelism: only cp splits the activations
        layer.__class__ = Fp8Linear
        cp = _activation_group(mesh, tp_split=False)
        groups = Groups(input=cp, grad_output=cp, tokens=cp)
        cast(Fp8Linear, layer).make_fp8(Fp8Gemm(recipe, groups, delayed))  # swapped above
    else:  # tensor parallel: column- or row-parallel, whose `linear` is the GEMM
        layer.linear = _tp_gemm(layer, mesh, recipe, delayed, all_gather)
        if hasattr(layer, "async_grad"):
            # its fused backward runs bf16 GEMMs; the plain path takes FP8
            layer.async_grad = False


def convert_experts(blocks: list[tuple[int, nn.Module]], margin: int) -> list[str]:
    """Make each MoE block's `GroupedExperts` among `blocks` an `Fp8GroupedExperts` (in place;
    parameters untouched), logging what was converted and where a local weight width (expert
    or tensor parallel shard) is no multiple of 16, so its GEMMs run the slow emulation.

    Returns:
        The converted modules' names (`layers.<i>.mlp.experts`).

    Raises:
        ConfigError: a block's experts are FP8 already.
    """
    names, emulated = [], []
    for i, block in blocks:
        moe = getattr(block, "mlp", None)
        if not isinstance(moe, MoE):
            continue
        name = f"layers.{i}.mlp.experts"
        ex = moe.experts
        if isinstance(ex, Fp8GroupedExperts):
            raise ConfigError(f"{name} is already FP8")
        for fc in (ex.fc1, ex.fc2):
            _, out_f, in_f = fc.weight.shape
            if not fp8_ready_shape(in_f, out_f):
                emulated.append(f"{name} (local weight {out_f}x{in_f})")
        ex.__class__ = Fp8GroupedExperts
        cast(Fp8GroupedExperts, ex).make_fp8(margin)
        names.append(name)
    if names:
        log.info(
            "FP8: the grouped expert GEMMs of %d MoE blocks in rowwise e4m3 (forward and input "
            "gradient; weight gradients bf16): %s",
            len(names),
            ", ".join(names),
        )
    if emulated:
        log.warning(
            "FP8 experts: widths not multiples of 16 run the emulated FP8 GEMM (slow): %s",
            "; ".join(emulated),
        )
    return names


def _activation_group(mesh: Mesh, tp_split: bool) -> dist.ProcessGroup | None:
    """The ranks holding the other pieces of one micro-batch's activation (or output gradient),
    over which its amax is max-reduced so each piece is cast with the whole tensor's scale, as
    one process casts it: the cp ranks (each holds its own tokens) and, where this tensor's shard
    differs per tp rank (`tp_split`: split along its features, or along the sequence under
    sequence parallelism), the tp ranks too (Transformer Engine's amax reduction group, tp x cp).
    Not dp: one process scales each micro-batch by its own amax, and so does each dp rank."""
    cp, tp = mesh.cp > 1, tp_split and mesh.tp > 1
    if cp and tp:
        return mesh.group("tp_cp")
    if cp:
        return mesh.group("cp")
    return mesh.group("tp") if tp else None


def _tp_gemm(
    layer: nn.Module,
    mesh: Mesh,
    recipe: Recipe,
    delayed: tuple[DelayedState, int] | None,
    all_gather: bool,
) -> Fp8Gemm:
    """The FP8 GEMM of a tensor-parallel layer, with its amax groups: over tp its sharded weight
    and the tensor whose dimension it splits (a column-parallel output gradient, a row-parallel
    input), and under sequence parallelism with `all_gather` a column-parallel input, which then
    arrives as the rank's sequence chunk and is gathered in FP8; over cp every activation and
    output gradient (each cp rank holds its own tokens)."""
    from meshtrain.services.trainer.parallel.tensor_layers import (
        ColumnParallelLinear,
        RowParallelLinear,
    )

    tp = mesh.group("tp") if mesh.tp > 1 else None
    tokens = mesh.group("cp") if mesh.cp > 1 else None
    if getattr(layer, "overlap", False):
        raise ConfigError(
            "train.fp8 does not combine with parallel.tp_comm_overlap (its fused GEMMs are bf16)"
        )
    if isinstance(layer, ColumnParallelLinear):
        if (
            all_gather
            and tp is not None
            and layer.sp
            and not layer.in_region
            and recipe.recipe != "rowwise"
        ):
            split = _activation_group(mesh, tp_split=True)
            groups = Groups(input=split, weight=tp, grad_output=split, tokens=tokens)
            return Fp8Gemm(recipe, groups, delayed, seq_group=tp)
        groups = Groups(
            input=_activation_group(mesh, tp_split=False),
            weight=tp,
            grad_output=_activation_group(mesh, tp_split=True),
            tokens=tokens,
        )
        return Fp8Gemm(recipe, groups, delayed)
    if isinstance(layer, RowParallelLinear):
        groups = Groups(
            input=_activation_group(mesh, tp_split=True),
            weight=tp,
            grad_output=_activation_group(mesh, tp_split=False),
            tokens=tokens,
        )
        return Fp8Gemm(recipe, groups, delayed)
    raise ConfigError(f"train.fp8: cannot run a {type(layer).__name__} in FP8")
