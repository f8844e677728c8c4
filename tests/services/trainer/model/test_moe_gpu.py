"""The MoE block on CUDA: grouped GEMMs match the per-expert loop,
and the block matches fp32 on CPU.

Skipped without CUDA; the grouped kernel (`torch._grouped_mm`) needs compute capability 9.0+.
"""

import pytest
import torch

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model.grouped_gemm import (
    grouped_gemm_available,
    grouped_linear,
    grouped_linear_loop,
)
from meshtrain.services.trainer.model.moe import MoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _hopper() -> bool:
    return grouped_gemm_available(torch.zeros(1, device="cuda", dtype=torch.bfloat16))


@pytest.mark.skipif(
    not torch.cuda.is_available() or not _hopper(), reason="grouped GEMM needs sm90+"
)
@pytest.mark.parametrize("counts", [[40, 0, 17, 71], [0, 0, 128, 0], [1, 2, 3, 122]])
def test_grouped_gemm_matches_loop_forward_and_backward(counts):
    torch.manual_seed(0)
    rows, k, n = sum(counts), 256, 384
    c = torch.tensor(counts, device="cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (
        torch.randn(len(counts), n, k, device="cuda") * 0.05
    ).requires_grad_()  # fp32 master weight
    gy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for grouped in (True, False):
        y = (
            grouped_linear(x, w, c, grouped)
            if grouped
            else grouped_linear_loop(x, w.to(x.dtype), c)
        )
        y.backward(gy)
        outs.append(y.float())
        grads.append((x.grad.float().clone(), w.grad.float().clone()))
        x.grad = w.grad = None
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=5e-2)
    empty = [e for e, n_e in enumerate(counts) if n_e == 0]
    assert all(
        grads[0][1][e].abs().max() == 0 for e in empty
    )  # an expert without rows gets no gradient


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_moe_block_bf16_on_cuda_matches_fp32_on_cpu(capacity):
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=128,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=64,
        activation="swiglu",
        normalization="rmsnorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=256,
        moe_shared_expert_intermediate_size=128,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_expert_capacity_factor=capacity,
    )
    cpu = MoE(cfg)
    with torch.no_grad():
        for p in cpu.parameters():
            p.normal_(0, 0.05)
    gpu = MoE(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(4, 64, 128)
    gy = torch.randn(4, 64, 128)
    xc = x.clone().requires_grad_()
    cpu(xc).backward(gy)
    xg = x.cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = gpu(xg)
    y.backward(gy.cuda())
    # Same routing on both sides (the router runs in fp32), so the tokens per expert agree exactly.
    assert torch.equal(cpu.stats.tokens_per_expert, gpu.stats.tokens_per_expert.cpu())
    torch.testing.assert_close(y.float().cpu(), cpu(x).detach(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(xg.grad.float().cpu(), xc.grad, rtol=5e-2, atol=5e-2)
    for (name, pc), pg in zip(cpu.named_parameters(), gpu.parameters()):
        if pc.grad is not None:
            scale = pc.grad.abs().max().clamp_min(1e-6)
            assert ((pg.grad.cpu() - pc.grad).abs().max() / scale) < 5e-2, name
