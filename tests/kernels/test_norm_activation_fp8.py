"""Norms and activations writing their output's FP8 copy, against the unfused ops, bit for bit.

`rms_norm_fp8`, `layer_norm_fp8` (kernels/norm_fp8.py), `swiglu_fp8` and `gelu_fp8`
(kernels/activation_fp8.py) against the plain Triton op followed by the trainer's torch cast
(`scaling.cast_to_fp8` of the output in bf16, as the FP8 linear casts it) and its amax: y, q and
the amax equal, not close, and the gradients equal to the plain op's. Odd widths and row counts
(partial tiles, several programs raising one amax), fp32 and bf16 inputs, a scale that saturates,
NaN and inf in the input, e4m3 and e5m2, and current scaling (no scale: y and the amax only).
Runs through Triton's interpreter on the CPU and compiled on a GPU.
"""

import pytest
import torch

from meshtrain.kernels import reference
from meshtrain.services.trainer.fp8.scaling import amax as torch_amax
from meshtrain.services.trainer.fp8.scaling import cast_to_fp8
from tests.kernels.conftest import DEVICE, needs_triton

pytestmark = needs_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(1, 8), (37, 70), (130, 48)]  # rows, width: partial tiles; 130 rows span programs


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The FP8 bytes, every NaN as one byte (its sign and payload are the platform's)."""
    return torch.where(t.float().isnan(), 0x7F, t.view(torch.uint8).int())


def _ops(kind):
    """(the fused op, the plain Triton op, the reference fused op), each taking (input, scale,
    dtype) / (input) and the module's parameters bound."""
    from meshtrain.kernels import activation_fp8, gelu, layer_norm, norm_fp8, rms_norm, swiglu

    g = torch.Generator().manual_seed(1)
    width = None

    def params(n):
        nonlocal width
        width = n
        w = (1 + 0.3 * torch.randn(n, generator=g)).to(DEVICE)
        b = (0.1 * torch.randn(n, generator=g)).to(DEVICE)
        return w, b

    if kind == "rms_norm":
        return (
            lambda x, w, b, s, d: norm_fp8.rms_norm_fp8(x, w, 1e-5, s, d),
            lambda x, w, b: rms_norm.rms_norm(x, w, 1e-5),
            lambda x, w, b, s, d: reference.rms_norm_fp8(x, w, 1e-5, s, d),
            params,
        )
    if kind == "layer_norm":
        return (
            lambda x, w, b, s, d: norm_fp8.layer_norm_fp8(x, w, b, 1e-5, s, d),
            lambda x, w, b: layer_norm.layer_norm(x, w, b, 1e-5),
            lambda x, w, b, s, d: reference.layer_norm_fp8(x, w, b, 1e-5, s, d),
            params,
        )
    if kind == "swiglu":
        return (
            lambda x, w, b, s, d: activation_fp8.swiglu_fp8(x, s, d),
            lambda x, w, b: swiglu.swiglu(x),
            lambda x, w, b, s, d: reference.swiglu_fp8(x, s, d),
            params,
        )
    return (
        lambda x, w, b, s, d: activation_fp8.gelu_fp8(x, s, d),
        lambda x, w, b: gelu.gelu(x),
        lambda x, w, b, s, d: reference.gelu_fp8(x, s, d),
        params,
    )


def _input(kind, rows, width, dtype, special: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    cols = 2 * width if kind == "swiglu" else width
    x = torch.randn(rows, cols, generator=g) * 3
    if special and rows > 2:
        x[1, 3] = float("nan")  # a NaN row (norms) / element (activations)
        x[2, 0] = float("inf")
        x[-1] *= 1e3  # a row far past the format's range once scaled
    return x.to(DEVICE, dtype)


KINDS = ["rms_norm", "layer_norm", "swiglu", "gelu"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "dtype,fmt", [(torch.bfloat16, E4M3), (torch.float32, E5M2)], ids=["bf16-e4m3", "fp32-e5m2"]
)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_fused_output_cast_equals_the_op_then_the_torch_cast(kind, shape, dtype, fmt):
    """Delayed scaling's pass (a scale given): a scale of fp8_max / 2 saturates, and NaN / inf
    in the input reach y, q and the amax as they reach the unfused path's."""
    fused, plain, ref, params = _ops(kind)
    rows, width = shape
    w, b = params(width)
    for special in (False, True):
        x = _input(kind, rows, width, dtype, special)
        # special: a scale that takes every |y| > 2 past the format's largest value
        limit = torch.finfo(fmt).max
        scale = torch.tensor(limit / 2 if special else 64.0, device=DEVICE)
        y, q, a = fused(x, w, b, scale, fmt)
        expect = plain(x, w, b)
        assert y.dtype == dtype and torch.equal(y.isnan(), expect.isnan())
        assert torch.equal(y.nan_to_num(), expect.nan_to_num())
        yb = expect.to(torch.bfloat16)
        assert q.dtype == fmt and q.shape == y.shape
        assert torch.equal(_bits(q), _bits(cast_to_fp8(yb, scale, fmt)))
        torch.testing.assert_close(a, torch_amax(yb), rtol=0, atol=0, equal_nan=True)
        if special and rows > 2:
            assert a.isnan()  # NaN in, NaN amax, as torch's
            assert (q.float().abs() == limit).any()  # saturated, not inf
        # the plain-torch spec: the same FP8 copy of its own y
        ry, rq, ra = ref(x, w, b, scale, fmt)
        assert torch.equal(_bits(rq), _bits(cast_to_fp8(ry.to(torch.bfloat16), scale, fmt)))


@pytest.mark.parametrize("kind", KINDS)
def test_without_a_scale_only_the_amax_comes_with_y(kind):
    """Current scaling: the scale waits for this amax, so no q; y and the amax as above."""
    fused, plain, _, params = _ops(kind)
    w, b = params(70)
    x = _input(kind, 37, 70, torch.bfloat16, special=False)
    y, q, a = fused(x, w, b, None, E4M3)
    assert q is None
    expect = plain(x, w, b)
    assert torch.equal(y, expect)
    assert torch.equal(a, torch_amax(expect.to(torch.bfloat16)))


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_are_the_plain_ops(kind):
    """The backward is the plain op's kernel from the same saved tensors: equal gradients."""
    fused, plain, _, params = _ops(kind)
    w, b = params(48)
    x = _input(kind, 9, 48, torch.float32, special=False)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    y, q, _ = fused(*leaves, torch.tensor(2.0, device=DEVICE), E4M3)
    assert not q.requires_grad
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    again = [t.detach().clone().requires_grad_() for t in leaves]
    want = torch.autograd.grad(plain(*again), again, dy, allow_unused=True)
    for g_, w_ in zip(got, want, strict=True):
        assert (g_ is None) == (w_ is None)
        if g_ is not None:
            assert torch.equal(g_, w_)


def test_bad_arguments_are_named():
    from meshtrain.kernels import activation_fp8, norm_fp8

    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="FP8 dtypes"):
        norm_fp8.rms_norm_fp8(x, torch.ones(8, device=DEVICE), 1e-5, None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight of shape \(7,\)"):
        norm_fp8.rms_norm_fp8(x, torch.ones(7, device=DEVICE), 1e-5, None, E4M3)
    with pytest.raises(ValueError, match="one fp32 value"):
        activation_fp8.gelu_fp8(x, torch.ones(2, device=DEVICE), E4M3)
    with pytest.raises(ValueError, match="even last dim"):
        activation_fp8.swiglu_fp8(torch.randn(4, 7, device=DEVICE), None, E4M3)
