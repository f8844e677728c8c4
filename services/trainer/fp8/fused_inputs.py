"""Norms and activations that hand the FP8 linear after them its input already cast.

A pre-norm block's input norm feeds the fused QKV, its MLP norm feeds fc1, and the MLP's
activation feeds fc2; each of those FP8 linears would read its bf16 input again for the amax and
again for the cast. As Transformer Engine's LayerNormLinear and LayerNormMLP do, the producing
kernel writes, in the pass that makes y, y's FP8 copy and amax (`kernels/norm_fp8.py`,
`kernels/activation_fp8.py`), and the linear takes them (`Fp8Gemm.offer_input`) instead of
casting. With delayed scaling (after its first step) the copy is made with the history's scale:
y, q and the amax in one pass, the amax raising the history. With current scaling (tensorwise, and
delayed scaling's first step) the scale needs the whole tensor's amax first: the producer writes
y and its amax in one pass, and the linear casts y with the scale from it (over its amax group),
one read of y fewer. Rowwise scaling takes nothing (its scales are per row of each GEMM's
operand, along the other dimension for the backward).

Behind `train.fp8_fused_casts`, in eager layers only: inside torch.compile the norm, activation
and casts are traced as torch ops and Inductor fuses them itself (`Recipe.fused_now`). The
values are bit-equal to the unfused path's: the kernels compute y as the plain ones do and cast
it as the linear would.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.kernels import dispatch
from meshtrain.services.trainer.fp8.linear import Fp8Gemm, Fp8Linear
from meshtrain.services.trainer.model.mlp import MLP
from meshtrain.services.trainer.model.norm import Norm


class Fp8Norm(Norm):
    """A `Norm` whose output feeds an FP8 linear (`fp8_next`) and comes with its FP8 copy."""

    fp8_next: Fp8Gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.fp8_next.input_plan()
        if plan is None:
            return super().forward(x)
        dtype, scale = plan
        if self.rms:
            y, q, amax = dispatch.rms_norm_fp8(x, self.weight, self.eps, scale, dtype)
        else:
            y, q, amax = dispatch.layer_norm_fp8(x, self.weight, self.bias, self.eps, scale, dtype)
        self.fp8_next.offer_input(y, q, amax)
        return y


class Fp8MLP(MLP):
    """An `MLP` whose activation hands fc2 (an FP8 linear, `fp8_next`) its FP8 copy."""

    fp8_next: Fp8Gemm

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        plan = self.fp8_next.input_plan()
        if plan is None:
            return super().activation(h)
        dtype, scale = plan
        op = dispatch.swiglu_fp8 if self.swiglu else dispatch.gelu_fp8
        y, q, amax = op(h, scale, dtype)
        self.fp8_next.offer_input(y, q, amax)
        return y


def _gemm(layer: nn.Module | None) -> Fp8Gemm | None:
    """The FP8 GEMM of a linear layer (an `Fp8Linear`, or a tensor-parallel layer running one)."""
    if isinstance(layer, Fp8Linear):
        return layer.fp8
    gemm = getattr(layer, "linear", None)
    return gemm if isinstance(gemm, Fp8Gemm) else None


def fuse_input_casts(block: nn.Module) -> list[str]:
    """Make the producers of the block's FP8 linears' inputs cast them (see the module doc):
    the input norm for the fused QKV, the MLP's norm for fc1, its activation for fc2, where
    that linear is FP8. Returns the producers changed (attribute paths in the block)."""
    pairs = (
        ("input_norm", getattr(block, "input_norm", None), ("attention", "qkv"), Norm, Fp8Norm),
        ("pre_mlp_norm", getattr(block, "pre_mlp_norm", None), ("mlp", "fc1"), Norm, Fp8Norm),
        ("mlp", getattr(block, "mlp", None), ("mlp", "fc2"), MLP, Fp8MLP),
    )
    changed = []
    for name, producer, (sub, linear), plain, fused in pairs:
        assert producer is None or isinstance(producer, nn.Module)
        gemm = _gemm(getattr(getattr(block, sub, None), linear, None))
        if gemm is None or type(producer) is not plain:
            continue
        producer.__class__ = fused
        object.__setattr__(producer, "fp8_next", gemm)  # a plain object, not a submodule
        changed.append(name)
    return changed
