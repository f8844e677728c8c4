"""FP8 scaling rules against a plain-Python reference: scales, saturation, rounding, history."""

import math

import pytest
import torch

from meshtrain.services.trainer.fp8.scaling import (
    AMAX_FLOOR,
    E4M3,
    E5M2,
    FORMATS,
    Recipe,
    amax,
    amax_to_scale,
    cast_to_fp8,
    roll_history,
    scale_from_history,
)


def test_the_formats_are_megatrons():
    assert FORMATS["e4m3"].forward is E4M3 and FORMATS["e4m3"].backward is E4M3
    assert FORMATS["hybrid"].forward is E4M3 and FORMATS["hybrid"].backward is E5M2
    assert FORMATS["hybrid"].role_max() == (448.0, 448.0, 57344.0)


@pytest.mark.parametrize("margin", [0, 2])
def test_scale_is_fp8_max_over_amax_over_two_to_the_margin(margin):
    values = [3.5, 0.01, 448.0, 1e4]
    got = amax_to_scale(torch.tensor(values), 448.0, margin)
    want = [448.0 / v / 2**margin for v in values]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_an_all_zero_tensor_gets_a_finite_scale_and_casts_to_zeros():
    s = amax_to_scale(amax(torch.zeros(4, 4)), 448.0)
    assert math.isfinite(s.item()) and s.item() == pytest.approx(448.0 / AMAX_FLOOR)
    assert cast_to_fp8(torch.zeros(4, 4), s, E4M3).float().abs().sum() == 0


@pytest.mark.parametrize("dtype,limit", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_values_beyond_the_range_saturate_instead_of_overflowing(dtype, limit):
    x = torch.tensor([1e9, -1e9, 2 * limit, -3 * limit, 1.0])
    q = cast_to_fp8(x, torch.tensor(1.0), dtype).float()
    assert torch.isfinite(q).all()
    assert q[:4].tolist() == [limit, -limit, limit, -limit]
    assert q[4].item() == 1.0


@pytest.mark.parametrize("dtype,mantissa", [(E4M3, 3), (E5M2, 2)])
def test_a_scaled_cast_rounds_to_half_an_ulp(dtype, mantissa):
    """Scaled to the format's range, every value (bar the subnormals) comes back within half a
    unit in the last place: 2^-(mantissa+1) relative."""
    torch.manual_seed(0)
    x = torch.randn(10_000) * 37.0
    s = amax_to_scale(amax(x), torch.finfo(dtype).max)
    back = cast_to_fp8(x, s, dtype).float() / s
    normal = (x * s).abs() >= torch.finfo(dtype).smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max().item() <= 2.0 ** -(mantissa + 1) + 1e-7
    assert (back.abs().max() - x.abs().max()).abs() / x.abs().max() < 2.0 ** -(mantissa + 1)


def test_row_amax_keeps_a_column():
    x = torch.tensor([[1.0, -5.0], [0.5, 0.25]])
    assert amax(x, dim=1).tolist() == [[5.0], [0.5]]
    assert amax(x, dim=0).tolist() == [[1.0, 5.0]]
    assert amax(x).item() == 5.0


def _reference_scales(history, role_max, algo, margin, previous):
    out = []
    for layer, prev_row in zip(history, previous):
        row = []
        for entries, fp8_max, prev in zip(layer, role_max, prev_row):
            recent = max(entries) if algo == "max" else entries[0]
            row.append(fp8_max / recent / 2**margin if recent > 0 else prev)
        out.append(row)
    return out


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scales_from_the_history(algo, margin):
    history = [
        [[2.0, 8.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.25, 4.0]],
        [[16.0, 1.0, 1.0], [3.0, 0.0, 7.0], [0.0, 0.0, 0.0]],
    ]
    previous = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    role_max = [448.0, 448.0, 57344.0]
    got = scale_from_history(
        torch.tensor(history), torch.tensor(role_max), algo, margin, torch.tensor(previous)
    )
    want = _reference_scales(history, role_max, algo, margin, previous)
    assert got.tolist() == [pytest.approx(row, rel=1e-6) for row in want]


def test_rolling_ages_every_entry_and_opens_a_zero_one():
    h = torch.tensor([[[1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0]]])
    roll_history(h)
    assert h.tolist() == [[[0.0, 1.0, 2.0]], [[0.0, 4.0, 5.0]]]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"format": "e5m2"}, "unknown FP8 format"),
        ({"recipe": "mxfp8"}, "unknown FP8 recipe"),
        ({"amax_compute_algo": "mean"}, "amax compute algorithm"),
        ({"amax_history_len": 0}, "at least one entry"),
    ],
)
def test_a_bad_recipe_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**kwargs)
