"""GELU (tanh approximation, GPT-2's) in Triton, elementwise.

gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). Since 0.5 (1 + tanh(u)) is
sigmoid(2u), the kernels use sigmoid: one exp, no separate tanh, and it saturates cleanly at
both ends. Forward saves only x; backward recomputes sigmoid(2u) rather than storing it,
since recomputing is cheaper than another full-size tensor read. Math in fp32, results in
x's dtype. Eager autograd goes through `_GELU`, torch.compile through the custom op
`meshtrain::gelu` (one opaque node, fake implementation for shapes). Spec:
`meshtrain.kernels.reference.gelu`.
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

from meshtrain.kernels._launch import kernel_op, wrap_triton

BLOCK = 1024


@triton.jit
def _gelu_fwd(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # literals, not module constants: a jitted kernel (and the interpreter) only sees constexpr
    # globals; 0.79788... = sqrt(2 / pi), 0.044715 = the tanh approximation's cubic coefficient
    s = tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
    tl.store(y_ptr + offs, (x * s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd(dy_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
    du_dx = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    dx = dy * (s + x * s * (1.0 - s) * 2.0 * du_dx)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _forward(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    wrap_triton(_gelu_fwd)[(triton.cdiv(n, BLOCK),)](x, y, n, BLOCK=BLOCK, num_warps=4)
    return y


def _backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x, dy = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(x)
    n = x.numel()
    wrap_triton(_gelu_bwd)[(triton.cdiv(n, BLOCK),)](dy, x, dx, n, BLOCK=BLOCK, num_warps=4)
    return dx


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        ctx.save_for_backward(x)
        return _forward(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _backward(dy, x)


# ---- the same launchers as custom ops, for torch.compile ----


@kernel_op("meshtrain::gelu")
def _gelu_op(x: torch.Tensor) -> torch.Tensor:
    return _forward(x)


@kernel_op("meshtrain::gelu_backward")
def _gelu_backward_op(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _backward(dy, x)


@_gelu_op.register_fake
def _(x):
    return x.new_empty(x.shape)


@_gelu_backward_op.register_fake
def _(dy, x):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _op_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _gelu_backward_op(dy, x)


_gelu_op.register_autograd(_op_backward, setup_context=_setup)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (GPT-2's).

    Args:
        x: any shape, any float dtype.

    Returns:
        gelu(x), same shape and dtype.
    """
    if torch.compiler.is_compiling():
        return _gelu_op(x)
    return _GELU.apply(x)
