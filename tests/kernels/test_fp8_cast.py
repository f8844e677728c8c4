"""The FP8 cast kernels against the unfused torch casts, bit for bit.

`fp8_cast_transpose` and `fp8_amax` (kernels/fp8_cast.py) against
`meshtrain.services.trainer.fp8.scaling` (the trainer's casts) and
`meshtrain.kernels.reference`: odd shapes that leave partial tiles, zeros, -0.0, values past the
format's largest (saturation), infinities and NaN, values in the FP8 subnormal range, ties
that round a mantissa up into the next power of two, e4m3 and e5m2, bf16 and fp32 inputs,
strided inputs, and the amax across several programs. Runs through Triton's interpreter on the
CPU and compiled on a GPU.
"""

import pytest
import torch

from meshtrain.kernels import reference
from meshtrain.services.trainer.fp8.scaling import amax as torch_amax
from meshtrain.services.trainer.fp8.scaling import amax_to_scale, cast_to_fp8
from tests.kernels.conftest import DEVICE, needs_triton

pytestmark = needs_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(1, 1), (37, 70), (130, 67), (64, 64)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The FP8 bytes, every NaN as one byte: NaN's sign and payload are the platform's (x86's
    NaN is negative, a GPU's conversion writes 0x7f), the value is the same."""
    return torch.where(t.float().isnan(), 0x7F, t.view(torch.uint8).int())


def _input(shape, dtype, fmt, seed=0) -> torch.Tensor:
    """Gaussian values spread over the format's range, with the awkward ones planted."""
    g = torch.Generator().manual_seed(seed)
    limit = torch.finfo(fmt).max
    x = torch.randn(shape, generator=g) * limit / 3
    flat = x.view(-1)
    special = [
        0.0,
        -0.0,
        limit * 4,  # saturates
        -limit * 4,
        float("inf"),
        -float("inf"),
        127.5,  # rounds up into the next power of two (128) in e4m3
        -239.9,
        1e-3,  # e4m3's subnormals reach 2^-9 ~ 2e-3
        -3e-6,  # e5m2's reach 2^-16 ~ 1.5e-5
        2.0**-10,  # an exact tie below e4m3's smallest subnormal
        float("nan"),
    ]
    n = min(len(special), flat.numel())
    flat[:n] = torch.tensor(special[:n])
    return x.to(DEVICE, dtype)


def _check(x, scale, fmt):
    from meshtrain.kernels.fp8_cast import fp8_cast_transpose

    q, qt, a = fp8_cast_transpose(x, scale, fmt, transpose=True, amax=True)
    expect = cast_to_fp8(x, scale, fmt)
    assert q.dtype == fmt and q.shape == x.shape and q.is_contiguous()
    assert torch.equal(_bits(q), _bits(expect))
    assert qt.shape == x.shape[::-1] and qt.is_contiguous()
    assert torch.equal(_bits(qt), _bits(expect.t().contiguous()))
    torch.testing.assert_close(a, torch_amax(x), rtol=0, atol=0, equal_nan=True)
    rq, rqt, ra = reference.fp8_cast_transpose(x, scale, fmt, amax=True)
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(_bits(qt), _bits(rqt))
    torch.testing.assert_close(a, ra, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_cast_transpose_is_bit_equal_to_the_torch_cast(shape, dtype, fmt):
    """With the scale 1 (the planted values land as they are) and with an amax-derived one."""
    x = _input(shape, dtype, fmt)
    _check(x, torch.ones((), device=DEVICE), fmt)
    finite = x.float().nan_to_num(0.0, 0.0, 0.0)
    scale = amax_to_scale(torch_amax(finite), torch.finfo(fmt).max)
    _check(x, scale, fmt)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_every_fp8_value_and_every_midpoint_rounds_as_torch(fmt):
    """All 256 codes' values (those finite), and the midpoints between neighbours, which round
    to even: the rounding itself, exhaustively, fp32 input with scale 1."""
    from meshtrain.kernels.fp8_cast import fp8_cast_transpose

    values = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    values = values[values.isfinite()].unique()  # sorted
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids.nextafter(torch.tensor(float("inf")))])
    x = x.reshape(1, -1).to(DEVICE)
    q, _, _ = fp8_cast_transpose(x, torch.ones((), device=DEVICE), fmt, transpose=False)
    assert torch.equal(_bits(q), _bits(cast_to_fp8(x, torch.ones(()).to(DEVICE), fmt)))


def test_all_zeros_cast_to_zeros_with_amax_zero():
    from meshtrain.kernels.fp8_cast import fp8_amax, fp8_cast_transpose

    x = torch.zeros(33, 17, device=DEVICE, dtype=torch.bfloat16)
    scale = amax_to_scale(torch_amax(x), torch.finfo(E4M3).max)  # the floor keeps it finite
    q, qt, a = fp8_cast_transpose(x, scale, E4M3, amax=True)
    assert torch.equal(_bits(q), torch.zeros_like(_bits(q))) and qt.shape == (17, 33)
    assert a.item() == 0.0 and fp8_amax(x).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_amax_over_several_programs_equals_torch(dtype):
    """Past 4 blocks of 4096 (the interpreter's program count) each program loops; the largest
    value sits in the last, partial block."""
    from meshtrain.kernels.fp8_cast import fp8_amax

    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 4096 * 3 + 11, generator=g)
    x[6, -1] = -57.25
    x = x.to(DEVICE, dtype)
    a = fp8_amax(x)
    assert a.shape == () and a.dtype == torch.float32
    assert torch.equal(a, torch_amax(x)) and a.item() == 57.25
    x[2, 5] = float("nan")
    assert fp8_amax(x).isnan()


def test_a_strided_input_casts_as_its_contiguous_copy():
    """A transposed view (unit stride along rows): read through its strides, no copy."""
    from meshtrain.kernels.fp8_cast import fp8_amax, fp8_cast_transpose

    x = _input((70, 37), torch.bfloat16, E4M3).t()  # (37, 70), strides (1, 37)
    scale = torch.tensor(0.75, device=DEVICE)
    q, qt, a = fp8_cast_transpose(x, scale, E4M3, amax=True)
    expect = cast_to_fp8(x.contiguous(), scale, E4M3)
    assert torch.equal(_bits(q), _bits(expect)) and torch.equal(_bits(qt), _bits(expect.t()))
    torch.testing.assert_close(a, fp8_amax(x), rtol=0, atol=0, equal_nan=True)


def test_out_buffers_are_written_in_place():
    from meshtrain.kernels.fp8_cast import fp8_cast_transpose

    x = _input((40, 24), torch.float32, E5M2, seed=5)
    out = torch.empty(40, 24, dtype=E5M2, device=DEVICE)
    out_t = torch.empty(24, 40, dtype=E5M2, device=DEVICE)
    scale = torch.tensor([2.0], device=DEVICE)  # one element, not 0-d: taken as well
    q, qt, a = fp8_cast_transpose(x, scale, E5M2, out=out, out_t=out_t)
    assert q is out and qt is out_t and a is None
    expect = cast_to_fp8(x, torch.tensor(2.0, device=DEVICE), E5M2)
    assert torch.equal(_bits(out), _bits(expect)) and torch.equal(_bits(out_t), _bits(expect.t()))
    rq, rqt, _ = reference.fp8_cast_transpose(
        x, scale, E5M2, out=torch.empty_like(out), out_t=torch.empty_like(out_t)
    )
    assert torch.equal(_bits(rq), _bits(out)) and torch.equal(_bits(rqt), _bits(out_t))


def test_cast_without_transpose_returns_none_for_it():
    from meshtrain.kernels.fp8_cast import fp8_cast_transpose

    x = _input((9, 5), torch.bfloat16, E4M3)
    q, qt, a = fp8_cast_transpose(x, torch.ones((), device=DEVICE), E4M3, transpose=False)
    assert qt is None and a is None
    assert torch.equal(_bits(q), _bits(cast_to_fp8(x, torch.ones((), device=DEVICE), E4M3)))


@pytest.mark.parametrize(
    "x,scale,dtype,out,message",
    [
        (torch.zeros(2, 3, 4), torch.ones(()), E4M3, None, "2-D"),
        (torch.zeros(2, 3), torch.ones(2), E4M3, None, "one scale"),
        (torch.zeros(2, 3), torch.ones(()), torch.bfloat16, None, "FP8 dtypes"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.ones(()), E4M3, None, "int32"),
        (torch.zeros(2, 3), torch.ones(()), E4M3, torch.empty(3, 2, dtype=E4M3), "out must be"),
    ],
)
def test_bad_arguments_are_refused_by_name(x, scale, dtype, out, message):
    from meshtrain.kernels.fp8_cast import fp8_cast_transpose

    with pytest.raises(ValueError, match=message):
        fp8_cast_transpose(x.to(DEVICE), scale.to(DEVICE), dtype, out=out)
