"""SwiGLU in Triton on a fused [gate | up] last dim: silu(gate) * up, halving the width.

The MLP's first linear produces gate and up side by side in one matmul; the kernel reads
both halves of a row and writes the half-width product, so the split never materializes.
Backward recomputes sigmoid(gate) from the saved input (cheaper than storing it) and writes
the gradients of both halves into one fused (..., 2F) tensor, the shape the linear's
backward expects. Math in fp32, results in the input's dtype. Eager autograd goes through
`_SwiGLU`, torch.compile through the custom op `meshtrain::swiglu` (one opaque node, fake
implementation for shapes). Spec: `meshtrain.kernels.reference.swiglu`.
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

from meshtrain.kernels._launch import as_rows, kernel_op, wrap_triton


@triton.jit
def _row_and_cols(width, BLOCK: tl.constexpr):
    """This program's row and column block: a 1-D grid, column blocks of one row adjacent.

    Neighbouring programs then read neighbouring addresses, one row after another. With the
    row as the fastest grid index they read the same columns of neighbouring rows (strided
    by the row), which was slower (measured: BENCHMARKS.md, 'Kernel design choices').
    """
    blocks = tl.cdiv(width, BLOCK)
    pid = tl.program_id(0).to(tl.int64)
    return pid // blocks, (pid % blocks) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _swiglu_fwd(gu_ptr, y_ptr, gu_stride, y_stride, width, BLOCK: tl.constexpr):
    row, cols = _row_and_cols(width, BLOCK)
    mask = cols < width
    gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    dy_ptr, gu_ptr, dgu_ptr, dy_stride, gu_stride, dgu_stride, width, BLOCK: tl.constexpr
):
    row, cols = _row_and_cols(width, BLOCK)
    mask = cols < width
    gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    silu = gate * s
    # silu'(g) = s + g s (1 - s)
    dgate = dy * up * s * (1.0 + gate * (1.0 - s))
    tl.store(dgu_ptr + row * dgu_stride + cols, dgate.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(
        dgu_ptr + row * dgu_stride + width + cols,
        (dy * silu).to(dgu_ptr.dtype.element_ty),
        mask=mask,
    )


def _block(width: int) -> int:
    # a 1024-wide tile per program: wide enough for coalesced 16-byte loads, small enough
    # that an 11k-wide FFN row still spreads over many programs
    return min(1024, triton.next_power_of_2(width))


def _forward(gate_up: torch.Tensor) -> torch.Tensor:
    gu = as_rows(gate_up)
    rows, width = gu.shape[0], gu.shape[1] // 2
    y = torch.empty((rows, width), dtype=gu.dtype, device=gu.device)
    block = _block(width)
    wrap_triton(_swiglu_fwd)[(rows * triton.cdiv(width, block),)](
        gu, y, gu.stride(0), y.stride(0), width, BLOCK=block, num_warps=4
    )
    return y.view(*gate_up.shape[:-1], width)


def _backward(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    dy2, gu = as_rows(dy), as_rows(gate_up)
    rows, width = gu.shape[0], gu.shape[1] // 2
    dgu = torch.empty((rows, 2 * width), dtype=gu.dtype, device=gu.device)
    block = _block(width)
    wrap_triton(_swiglu_bwd)[(rows * triton.cdiv(width, block),)](
        dy2, gu, dgu, dy2.stride(0), gu.stride(0), dgu.stride(0), width, BLOCK=block, num_warps=4
    )
    return dgu.view(gate_up.shape)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _forward(gate_up)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        return _backward(dy, gate_up)


# ---- the same launchers as custom ops, for torch.compile ----


@kernel_op("meshtrain::swiglu")
def _swiglu_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _forward(gate_up)


@kernel_op("meshtrain::swiglu_backward")
def _swiglu_backward_op(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return _backward(dy, gate_up)


@_swiglu_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@_swiglu_backward_op.register_fake
def _(dy, gate_up):
    return gate_up.new_empty(gate_up.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _op_backward(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_backward_op(dy, gate_up)


_swiglu_op.register_autograd(_op_backward, setup_context=_setup)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] last dim: silu(gate) * up, halving the width.

    Args:
        gate_up: (..., 2 * ffn), gate in the first half, up in the second.

    Returns:
        (..., ffn) in gate_up's dtype.
    """
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim, got {gate_up.shape[-1]}")
    if torch.compiler.is_compiling():
        return _swiglu_op(gate_up)
    return _SwiGLU.apply(gate_up)
