"""Triton GELU (tanh) and SwiGLU against `meshtrain.kernels.reference`, forward and backward."""

import pytest
import torch

from meshtrain.kernels import reference
from tests.kernels.conftest import DEVICE, TOL, needs_triton

pytestmark = needs_triton


def _compare(fast, ref, x, dtype):
    """fast vs fp64 reference: outputs and input gradients."""
    torch.manual_seed(1)
    x = x.to(dtype).requires_grad_()
    y = fast(x)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = ref(x64)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert y.dtype == dtype and y.shape == y64.shape and dx.dtype == dtype
    torch.testing.assert_close(y.double(), y64, **TOL[dtype])
    torch.testing.assert_close(dx.double(), dx64, **TOL[dtype])


# sigmoid(2u) of a very negative x overflows exp() to inf under numpy (the interpreter) and
# correctly gives 0; the GPU has no such warning
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu(dtype):
    """fp32: sigmoid(2u) vs tanh(u) agree to ~1e-7 -> 1e-5; bf16: rounding of in/out -> 2e-2.
    The odd size (5, 123, 13) leaves a partial last block; the tails (|x| up to ~12) check
    saturation."""
    from meshtrain.kernels.gelu import gelu

    torch.manual_seed(0)
    x = torch.randn(5, 123, 13, device=DEVICE) * 3
    _compare(gelu, reference.gelu, x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(dtype):
    """(5, 7, 2*123): an odd half-width and rows not a multiple of anything;
    tolerances as GELU's."""
    from meshtrain.kernels.swiglu import swiglu

    torch.manual_seed(0)
    x = torch.randn(5, 7, 246, device=DEVICE) * 2
    _compare(swiglu, reference.swiglu, x, dtype)


def test_swiglu_wide_rows_span_several_blocks():
    """A half-width past one 1024-wide block (1500) exercises the column grid."""
    from meshtrain.kernels.swiglu import swiglu

    x = torch.randn(3, 3000, device=DEVICE)
    _compare(swiglu, reference.swiglu, x, torch.float32)
