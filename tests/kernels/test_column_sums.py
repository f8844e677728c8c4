"""The norms' partial-gradient column sums: one launch against torch's sum, in the target dtype."""

import pytest
import torch

from tests.kernels.conftest import DEVICE, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("parts, n", [(1, 1), (4, 300), (37, 65), (70, 1024)])
def test_sums_both_buffers_into_their_dtypes(parts, n):
    """Odd partial counts and widths (masked tails on both axes), fp32 and bf16 outputs."""
    from meshtrain.kernels._column_sums import column_sums

    torch.manual_seed(0)
    a = torch.randn(parts, n, device=DEVICE)
    b = torch.randn(parts, n, device=DEVICE)
    sa, sb = column_sums(a, torch.float32, b, torch.bfloat16)
    assert sa.dtype == torch.float32 and sb.dtype == torch.bfloat16 and sa.shape == sb.shape == (n,)
    torch.testing.assert_close(sa, a.double().sum(0).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sb, b.double().sum(0).to(torch.bfloat16), rtol=1e-2, atol=1e-2)


def test_one_buffer():
    from meshtrain.kernels._column_sums import column_sums

    a = torch.arange(12, dtype=torch.float32, device=DEVICE).view(3, 4)
    sa, sb = column_sums(a, torch.float32)
    assert sb is None
    assert sa.tolist() == [12.0, 15.0, 18.0, 21.0]


@pytest.mark.parametrize("case", ["not fp32", "not contiguous", "shapes differ"])
def test_refuses_what_it_cannot_sum(case):
    from meshtrain.kernels._column_sums import column_sums

    a = torch.zeros(4, 6, device=DEVICE)
    b = None
    if case == "not fp32":
        a = a.to(torch.bfloat16)
    elif case == "not contiguous":
        a = torch.zeros(6, 4, device=DEVICE).t()
    else:
        b = torch.zeros(4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous fp32 partials"):
        column_sums(a, torch.float32, b, torch.float32)
