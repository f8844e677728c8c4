"""Shared setup for the kernel tests.

Without a GPU, the Triton kernels run under Triton's interpreter (numpy on the CPU): that
needs TRITON_INTERPRET=1 before `triton` is first imported, which tests/conftest.py sets for
the whole session. With a GPU the same small-shape tests run compiled on CUDA, and the `gpu`
tests add real shapes. Without Triton installed every test that needs it is skipped.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton)"
)
DEVICE = "cuda" if HAS_CUDA else "cpu"

# Tolerances of a Triton result against the reference, per dtype. fp32: both sides compute in
# fp32 and differ only in reduction order, so a few ulps. bf16: both compute in fp32 but round
# to bf16 (8 bits of mantissa, spacing 2^-8 relative) at different points, so one or two
# bf16 ulps apart.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


@pytest.fixture
def device() -> str:
    return DEVICE
