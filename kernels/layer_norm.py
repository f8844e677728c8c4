"""LayerNorm in Triton: (x - mean) / sqrt(var + eps) * weight + bias over the last dim.

Same plan as `kernels/rms_norm.py`: forward normalizes tiles of a few whole rows in registers
and saves mean and rstd (fp32, one each per row); backward has a few programs per SM walk
contiguous runs of rows (each tile's loads issued a tile ahead), writing dx and accumulating
private fp32 partials of the weight and bias gradients, summed afterwards (both in one
launch, `kernels/_column_sums.py`) instead of contended atomics. The bias is optional
(`HAS_BIAS` compiles it out). Both kernels are autotuned (rows per tile and warps; key: hidden
size and row-count bucket), use int32 offsets unless a tensor passes 2^31 elements, and drop
the column mask when the hidden size is a power of two. Eager autograd goes through
`_LayerNorm`, torch.compile through the custom op `meshtrain::layer_norm` (one opaque node,
fake implementation for shapes). Spec: `meshtrain.kernels.reference.layer_norm`.
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import math

import torch
import triton
import triton.language as tl

from meshtrain.kernels._column_sums import column_sums
from meshtrain.kernels._launch import (
    _row_tile,
    as_rows,
    kernel_op,
    needs_int64,
    prune_row_configs,
    reduction_programs,
    row_block,
    row_bucket,
    row_configs,
    wrap_triton,
)


@triton.autotune(
    configs=row_configs(backward=False),
    key=["n_cols", "row_bucket"],
    prune_configs_by={"early_config_prune": prune_row_configs(backward=False)},
)
@triton.jit
def _layer_norm_fwd(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    x_stride,
    y_stride,
    n_rows,
    n_cols,
    row_bucket,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    INT64: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    if INT64:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cols_ok = cols < n_cols
    row_ok = rows < n_rows
    if EVEN_COLS:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & cols_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    mean = tl.sum(x, axis=1) / n_cols
    # two-pass variance (centre first): E[x^2] - mean^2 cancels badly when |mean| >> std
    xc = x - mean[:, None]
    if not EVEN_COLS:
        xc = tl.where(cols_ok[None, :], xc, 0.0)  # padding lanes would add mean^2 each
    # eps in fp32: Inductor passes a Python float to a kernel it launches as fp64, which made
    # rstd and every y of the tile fp64: a slower forward inside a compiled graph (measured:
    # BENCHMARKS.md, 'Kernel design choices')
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + tl.cast(eps, tl.float32))
    y = xc * rstd[:, None] * tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    tl.store(
        y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask
    )


@triton.autotune(
    configs=row_configs(backward=True),
    key=["n_cols", "row_bucket"],
    prune_configs_by={"early_config_prune": prune_row_configs(backward=True)},
)
@triton.jit
def _layer_norm_bwd(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    dy_stride,
    x_stride,
    dx_stride,
    n_rows,
    n_cols,
    row_bucket,
    rows_per_program,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    INT64: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cols_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    # a trip count from the host, masked at the run's end, as in rms_norm's backward; each
    # tile's loads are issued a tile ahead, before the previous tile's reductions
    rows, mask = _row_tile(first, end, cols_ok, ROWS, EVEN_COLS, INT64)
    x_next = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=mask, other=0.0)
    mean_next = tl.load(mean_ptr + rows, mask=rows < end, other=0.0)
    rstd_next = tl.load(rstd_ptr + rows, mask=rows < end, other=0.0)
    for start in range(0, rows_per_program, ROWS):
        x, dy = x_next.to(tl.float32), dy_next.to(tl.float32)
        mean, rstd = mean_next[:, None], rstd_next[:, None]
        rows_after, mask_after = _row_tile(
            first + start + ROWS, end, cols_ok, ROWS, EVEN_COLS, INT64
        )
        x_next = tl.load(
            x_ptr + rows_after[:, None] * x_stride + cols[None, :], mask=mask_after, other=0.0
        )
        dy_next = tl.load(
            dy_ptr + rows_after[:, None] * dy_stride + cols[None, :], mask=mask_after, other=0.0
        )
        mean_next = tl.load(mean_ptr + rows_after, mask=rows_after < end, other=0.0)
        rstd_next = tl.load(rstd_ptr + rows_after, mask=rows_after < end, other=0.0)
        # masked lanes: x = 0 gives -mean * rstd, kept out of the sums below (dy and w are 0
        # there, so only the sums of x_hat alone would see it; zeroing keeps dw exact)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        # the two subtracted terms are the gradient through the variance and through the mean
        c1 = (tl.sum(x_hat * wdy, axis=1) / n_cols)[:, None]
        c2 = (tl.sum(wdy, axis=1) / n_cols)[:, None]
        dx = (wdy - x_hat * c1 - c2) * rstd
        tl.store(
            dx_ptr + rows[:, None] * dx_stride + cols[None, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=mask,
        )
        dw += tl.sum(dy * x_hat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
        rows, mask = rows_after, mask_after
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=cols_ok)
    if HAS_BIAS:
        tl.store(db_partial_ptr + pid * n_cols + cols, db, mask=cols_ok)


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """(y shaped like x, contiguous; mean and rstd, each (rows,) fp32)."""
    x2 = as_rows(x)
    rows, n = x2.shape
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (n,):  # the kernel reads `n` values by index
            raise ValueError(
                f"layer_norm: {name} of shape {tuple(t.shape)} for x of shape {tuple(x.shape)}; "
                f"it must be ({n},)"
            )
    weight = weight.contiguous()
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block = row_block(n)
    wrap_triton(_layer_norm_fwd)[lambda meta: (triton.cdiv(rows, meta["ROWS"]),)](
        x2,
        weight,
        weight if bias is None else bias.contiguous(),
        y,
        mean,
        rstd,
        x2.stride(0),
        y.stride(0),
        rows,
        n,
        row_bucket(rows),
        eps,
        HAS_BIAS=bias is not None,
        BLOCK=block,
        EVEN_COLS=block == n,
        INT64=needs_int64(x2, y),
    )
    return y.view(x.shape), mean, rstd


def _backward(dy, x, weight, mean, rstd, bias_dtype: torch.dtype | None):
    """(dx shaped like x, dweight in weight's dtype, dbias in bias_dtype or None without a bias)."""
    dy2, x2 = as_rows(dy), as_rows(x)
    rows, n = x2.shape
    dx = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
    block = row_block(n)
    programs, per_program = reduction_programs(rows, x2.device)
    has_bias = bias_dtype is not None
    dw_partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
    db_partial = torch.empty_like(dw_partial) if has_bias else dw_partial
    wrap_triton(_layer_norm_bwd)[(programs,)](
        dy2,
        x2,
        weight.contiguous(),
        mean,
        rstd,
        dx,
        dw_partial,
        db_partial,
        dy2.stride(0),
        x2.stride(0),
        dx.stride(0),
        rows,
        n,
        row_bucket(rows),
        per_program,
        HAS_BIAS=has_bias,
        BLOCK=block,
        EVEN_COLS=block == n,
        INT64=needs_int64(dy2, x2, dx),
    )
    dw, db = column_sums(dw_partial, weight.dtype, db_partial if has_bias else None, bias_dtype)
    return dx.view(x.shape), dw, db


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(dy, x, weight, mean, rstd, ctx.bias_dtype)
        return dx, dw, db, None


# ---- the same launchers as custom ops, for torch.compile ----


@kernel_op("meshtrain::layer_norm")
def _layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, weight, bias, eps)


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    rows = math.prod(x.shape[:-1])
    return (
        x.new_empty(x.shape),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.float32),
    )


@kernel_op("meshtrain::layer_norm_backward")
def _layer_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _backward(dy, x, weight, mean, rstd, bias_dtype)
    return dx, dw, dw.new_empty(0) if db is None else db  # an op returns tensors: empty for no bias


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, mean, rstd, bias_dtype):
    db = (
        weight.new_empty(0)
        if bias_dtype is None
        else weight.new_empty(weight.shape, dtype=bias_dtype)
    )
    return x.new_empty(x.shape), torch.empty_like(weight), db


def _setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.bias_dtype = None if bias is None else bias.dtype


def _op_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_backward_op(dy, x, weight, mean, rstd, ctx.bias_dtype)
    return dx, dw, None if ctx.bias_dtype is None else db, None


_layer_norm_op.register_autograd(_op_backward, setup_context=_setup)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dim with affine weight and optional bias, statistics in fp32.

    Args:
        x: (..., hidden); the output has x's dtype.
        weight: (hidden,).
        bias: (hidden,) or None.
        eps: added to the variance before the square root.

    Returns:
        (..., hidden) normalized x.
    """
    if torch.compiler.is_compiling():
        return _layer_norm_op(x, weight, bias, eps)[0]
    return _LayerNorm.apply(x, weight, bias, eps)
