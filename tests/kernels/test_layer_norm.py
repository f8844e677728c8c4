"""Triton LayerNorm against `meshtrain.kernels.reference.layer_norm`: output, dx, dweight, dbias."""

import pytest
import torch

from meshtrain.kernels import reference
from tests.kernels.conftest import DEVICE, TOL, needs_triton

pytestmark = needs_triton


def _check(shape, dtype, bias=True, offset=0.0):
    from meshtrain.kernels.layer_norm import layer_norm

    torch.manual_seed(0)
    x = (torch.randn(shape, device=DEVICE) + offset).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(shape[-1], device=DEVICE)).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)
    params = (x, w) + ((b,) if bias else ())
    y = layer_norm(x, w, b, 1e-5)
    grads = torch.autograd.grad(y, params, dy)
    # ground truth: the reference in fp64
    params64 = tuple(p.detach().double().requires_grad_() for p in params)
    y64 = reference.layer_norm(params64[0], params64[1], params64[2] if bias else None, 1e-5)
    grads64 = torch.autograd.grad(y64, params64, dy.double())
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(grads[0].double(), grads64[0], **tol)
    # parameter grads sum over all rows: absolute error scales with the row count
    rows = x.numel() // shape[-1]
    for g, g64 in zip(grads[1:], grads64[1:]):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), g64, rtol=tol["rtol"] * 4, atol=tol["atol"] * rows)


@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 77)])
def test_layer_norm_fp32(shape):
    """fp32: same math, reduction order differs -> 1e-5."""
    _check(shape, torch.float32)


def test_layer_norm_several_tiles_per_backward_program():
    """70 rows over 4 backward programs of 18 rows (several tiles each, the last run short),
    and a power-of-two hidden size, which compiles the column mask out (`EVEN_COLS`)."""
    _check((70, 300), torch.float32)
    _check((70, 256), torch.float32, bias=False)


def test_layer_norm_fp32_without_bias_and_large_mean():
    """A mean far from zero checks the centred (two-pass) variance; 1e-4 since x_hat loses
    log2(50) bits to the offset even in fp64 rounding of the fp32 input."""
    from meshtrain.kernels.layer_norm import layer_norm

    torch.manual_seed(0)
    x = torch.randn(4, 50, device=DEVICE) + 50.0
    w = torch.randn(50, device=DEVICE)
    torch.testing.assert_close(
        layer_norm(x, w, None, 1e-5).double(),
        reference.layer_norm(x.double(), w.double(), None, 1e-5),
        rtol=1e-4,
        atol=1e-4,
    )


def test_layer_norm_bf16():
    """bf16 in and out, fp32 statistics: one or two bf16 ulps."""
    _check((5, 11, 123), torch.bfloat16)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_empty_batch(bias):
    """No rows: an empty output and zero weight and bias gradients, as the reference gives (the
    backward's program count was a division by zero)."""
    from meshtrain.kernels.layer_norm import layer_norm

    x = torch.randn(0, 24, device=DEVICE, requires_grad=True)
    w = torch.randn(24, device=DEVICE, requires_grad=True)
    b = torch.randn(24, device=DEVICE, requires_grad=True) if bias else None
    params = (x, w) + ((b,) if bias else ())
    y = layer_norm(x, w, b, 1e-5)
    grads = torch.autograd.grad(y, params, torch.randn_like(y))
    assert y.shape == (0, 24) and grads[0].shape == (0, 24)
    for g in grads[1:]:
        torch.testing.assert_close(g, torch.zeros(24, device=DEVICE))


@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("width", [20, 30])
def test_layer_norm_refuses_parameters_of_another_width(which, width):
    """A weight or bias of 20 or 30 values for hidden 24: the kernel read 24 by index and
    returned numbers where the reference (F.layer_norm) raises."""
    from meshtrain.kernels.layer_norm import layer_norm

    params = {"weight": torch.randn(24, device=DEVICE), "bias": torch.randn(24, device=DEVICE)}
    params[which] = torch.randn(width, device=DEVICE)
    with pytest.raises(
        ValueError, match=rf"{which} of shape \({width},\) for x of shape \(3, 24\)"
    ):
        layer_norm(torch.randn(3, 24, device=DEVICE), params["weight"], params["bias"], 1e-5)
