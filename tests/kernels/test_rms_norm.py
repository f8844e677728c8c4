"""Triton RMSNorm against `meshtrain.kernels.reference.rms_norm`: output, dx and dweight."""

import pytest
import torch

from meshtrain.kernels import reference
from tests.kernels.conftest import DEVICE, TOL, needs_triton

pytestmark = needs_triton


def _check(shape, dtype, weight_dtype=None):
    from meshtrain.kernels.rms_norm import rms_norm

    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    w = (
        1 + 0.1 * torch.randn(shape[-1], device=DEVICE, dtype=weight_dtype or dtype)
    ).requires_grad_()
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)
    y = rms_norm(x, w, 1e-6)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    # the reference in fp64 is the ground truth; both implementations are compared to it
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = reference.rms_norm(x64, w64, 1e-6)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    tol = TOL[dtype]
    assert y.dtype == dtype and dw.dtype == w.dtype
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(dx.double(), dx64, **tol)
    # dweight sums over every row: its error grows with the row count, relative to its size
    torch.testing.assert_close(dw.double(), dw64, rtol=tol["rtol"] * 4, atol=tol["atol"] * shape[0])


@pytest.mark.parametrize("shape", [(5, 123), (3, 7, 200)])
def test_rms_norm_fp32(shape):
    """fp32: same math, reduction order differs -> 1e-5."""
    _check(shape, torch.float32)


def test_rms_norm_several_tiles_per_backward_program():
    """70 rows over 4 backward programs of 18 rows, each walking several tiles (the last
    program's run short, the hidden size 300 not a power of two): exercises the run masking."""
    _check((70, 300), torch.float32)


def test_rms_norm_bf16_with_fp32_weight():
    """bf16 activations with an fp32 weight (master weights under autocast): bf16 ulps."""
    _check((5, 13, 123), torch.bfloat16, weight_dtype=torch.float32)


def test_rms_norm_non_contiguous_input():
    from meshtrain.kernels.rms_norm import rms_norm

    x = torch.randn(6, 40, device=DEVICE)[:, ::2]  # (6, 20), stride 2 along hidden
    w = torch.randn(20, device=DEVICE)
    torch.testing.assert_close(
        rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **TOL[torch.float32]
    )


def test_rms_norm_empty_batch():
    """No rows (an empty micro-batch): an empty output, no dx and a zero weight gradient, as the
    reference gives (the backward's program count was a division by zero)."""
    from meshtrain.kernels.rms_norm import rms_norm

    x = torch.randn(0, 24, device=DEVICE, requires_grad=True)
    w = torch.randn(24, device=DEVICE, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert y.shape == (0, 24) and dx.shape == (0, 24)
    torch.testing.assert_close(dw, torch.zeros_like(w))


@pytest.mark.parametrize("width", [20, 30, 1])
def test_rms_norm_refuses_a_weight_of_another_width(width):
    """A (20,), (30,) or (1,) weight for hidden 24: the kernel read 24 weights by index (past
    a shorter weight's end) and returned numbers where the reference raises."""
    from meshtrain.kernels.rms_norm import rms_norm

    with pytest.raises(
        ValueError,
        match=rf"weight of shape \({width},\) for x of shape \(3, 24\); it must be \(24,\)",
    ):
        rms_norm(torch.randn(3, 24, device=DEVICE), torch.randn(width, device=DEVICE), 1e-6)
