"""RMSNorm in Triton: y = x / sqrt(mean(x^2) + eps) * weight over the last dim.

Forward: each program normalizes a tile of a few whole rows held in registers, computes rstd
in fp32 and saves it (one float per row) so backward need not redo the reduction. Backward: a
few programs per SM each walk every programs-th row (so the programs in flight read
neighbouring rows), tile by tile, loading each tile while the one before it reduces, write dx
and accumulate dy * x_hat into a private fp32 partial of the weight gradient; the partials
(programs x hidden) are summed afterwards, in one launch with the cast to the weight's dtype
(`kernels/_column_sums.py`). That avoids atomics on one shared row, which serialize and make
the result order-dependent. Both kernels are autotuned over rows per tile and warps, keyed on
the hidden size and the row count's power-of-two bucket (`kernels/_launch.py`); both only
write fresh outputs, so autotune's repeated launches are harmless. Offsets are int32 unless a
tensor passes 2^31 elements (`INT64`), and the column mask is compiled out when the hidden size
is a power of two (`EVEN_COLS`).

Two entry points share the launchers: eager autograd goes through `_RMSNorm` (the fewest
Python layers per call), torch.compile through the custom op `meshtrain::rms_norm`, which
Dynamo records as one opaque node (no graph break) with a fake implementation for shapes.
Spec: `meshtrain.kernels.reference.rms_norm`.
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
    _row_tile_interleaved,
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

BACKWARD_PROGRAMS_PER_SM = 2
"""Programs per SM of the backward kernel. In a sweep of interleaved backward loops, two were
the best at hidden 2048-4096 (measured: BENCHMARKS.md, 'Kernel design choices'); LayerNorm keeps
contiguous runs at `_launch.REDUCTION_PROGRAMS_PER_SM`."""


@triton.autotune(
    configs=row_configs(backward=False),
    key=["n_cols", "row_bucket"],
    prune_configs_by={"early_config_prune": prune_row_configs(backward=False)},
)
@triton.jit
def _rms_norm_fwd(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    x_stride,
    y_stride,
    n_rows,
    n_cols,
    row_bucket,
    eps,
    BLOCK: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    INT64: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    if INT64:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    if EVEN_COLS:
        mask = row_ok[:, None]
        w = tl.load(w_ptr + cols).to(tl.float32)
    else:
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    # eps in fp32 (Inductor passes it as fp64: kernels/layer_norm.py)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + tl.cast(eps, tl.float32))  # (ROWS,)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    y = x * rstd[:, None] * w[None, :]
    tl.store(
        y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask
    )


@triton.autotune(
    configs=row_configs(backward=True),
    key=["n_cols", "row_bucket"],
    prune_configs_by={"early_config_prune": prune_row_configs(backward=True)},
)
@triton.jit
def _rms_norm_bwd(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    dy_stride,
    x_stride,
    dx_stride,
    n_rows,
    n_cols,
    row_bucket,
    rows_per_program,
    BLOCK: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    INT64: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cols_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    # a trip count from the host (rows per program), rows past the end masked: a bound
    # computed in the kernel would also do on the GPU, but not under the CPU interpreter.
    # Program p takes rows p, p + P, p + 2P, ... (`_row_tile_interleaved`). Each tile's loads
    # are issued a tile ahead, so they are in flight while the previous tile reduces (the last
    # loop's loads are all masked off: no traffic). Both brought the kernel closer to copy
    # bandwidth (measured: BENCHMARKS.md, 'Kernel design choices').
    rows, mask = _row_tile_interleaved(0, n_rows, cols_ok, ROWS, EVEN_COLS, INT64)
    x_next = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=mask, other=0.0)
    rstd_next = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
    for start in range(0, rows_per_program, ROWS):
        x, dy, rstd = x_next.to(tl.float32), dy_next.to(tl.float32), rstd_next[:, None]
        rows_after, mask_after = _row_tile_interleaved(
            start + ROWS, n_rows, cols_ok, ROWS, EVEN_COLS, INT64
        )
        x_next = tl.load(
            x_ptr + rows_after[:, None] * x_stride + cols[None, :], mask=mask_after, other=0.0
        )
        dy_next = tl.load(
            dy_ptr + rows_after[:, None] * dy_stride + cols[None, :], mask=mask_after, other=0.0
        )
        rstd_next = tl.load(rstd_ptr + rows_after, mask=rows_after < n_rows, other=0.0)
        x_hat = x * rstd
        wdy = w[None, :] * dy
        # d/dx of x*rstd: the rstd term plus the term through mean(x^2)
        dx = rstd * (wdy - x_hat * (tl.sum(x_hat * wdy, axis=1) / n_cols)[:, None])
        tl.store(
            dx_ptr + rows[:, None] * dx_stride + cols[None, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=mask,
        )
        dw += tl.sum(dy * x_hat, axis=0)
        rows, mask = rows_after, mask_after
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=cols_ok)


def _forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y shaped like x, contiguous; rstd (rows,) fp32)."""
    x2 = as_rows(x)
    rows, n = x2.shape
    if weight.shape != (n,):  # the kernel reads `n` weights by index, past a shorter one's end
        raise ValueError(
            f"rms_norm: weight of shape {tuple(weight.shape)} for x of shape {tuple(x.shape)}; "
            f"it must be ({n},)"
        )
    y = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device)
    block = row_block(n)
    wrap_triton(_rms_norm_fwd)[lambda meta: (triton.cdiv(rows, meta["ROWS"]),)](
        x2,
        weight.contiguous(),
        y,
        rstd,
        x2.stride(0),
        y.stride(0),
        rows,
        n,
        row_bucket(rows),
        eps,
        BLOCK=block,
        EVEN_COLS=block == n,
        INT64=needs_int64(x2, y),
    )
    return y.view(x.shape), rstd


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """(dx shaped like x, dweight in weight's dtype)."""
    dy2, x2 = as_rows(dy), as_rows(x)
    rows, n = x2.shape
    dx = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
    block = row_block(n)
    programs, per_program = reduction_programs(rows, x2.device, BACKWARD_PROGRAMS_PER_SM)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
    wrap_triton(_rms_norm_bwd)[(programs,)](
        dy2,
        x2,
        weight.contiguous(),
        rstd,
        dx,
        partial,
        dy2.stride(0),
        x2.stride(0),
        dx.stride(0),
        rows,
        n,
        row_bucket(rows),
        per_program,
        BLOCK=block,
        EVEN_COLS=block == n,
        INT64=needs_int64(dy2, x2, dx),
    )
    return dx.view(x.shape), column_sums(partial, weight.dtype)[0]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x, weight, rstd)
        return dx, dw, None


# ---- the same launchers as custom ops, for torch.compile ----


@kernel_op("meshtrain::rms_norm")
def _rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@kernel_op("meshtrain::rms_norm_backward")
def _rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, x, weight, rstd)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dw, None


_rms_norm_op.register_autograd(_op_backward, setup_context=_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, statistics in fp32.

    Args:
        x: (..., hidden), any float dtype; the output has x's dtype.
        weight: (hidden,), any float dtype; its gradient comes back in that dtype.
        eps: added to the mean square before the square root.

    Returns:
        (..., hidden) normalized x.
    """
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps)
