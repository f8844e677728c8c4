"""Triton RoPE against `meshtrain.kernels.reference.rope`, forward and backward,
on strided q/k views."""

import pytest
import torch

from meshtrain.kernels import reference
from tests.kernels.conftest import DEVICE, TOL, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_strided_views(dtype):
    """q/k as the attention layer makes them: slices of a fused qkv tensor, transposed to
    (b, heads, s, d); 3 heads, seq 131 (two position tiles, the second partial), head_dim 10
    (half 5, not a power of two).
    fp32: a two-term sum per element, exact to rounding -> 1e-5; bf16: output rounding -> 2e-2."""
    from meshtrain.kernels.rope import rope

    torch.manual_seed(0)
    b, h, s, d = 2, 3, 131, 10
    qkv = torch.randn(b, s, h + 2, d, device=DEVICE, dtype=dtype)
    x = qkv[:, :, :h].transpose(1, 2).detach().requires_grad_()  # (b, h, s, d), non-contiguous
    cos, sin = reference.rope_cos_sin(s, d, 10000.0, device=DEVICE)
    y = rope(x, cos, sin)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = reference.rope(x64, cos.double(), sin.double())
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert y.dtype == dtype and y.is_contiguous()
    torch.testing.assert_close(y.double(), y64, **TOL[dtype])
    torch.testing.assert_close(dx.double(), dx64, **TOL[dtype])


def test_rope_with_unequal_halves_of_the_tables():
    """The spec takes any (s, d) cos/sin, not only tables whose halves repeat; random tables
    check that each half of x meets the right half of cos and sin, forward and backward."""
    from meshtrain.kernels.rope import rope

    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 6, device=DEVICE, dtype=torch.float64).requires_grad_()
    cos, sin = torch.randn(5, 6, device=DEVICE), torch.randn(5, 6, device=DEVICE)
    y = rope(x.float(), cos, sin)
    y64 = reference.rope(x, cos.double(), sin.double())
    torch.testing.assert_close(y.double(), y64, **TOL[torch.float32])
    dy = torch.randn_like(y64)
    (dx,) = torch.autograd.grad(y, x, dy.float())
    (dx64,) = torch.autograd.grad(y64, x, dy)
    torch.testing.assert_close(dx, dx64, **TOL[torch.float32])
