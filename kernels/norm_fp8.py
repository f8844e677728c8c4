"""RMSNorm and LayerNorm in Triton that also write the FP8 copy of their output for the next GEMM.

A pre-norm block feeds its norm's output to an FP8 linear (the fused QKV, fc1), which would read
it again to take its amax and again to cast it. Here the norm's forward kernel, while the row is
in registers, also writes q = saturate(y · scale) in the FP8 dtype and raises amax(|y|) (one
atomic max per program, on the fp32 bits as in `meshtrain.kernels.fp8_cast`): Transformer
Engine's LayerNormLinear. q and the amax are of y as the linear reads it, rounded to bf16 (the
FP8 GEMM casts from bf16 whatever arrives), so they are bit-equal to `fp8_cast_transpose` of
the bf16 y. With delayed scaling the scale is known before the pass and q, y and the amax come
out of one; with current scaling (scale None) the kernel writes y and its amax only, and the
linear casts y with the scale from that amax (one read of y saved, not two: the scale waits
for the whole tensor's amax, so no one-pass cast exists).

y is bit-equal to `rms_norm` / `layer_norm`'s: the same arithmetic, in the same tile (the
autotuner is handed the plain kernel's choice for the shape, tuning the plain kernel first
where it has none, because another tile sums a row in another order). The backward is the
plain norm's, from the same saved statistics. Eager only: inside torch.compile the norm and the
cast are torch ops Inductor fuses itself. Spec: `meshtrain.kernels.reference.rms_norm_fp8` and
`layer_norm_fp8`.
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

from meshtrain.kernels import layer_norm as _ln
from meshtrain.kernels import reference
from meshtrain.kernels import rms_norm as _rms
from meshtrain.kernels._launch import (
    _row_tile,
    as_rows,
    autotuning,
    needs_int64,
    prune_row_configs,
    row_block,
    row_bucket,
    row_configs,
    wrap_triton,
)
from meshtrain.kernels.fp8_cast import (
    bf16_rounded,
    check_fp8_target,
    fp8_bytes,
    fp8_constants,
    saturated_fp8,
)

_prune_plain = prune_row_configs(backward=False)


def _plain_tile(rms: bool, named_args: dict) -> triton.Config | None:
    """The tile the plain norm's autotuner chose for this row width, row bucket and x/w dtypes
    (its cache key: the key args, then the dtypes of its tensor args, x and w first)."""
    plain = _rms._rms_norm_fwd if rms else _ln._layer_norm_fwd
    want = (
        named_args["n_cols"],
        named_args["row_bucket"],
        str(named_args["x_ptr"].dtype),
        str(named_args["w_ptr"].dtype),
    )
    for key, config in plain.cache.items():
        if tuple(key[:4]) == want:
            return config
    return None


def _prune(configs, named_args, **kwargs):
    """The plain norm's tile where it has tuned this shape (`_launch`'s heuristic without
    autotuning, which is the plain kernel's choice too)."""
    if autotuning():
        tile = _plain_tile(kwargs["RMS"], named_args)
        if tile is not None:
            return [tile]
    return _prune_plain(configs, named_args, **kwargs)


@triton.autotune(
    configs=row_configs(backward=False),
    key=["n_cols", "row_bucket"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _norm_fp8_fwd(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    q_ptr,
    scale_ptr,
    amax_ptr,
    x_stride,
    n_rows,
    n_cols,
    row_bucket,
    eps,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    BYTES: tl.constexpr,
    E5M2: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    INT64: tl.constexpr,
    ROWS: tl.constexpr,
):
    """ROWS whole rows: y (contiguous), the row statistics, q (contiguous) where QUANT, amax."""
    cols = tl.arange(0, BLOCK)
    cols_ok = cols < n_cols
    rows, mask = _row_tile(tl.program_id(0) * ROWS, n_rows, cols_ok, ROWS, EVEN_COLS, INT64)
    row_ok = rows < n_rows
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    # the arithmetic of kernels/rms_norm.py and kernels/layer_norm.py, operation for operation
    if RMS:
        if EVEN_COLS:
            w = tl.load(w_ptr + cols).to(tl.float32)
        else:
            w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + tl.cast(eps, tl.float32))
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        y = x * rstd[:, None] * w[None, :]
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = x - mean[:, None]
        if not EVEN_COLS:
            xc = tl.where(cols_ok[None, :], xc, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + tl.cast(eps, tl.float32))
        y = (
            xc
            * rstd[:, None]
            * tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
        )
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(mean_ptr + rows, mean, mask=row_ok)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    out = y.to(y_ptr.dtype.element_ty)
    offsets = rows[:, None] * n_cols + cols[None, :]
    tl.store(y_ptr + offsets, out, mask=mask)
    # y as the FP8 linear reads it: in bf16, whatever y's dtype
    yb = bf16_rounded(out.to(tl.float32), BYTES)
    if QUANT:
        q = saturated_fp8(yb * tl.load(scale_ptr), FP8_MAX, MANT, BIAS, BYTES, E5M2)
        tl.store(q_ptr + offsets, q, mask=mask)
    # |y| as int32 bits (see kernels/fp8_cast.py); lanes off the tensor (a bias there) count 0
    bits = tl.where(mask, tl.abs(yb).to(tl.int32, bitcast=True), 0)
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(tl.max(bits, axis=1), axis=0))


def _forward(x, weight, bias, eps, scale, dtype, rms: bool):
    """(y shaped like x, q shaped like x or an empty tensor, amax 0-d fp32, mean or None, rstd)."""
    x2 = as_rows(x)
    rows, n = x2.shape
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (n,):  # the kernel reads `n` values by index
            raise ValueError(
                f"norm_fp8: {name} of shape {tuple(t.shape)} for x of shape {tuple(x.shape)}; "
                f"it must be ({n},)"
            )
    check_fp8_target("norm_fp8", dtype, scale, x)
    quant = scale is not None
    weight = weight.contiguous()
    device = x.device
    y = torch.empty((rows, n), dtype=x.dtype, device=device)
    q = torch.empty((rows, n) if quant else (0,), dtype=dtype, device=device)
    rstd = torch.empty(rows, dtype=torch.float32, device=device)
    mean = None if rms else torch.empty_like(rstd)
    amax = torch.zeros((), dtype=torch.float32, device=device)
    if rows == 0:
        return y.view(x.shape), q.view(x.shape) if quant else q, amax, mean, rstd
    if autotuning():  # hand the plain kernel's tile to this one (`_prune`): tune it first
        probe = dict(n_cols=n, row_bucket=row_bucket(rows), x_ptr=x2, w_ptr=weight)
        if _plain_tile(rms, probe) is None:
            if rms:
                _rms._forward(x2, weight, eps)
            else:
                _ln._forward(x2, weight, bias, eps)
    block = row_block(n)
    scale_arg = scale.reshape(()).float() if quant else amax
    wrap_triton(_norm_fp8_fwd)[lambda meta: (triton.cdiv(rows, meta["ROWS"]),)](
        x2,
        weight,
        weight if bias is None else bias.contiguous(),
        y,
        rstd if mean is None else mean,
        rstd,
        fp8_bytes(q) if quant else y,
        scale_arg,
        amax,
        x2.stride(0),
        rows,
        n,
        row_bucket(rows),
        eps,
        RMS=rms,
        HAS_BIAS=bias is not None,
        QUANT=quant,
        **fp8_constants(dtype),
        BLOCK=block,
        EVEN_COLS=block == n,
        INT64=needs_int64(x2, y),
    )
    return y.view(x.shape), q.view(x.shape) if quant else q, amax, mean, rstd


class _RMSNormFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, scale, dtype):
        y, q, amax, _, rstd = _forward(x, weight, None, eps, scale, dtype, rms=True)
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(q, amax)
        return y, q, amax

    @staticmethod
    def backward(ctx, dy, _dq, _damax):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _rms._backward(dy, x, weight, rstd)
        return dx, dw, None, None, None


class _LayerNormFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, scale, dtype):
        y, q, amax, mean, rstd = _forward(x, weight, bias, eps, scale, dtype, rms=False)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(q, amax)
        return y, q, amax

    @staticmethod
    def backward(ctx, dy, _dq, _damax):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _ln._backward(dy, x, weight, mean, rstd, ctx.bias_dtype)
        return dx, dw, db, None, None, None


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`rms_norm(x, weight, eps)` with the FP8 copy of its output and its amax, in one pass.

    Args:
        x: (..., hidden); weight: (hidden,); eps: as `rms_norm`.
        scale: one fp32 value on x's device to cast with (delayed scaling), or None to take
            the amax alone (current scaling: the caller casts once the scale is known).
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.

    Returns:
        (y like x, differentiable; q = saturate(bf16(y) · scale) in `dtype` shaped like x, or
        None without a scale; amax(|bf16(y)|) as a 0-d fp32 tensor).
    """
    if torch.compiler.is_compiling():  # traced as torch ops (see the module doc)
        return reference.rms_norm_fp8(x, weight, eps, scale, dtype)
    y, q, amax = _RMSNormFp8.apply(x, weight, eps, scale, dtype)
    return y, q if scale is not None else None, amax


def layer_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`layer_norm(x, weight, bias, eps)` with the FP8 copy of its output and its amax, in one
    pass; the arguments and results as `rms_norm_fp8`'s."""
    if torch.compiler.is_compiling():
        return reference.layer_norm_fp8(x, weight, bias, eps, scale, dtype)
    y, q, amax = _LayerNormFp8.apply(x, weight, bias, eps, scale, dtype)
    return y, q if scale is not None else None, amax
