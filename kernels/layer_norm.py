"""LayerNorm in Triton: (x - mean) / sqrt(var + eps) * weight + bias over the last dim.

Same plan as `kernels/rms_norm.py`: forward normalizes tiles of a few whole rows in registers
and saves mean and rstd (fp32, one each per row); backward has a few programs per SM walk
contiguous runs of row tiles, writing dx and accumulating private fp32 partials of the weight
and bias gradients, summed afterwards instead of contended atomics. The bias is optional
(`HAS_BIAS` compiles it out). Spec: `kernels.reference.layer_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import (
    as_rows,
    reduction_programs,
    row_block,
    row_warps,
    rows_per_tile,
)


@triton.jit
def _layer_norm_fwd(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, x_stride, y_stride, n_rows, n_cols, eps,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    cols_ok = cols < n_cols
    row_ok = rows < n_rows
    mask = row_ok[:, None] & cols_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    # two-pass variance (centre first): E[x^2] - mean^2 cancels badly when |mean| >> std
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    y = xc * rstd[:, None] * tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr,
    dy_stride, x_stride, dx_stride, n_rows, n_cols, tiles_per_program,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cols_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    # fixed trip count with a row mask, as in rms_norm's backward (the interpreter needs it)
    for i in range(tiles_per_program):
        rows = (pid.to(tl.int64) * tiles_per_program + i) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & cols_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        # the two subtracted terms are the gradient through the variance and through the mean
        c1 = (tl.sum(x_hat * wdy, axis=1) / n_cols)[:, None]
        c2 = (tl.sum(wdy, axis=1) / n_cols)[:, None]
        dx = (wdy - x_hat * c1 - c2) * rstd
        tl.store(dx_ptr + rows[:, None] * dx_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=cols_ok)
    if HAS_BIAS:
        tl.store(db_partial_ptr + pid * n_cols + cols, db, mask=cols_ok)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2 = as_rows(x)
        rows, n = x2.shape
        weight = weight.contiguous()
        has_bias = bias is not None
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        block = row_block(n)
        tile = rows_per_tile(block)
        _layer_norm_fwd[(triton.cdiv(rows, tile),)](
            x2, weight, bias.contiguous() if has_bias else weight, y, mean, rstd, x2.stride(0), y.stride(0),
            rows, n, eps, HAS_BIAS=has_bias, ROWS=tile, BLOCK=block, num_warps=row_warps(tile * block),
        )
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias = has_bias
        ctx.bias_dtype = bias.dtype if has_bias else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dy2 = as_rows(dy)
        rows, n = x2.shape
        dx = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
        block = row_block(n)
        tile = rows_per_tile(block, 2048)
        tiles = triton.cdiv(rows, tile)
        per_program = triton.cdiv(tiles, reduction_programs(tiles, x2.device))
        programs = triton.cdiv(tiles, per_program)
        dw_partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        db_partial = torch.empty_like(dw_partial) if ctx.has_bias else dw_partial
        _layer_norm_bwd[(programs,)](
            dy2, x2, weight, mean, rstd, dx, dw_partial, db_partial, dy2.stride(0), x2.stride(0), dx.stride(0),
            rows, n, per_program, HAS_BIAS=ctx.has_bias, ROWS=tile, BLOCK=block, num_warps=row_warps(tile * block),
        )
        dw = dw_partial.sum(0).to(weight.dtype)
        db = db_partial.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(dy.shape), dw, db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with affine weight and optional bias, statistics in fp32.

    Args:
        x: (..., hidden); the output has x's dtype.
        weight: (hidden,).
        bias: (hidden,) or None.
        eps: added to the variance before the square root.

    Returns:
        (..., hidden) normalized x.
    """
    return _LayerNorm.apply(x, weight, bias, eps)
