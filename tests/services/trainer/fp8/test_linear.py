"""FP8 linear layers on CPU against a hand-made reference of the same casts.

Off CUDA the layer multiplies its FP8 operands dequantized in fp32 (what cuBLAS computes, in
another summation order; the GPU test compares the two), so here the reference is: cast each
operand as the recipe says (scale, saturate, round), dequantize, multiply in fp32, round to
bf16. The layer must match it to bf16 rounding, and must not match a reference that casts
differently (e4m3 gradients for hybrid, the current amax for delayed scaling), which shows
the test can tell.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.services.trainer.fp8 import DelayedState, Fp8Gemm, Fp8Linear, Recipe
from meshtrain.services.trainer.fp8.convert import Fp8Model
from meshtrain.services.trainer.fp8.scaling import (
    E4M3,
    E5M2,
    FP8_MAX,
    amax,
    amax_to_scale,
    cast_to_fp8,
)
from meshtrain.services.trainer.weight_copies import WeightCopies, call_with


def _q(t: torch.Tensor, dtype, dim=None, scale=None) -> torch.Tensor:
    """t in bf16, cast to FP8 as a layer casts it (per tensor, or per `dim` row), dequantized."""
    t = t.detach().to(torch.bfloat16)
    s = amax_to_scale(amax(t, dim), FP8_MAX[dtype]) if scale is None else scale
    return cast_to_fp8(t, s, dtype).float() / s


def _operands(m=48, k=32, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m // 2, k, generator=g).requires_grad_()
    w = torch.randn(n, k, generator=g).requires_grad_()
    b = torch.randn(n, generator=g).requires_grad_()
    dy = torch.randn(2, m // 2, n, generator=g) * 1e-3
    return x, w, b, dy


def _close(a, b, rtol=1e-2):
    torch.testing.assert_close(
        a.float(), b.float(), rtol=rtol, atol=rtol * b.float().abs().max().item()
    )


def _far(a, b):
    assert ((a.float() - b.float()).norm() / b.float().norm()).item() > 1e-3


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_tensorwise_matches_the_reference_casts(fmt):
    x, w, b, dy = _operands()
    y = Fp8Gemm(Recipe(fmt, "tensorwise"))(x, w, b)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy.to(torch.bfloat16))
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    xd, wd, dyd = _q(x, E4M3).flatten(0, 1), _q(w, E4M3), _q(dy, grad_dtype).flatten(0, 1)
    assert y.dtype == torch.bfloat16 and dx.dtype == x.dtype and dw.dtype == w.dtype
    _close(y.flatten(0, 1), xd @ wd.t() + b.detach())
    _close(dx.flatten(0, 1), dyd @ wd)
    _close(dw, dyd.t() @ xd)
    _close(db, dy.flatten(0, 1).sum(0))
    other = E4M3 if fmt == "hybrid" else E5M2  # the other gradient format is measurably different
    _far(dx.flatten(0, 1), _q(dy, other).flatten(0, 1) @ wd)


def test_rowwise_scales_each_row_along_the_summed_dimension():
    x, w, b, dy = _operands()
    y = Fp8Gemm(Recipe("e4m3", "rowwise"))(x, w, None)
    dx, dw = torch.autograd.grad(y, (x, w), dy.to(torch.bfloat16))
    x2, dy2 = x.flatten(0, 1), dy.flatten(0, 1)
    _close(y.flatten(0, 1), _q(x2, E4M3, 1) @ _q(w, E4M3, 1).t())
    _close(dx.flatten(0, 1), _q(dy2, E4M3, 1) @ _q(w, E4M3, 0))
    _close(dw, _q(dy2, E4M3, 0).t() @ _q(x2, E4M3, 0))
    _far(y.flatten(0, 1), _q(x2, E4M3) @ _q(w, E4M3).t())  # not one scale per tensor


def test_a_row_of_outliers_costs_other_rows_nothing_under_rowwise():
    """The point of rowwise scaling: one huge token does not flush the others' small values."""
    x, w, _, _ = _operands()
    x = x.detach().clone()
    x[0, 0] *= (
        1e6  # one token: under one scale per tensor the others fall below e4m3's smallest value
    )
    ref = F.linear(x, w.detach())
    rel = lambda y: ((y.float() - ref)[0, 1:].norm() / ref[0, 1:].norm()).item()  # noqa: E731
    with torch.no_grad():
        assert rel(Fp8Gemm(Recipe("e4m3", "rowwise"))(x, w)) < 0.06
        assert rel(Fp8Gemm(Recipe("e4m3", "tensorwise"))(x, w)) > 0.5


def _delayed_layer(history_len=4):
    state = DelayedState(1, history_len, torch.device("cpu"))
    recipe = Recipe("hybrid", "delayed", amax_history_len=history_len, amax_compute_algo="max")
    return Fp8Gemm(recipe, delayed=(state, 0)), state


def test_delayed_scaling_records_amaxes_and_scales_from_them_after_the_first_step():
    gemm, state = _delayed_layer()
    handle = Fp8Model(gemm.recipe, ["layer"], delayed=state)
    x, w, b, dy = _operands()
    # step 1: no history yet, so the current amax (exactly tensorwise), recorded
    y1 = gemm(x, w, b)
    y1.backward(dy.to(torch.bfloat16))
    _close(y1, Fp8Gemm(Recipe("hybrid", "tensorwise"))(x, w, b))
    second = x.detach() * 3  # a second micro-batch with a larger amax: the record is the max
    gemm(second.requires_grad_(), w, b).backward(dy.to(torch.bfloat16))
    xs = x.detach().bfloat16().float()
    assert state.history[0, 0, 0].item() == pytest.approx(3 * xs.abs().max().item(), rel=1e-2)
    assert state.history[0, 1, 0].item() == pytest.approx(
        w.detach().bfloat16().float().abs().max().item()
    )
    assert state.history[0, 2, 0].item() > 0
    handle.step_end()
    assert state.ready and state.history[0, :, 0].tolist() == [0.0, 0.0, 0.0]  # a fresh entry
    assert state.scale[0, 0].item() == pytest.approx(448.0 / state.history[0, 0, 1].item())
    assert state.scale[0, 2].item() == pytest.approx(57344.0 / state.history[0, 2, 1].item())
    # step 2: x's scale is the history's (3x the amax of x): x is cast coarser than tensorwise would
    y2 = gemm(x, w, b)
    s = state.scale[0, 0]
    _close(y2.flatten(0, 1), _q(x, E4M3, scale=s).flatten(0, 1) @ _q(w, E4M3).t() + b.detach())
    _far(y2, Fp8Gemm(Recipe("hybrid", "tensorwise"))(x, w, b))


def test_delayed_values_beyond_the_history_saturate_and_evaluation_records_nothing():
    gemm, state = _delayed_layer()
    handle = Fp8Model(gemm.recipe, ["layer"], delayed=state)
    x, w, b, dy = _operands()
    gemm(x, w, b).backward(dy.to(torch.bfloat16))
    handle.step_end()
    big = (x.detach() * 1e6).requires_grad_()
    y = gemm(big, w, b)
    assert torch.isfinite(y).all()
    before = state.history.clone()
    with torch.no_grad():
        gemm(x * 100, w, b)
    assert torch.equal(state.history, before)


def test_the_history_forgets_after_its_length_with_max():
    gemm, state = _delayed_layer(history_len=2)
    handle = Fp8Model(gemm.recipe, ["layer"], delayed=state)
    _, w, b, dy = _operands()
    for scale in (100.0, 1.0, 1.0):
        x = (torch.ones(4, 32) * scale).requires_grad_()
        gemm(x, w, b).backward(torch.ones(4, 64, dtype=torch.bfloat16))
        handle.step_end()
    assert state.scale[0, 0].item() == pytest.approx(448.0)  # the 100 has left the 2-step history


def test_fused_accumulation_adds_into_the_main_gradient():
    """Under bf16 weight copies with fusion, the weight gradient goes into the fp32 weight's
    .grad inside the backward (two micro-batches add up), none onto the copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64))
    model[0].__class__ = Fp8Linear
    model[0].make_fp8(Fp8Gemm(Recipe("hybrid", "tensorwise")))
    copies = WeightCopies(model, torch.bfloat16, fuse_weight_grads=True)
    assert copies.fused
    x1, x2 = torch.randn(8, 32), torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x in (x1, x2):
            call_with(model, copies.copies, x).float().sum().backward()
    main = model[0].weight
    assert copies.copies["0.weight"].grad is None
    ones = torch.ones(8, 64)
    want = sum(_q(ones, E5M2).t() @ _q(x, E4M3) for x in (x1, x2))
    _close(main.grad, want)


def test_compiled_delayed_layer_matches_eager_and_updates_its_history():
    torch._dynamo.reset()
    """With bf16 operands, as under autocast with weight copies (from fp32, Inductor skips the
    intermediate bf16 rounding, which moves some FP8 values by one unit)."""
    gemm, state = _delayed_layer()
    x, w, b, dy = (t.detach().bfloat16().requires_grad_() for t in _operands())
    eager = gemm(x, w, b)
    eager.backward(dy.to(torch.bfloat16))
    recorded = state.history.clone()
    state.history.zero_()
    compiled = torch.compile(lambda x, w, b: gemm(x, w, b), fullgraph=True)
    y = compiled(x, w, b)
    y.backward(dy.to(torch.bfloat16))
    _close(y, eager)
    torch.testing.assert_close(state.history, recorded)


def _fused_and_unfused_steps(recipe: str, fused: bool, kernels: bool, monkeypatch):
    """Two steps (delayed: the second casts with the history's scale) of one layer with its
    casts fused or not; `kernels`: the fused casts run the Triton kernels (the CPU interpreter)
    instead of the reference the dispatch picks off CUDA. Returns everything the steps made."""
    from meshtrain.kernels import dispatch

    if kernels:
        from meshtrain.kernels import fp8_cast

        monkeypatch.setattr(dispatch, "fp8_cast_transpose", fp8_cast.fp8_cast_transpose)
        monkeypatch.setattr(dispatch, "fp8_amax", fp8_cast.fp8_amax)
    r = Recipe("hybrid", recipe, fused_casts=fused)
    state = DelayedState(1, 2, torch.device("cpu")) if recipe == "delayed" else None
    gemm = Fp8Gemm(r, delayed=(state, 0) if state is not None else None)
    handle = Fp8Model(r, ["layer"], delayed=state)
    x, w, b, dy = _operands(m=50, k=48, n=80)  # 50 tokens: not a multiple of any tile
    x.data[0, 0, :3] = torch.tensor([1e4, -0.0, 0.0])  # an outlier sets the amax
    out = []
    for step in range(2):
        xs = (x.detach() * (step + 1)).requires_grad_()
        y = gemm(xs, w, b)
        out += [y, *torch.autograd.grad(y, (xs, w, b), dy.to(torch.bfloat16))]
        if state is not None:
            out += [state.history.clone()]
            handle.step_end()
            out += [state.scale.clone()]
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "triton"])
def test_fused_casts_give_the_unfused_layer_bit_for_bit(recipe, kernels, monkeypatch):
    """Outputs, the three gradients, the amax history and the scales: equal, not close."""
    unfused = _fused_and_unfused_steps(recipe, False, False, monkeypatch)
    fused = _fused_and_unfused_steps(recipe, True, kernels, monkeypatch)
    assert len(fused) == len(unfused)
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)
