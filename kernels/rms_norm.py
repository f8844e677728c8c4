"""RMSNorm in Triton: y = x / sqrt(mean(x^2) + eps) * weight over the last dim.

Forward: each program normalizes a tile of a few whole rows held in registers (several rows
when the hidden size is small, so each program moves enough bytes), computes rstd in fp32
and saves it (one float per row) so backward need not redo the reduction. Backward: a few
programs per SM each walk a contiguous run of row tiles, write dx and accumulate
dy * x_hat into a private fp32 partial of the weight gradient; the partials
(programs x hidden) are summed afterwards. That avoids atomics on one shared row, which
serialize and make the result order-dependent. Spec: `kernels.reference.rms_norm`.
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
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, x_stride, y_stride, n_rows, n_cols, eps,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (ROWS,)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    dy_stride, x_stride, dx_stride, n_rows, n_cols, tiles_per_program, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cols_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    # a fixed trip count with a row mask (the last program's run may be short); a loop bound
    # computed in the kernel would also do on the GPU, but not under the CPU interpreter
    for i in range(tiles_per_program):
        rows = (pid.to(tl.int64) * tiles_per_program + i) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & cols_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        x_hat = x * rstd
        wdy = w[None, :] * dy
        # d/dx of x*rstd: the rstd term plus the term through mean(x^2)
        dx = rstd * (wdy - x_hat * (tl.sum(x_hat * wdy, axis=1) / n_cols)[:, None])
        tl.store(dx_ptr + rows[:, None] * dx_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=cols_ok)


def _forward(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x2.shape
    y = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device)
    block = row_block(n)
    tile = rows_per_tile(block)
    _rms_norm_fwd[(triton.cdiv(rows, tile),)](x2, weight, y, rstd, x2.stride(0), y.stride(0), rows, n, eps,
                                              ROWS=tile, BLOCK=block, num_warps=row_warps(tile * block))
    return y, rstd


def _backward(dy2, x2, weight, rstd) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x2.shape
    dx = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
    block = row_block(n)
    tile = rows_per_tile(block, 2048)
    tiles = triton.cdiv(rows, tile)
    per_program = triton.cdiv(tiles, reduction_programs(tiles, x2.device))
    programs = triton.cdiv(tiles, per_program)  # no program left without rows
    partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
    _rms_norm_bwd[(programs,)](dy2, x2, weight, rstd, dx, partial, dy2.stride(0), x2.stride(0), dx.stride(0),
                               rows, n, per_program, ROWS=tile, BLOCK=block, num_warps=row_warps(tile * block))
    return dx, partial.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = as_rows(x)
        y, rstd = _forward(x2, weight.contiguous(), eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(as_rows(dy), x2, weight.contiguous(), rstd)
        return dx.view(dy.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, statistics in fp32.

    Args:
        x: (..., hidden), any float dtype; the output has x's dtype.
        weight: (hidden,), any float dtype; its gradient comes back in that dtype.
        eps: added to the mean square before the square root.

    Returns:
        (..., hidden) normalized x.
    """
    return _RMSNorm.apply(x, weight, eps)
