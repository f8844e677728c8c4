"""Weight gradients added into fp32 main gradients inside their GEMMs (model/main_grad.py): the
experts' op, one product per expert with rows, against the fp32 sum of those products."""

from __future__ import annotations

import torch

from meshtrain.services.trainer.model.grouped_gemm import _expert_mm, grouped_linear
from meshtrain.services.trainer.model.main_grad import accumulate_expert_weight_grads


def _expert_sum(dy: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The exact reference: per expert dy_eᵀ x_e in fp64 (experts, out, in)."""
    out = torch.zeros(len(counts), dy.shape[1], x.shape[1], dtype=torch.float64)
    start = 0
    for e, n in enumerate(counts):
        out[e] = dy[start : start + n].double().t() @ x[start : start + n].double()
        start += n
    return out


def test_expert_weight_grads_add_per_expert_and_skip_empty_experts_and_dropped_rows():
    """Odd shapes; expert 1 has no rows and 3 trailing rows are dropped choices (past
    counts.sum()), which must not reach any expert. fp32 tolerance: the sums run in fp32 on the
    bf16 operands' exact values."""
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 7, 3]
    rows = sum(counts) + 3
    main = torch.randn(4, 13, 11, generator=gen)
    start = main.clone()
    reference = main.double()
    for _ in range(2):  # two micro-batches accumulate
        dy = torch.randn(rows, 13, generator=gen).to(torch.bfloat16)
        x = torch.randn(rows, 11, generator=gen).to(torch.bfloat16)
        accumulate_expert_weight_grads(main, dy, x, torch.tensor(counts))
        reference += _expert_sum(dy, x, counts)
    assert torch.equal(main[1], start[1])  # no rows: untouched
    torch.testing.assert_close(main.double(), reference, rtol=1e-5, atol=1e-5)


def test_grouped_linear_into_main_grad_returns_the_input_gradient_and_none_for_the_weight():
    """The fused backward's input gradient is the unfused one's; the weight's gradient lands in
    main_grad (fp32 sums of the bf16 products) and the bf16 weight gets none."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 6, 4])
    x = torch.randn(15, 10, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(4, 7, 10, generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(15, 7, generator=gen).to(torch.bfloat16)
    main = torch.zeros(4, 7, 10)
    grouped_linear(x, weight, counts, grouped=True, main_grad=main).backward(dy)
    x_fused, x.grad = x.grad, None
    assert weight.grad is None
    grouped_linear(x, weight, counts, grouped=True).backward(dy)
    assert torch.equal(x_fused, x.grad)
    expected = _expert_sum(dy, x.detach(), counts.tolist()).float()
    torch.testing.assert_close(main, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.float(), main, rtol=1e-2, atol=1e-2)  # bf16's rounding


def test_the_fused_input_gradient_passes_grouped_mms_own_checks():
    """`torch._grouped_mm`'s meta function (the checks of its CUDA implementation: layouts,
    offsets) on the fused backward's input-gradient GEMM, dy (rows, out) times the weight in its
    own (experts, out, in) layout; the GPU test runs the kernel itself."""
    meta = torch.device("meta")
    dy = torch.empty(64, 48, device=meta, dtype=torch.bfloat16)
    weight = torch.empty(4, 48, 32, device=meta, dtype=torch.bfloat16)
    counts = torch.tensor([16, 0, 40, 8], device=meta)
    dx = _expert_mm(dy, weight.transpose(1, 2), counts, grouped=True)
    assert dx.shape == (64, 32) and dx.dtype == torch.bfloat16
