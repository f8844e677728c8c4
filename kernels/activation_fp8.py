"""SwiGLU and GELU in Triton that also write the FP8 copy of their output for fc2.

The MLP's activation feeds fc2, an FP8 linear that would read the activation's output again for
its amax and again to cast it. Here the activation's forward kernel also writes
q = saturate(bf16(y) · scale) in the FP8 dtype and raises amax(|bf16(y)|), one atomic max per
program (Transformer Engine's LayerNormMLP does the same between its two GEMMs). bf16(y): the
FP8 linear casts from bf16 whatever arrives, so q and the amax are bit-equal to
`fp8_cast_transpose` of the bf16 y. Delayed scaling (a scale known before the pass): y, q and
the amax in one pass. Current scaling (scale None): y and its amax only; the linear casts y once
the scale is known (the scale needs the whole tensor's amax first).

y is the plain kernels' (`swiglu`, `gelu`): the same elementwise arithmetic, so the same bits
whatever the tile. The backward is theirs. Eager only: inside torch.compile the activation and
the cast are torch ops Inductor fuses itself. Spec: `meshtrain.kernels.reference.swiglu_fp8` and
`gelu_fp8`.
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import torch
import triton
import triton.language as tl

from meshtrain.kernels import gelu as _gelu
from meshtrain.kernels import reference
from meshtrain.kernels import swiglu as _swiglu
from meshtrain.kernels._launch import as_rows, wrap_triton
from meshtrain.kernels.fp8_cast import (
    bf16_rounded,
    check_fp8_target,
    fp8_bytes,
    fp8_constants,
    saturated_fp8,
)


@triton.jit
def _activation_fp8_fwd(
    in_ptr,
    y_ptr,
    q_ptr,
    scale_ptr,
    amax_ptr,
    in_stride,
    width,
    SWIGLU: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    BYTES: tl.constexpr,
    E5M2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One column block of one row: y (rows, width) contiguous, q likewise where QUANT, amax."""
    row, cols = _swiglu._row_and_cols(width, BLOCK)
    mask = cols < width
    a = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # the arithmetic of kernels/swiglu.py and kernels/gelu.py
    if SWIGLU:
        up = tl.load(in_ptr + row * in_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
        y = a * tl.sigmoid(a) * up
    else:
        y = a * tl.sigmoid(2.0 * 0.7978845608028654 * (a + 0.044715 * a * a * a))
    out = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * width + cols, out, mask=mask)
    yb = bf16_rounded(out.to(tl.float32), BYTES)  # as the FP8 linear reads y
    if QUANT:
        q = saturated_fp8(yb * tl.load(scale_ptr), FP8_MAX, MANT, BIAS, BYTES, E5M2)
        tl.store(q_ptr + row * width + cols, q, mask=mask)
    bits = tl.where(mask, tl.abs(yb).to(tl.int32, bitcast=True), 0)  # see kernels/fp8_cast.py
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(bits, axis=0))


def _forward(h: torch.Tensor, scale, dtype, swiglu: bool):
    """(y, q shaped like y or an empty tensor, amax 0-d fp32)."""
    check_fp8_target("activation_fp8", dtype, scale, h)
    quant = scale is not None
    h2 = as_rows(h)
    rows = h2.shape[0]
    width = h2.shape[1] // 2 if swiglu else h2.shape[1]
    shape = (*h.shape[:-1], width)
    y = torch.empty((rows, width), dtype=h.dtype, device=h.device)
    q = torch.empty((rows, width) if quant else (0,), dtype=dtype, device=h.device)
    amax = torch.zeros((), dtype=torch.float32, device=h.device)
    if rows * width:
        block = _swiglu._block(width)
        wrap_triton(_activation_fp8_fwd)[(rows * triton.cdiv(width, block),)](
            h2,
            y,
            fp8_bytes(q) if quant else y,
            scale.reshape(()).float() if quant else amax,
            amax,
            h2.stride(0),
            width,
            SWIGLU=swiglu,
            QUANT=quant,
            **fp8_constants(dtype),
            BLOCK=block,
            num_warps=4,
        )
    return y.view(shape), q.view(shape) if quant else q, amax


class _ActivationFp8(torch.autograd.Function):
    """SwiGLU or GELU with the FP8 copy; the backward is the plain op's, from its input."""

    @staticmethod
    def forward(ctx, h, scale, dtype, swiglu: bool):
        y, q, amax = _forward(h, scale, dtype, swiglu)
        ctx.save_for_backward(h)
        ctx.swiglu = swiglu
        ctx.mark_non_differentiable(q, amax)
        return y, q, amax

    @staticmethod
    def backward(ctx, dy, _dq, _damax):
        (h,) = ctx.saved_tensors
        backward = _swiglu._backward if ctx.swiglu else _gelu._backward
        return backward(dy, h), None, None, None


def swiglu_fp8(
    gate_up: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`swiglu(gate_up)` with the FP8 copy of its output and its amax, in one pass.

    Args:
        gate_up: (..., 2 * ffn), gate in the first half, up in the second.
        scale: one fp32 value on gate_up's device to cast with (delayed scaling), or None to
            take the amax alone (current scaling: the caller casts once the scale is known).
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.

    Returns:
        (y (..., ffn), differentiable; q = saturate(bf16(y) · scale) in `dtype` shaped like y,
        or None without a scale; amax(|bf16(y)|) as a 0-d fp32 tensor).
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_fp8 needs an even last dim, got {gate_up.shape[-1]}")
    if torch.compiler.is_compiling():  # traced as torch ops (see the module doc)
        return reference.swiglu_fp8(gate_up, scale, dtype)
    y, q, amax = _ActivationFp8.apply(gate_up, scale, dtype, True)
    return y, q if scale is not None else None, amax


def gelu_fp8(
    x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`gelu(x)` (tanh approximation) with the FP8 copy of its output and its amax, in one
    pass; the arguments and results as `swiglu_fp8`'s, y shaped like x."""
    if torch.compiler.is_compiling():
        return reference.gelu_fp8(x, scale, dtype)
    y, q, amax = _ActivationFp8.apply(x, scale, dtype, False)
    return y, q if scale is not None else None, amax
