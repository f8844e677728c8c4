"""MoE statistics and activation recompute: a recomputed block counts and trains exactly once.

Full recompute reruns a block's forward inside the backward; the rerun must neither count the
block's routing statistics a second time nor inject the auxiliary-loss gradient twice. Every
comparison here is fp32 on CPU, where the recompute reruns the same kernels on the same inputs:
losses, gradients and statistics are bit-identical, so the tests use exact equality.
"""

import pytest
import torch

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.model.moe import moe_layers, set_moe_loss_scale
from meshtrain.services.trainer.parallel import recompute

CFG = dict(
    num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=96,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=24,
    moe_layer_freq=[1, 0, 1],
    moe_aux_loss_coeff=0.1,
    moe_z_loss_coeff=0.01,
    moe_expert_capacity_factor=1.0,
    moe_router_enable_expert_bias=True,
    moe_shared_expert_intermediate_size=16,
)

PLANS = {
    "none": {},
    "full-uniform-1": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full-uniform-3": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3
    ),
    "full-block-2": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=2
    ),
    "selective": dict(recompute_granularity="selective"),
}


def _run(plan: dict, micro_batches: int = 2, **overrides):
    """Two micro-batches of accumulated forward/backward;
    (losses, grads, stats per layer, model)."""
    torch.manual_seed(0)
    model = recompute.apply(GPT(ModelConfig(**{**CFG, **overrides})), ParallelConfig(**plan))
    set_moe_loss_scale(model, 1 / micro_batches)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(micro_batches):
        tokens = torch.randint(0, 96, (2, 16), generator=gen)
        loss = model(tokens, tokens.roll(-1, 1)) / micro_batches
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = {name: m.reset_stats() for name, m in moe_layers(model)}
    return losses, grads, stats, model


@pytest.mark.parametrize("plan", [p for p in PLANS if p != "none"])
def test_recompute_gives_identical_losses_gradients_and_statistics(plan):
    ref_losses, ref_grads, ref_stats, _ = _run(PLANS["none"])
    losses, grads, stats, model = _run(PLANS[plan])
    if plan.startswith("full"):
        assert any(r for _, _, r in model.layer_chunks())  # the plan really recomputes MoE blocks
    assert [torch.equal(a, b) for a, b in zip(losses, ref_losses)] == [True, True]
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    assert set(stats) == {"layers.0.mlp", "layers.2.mlp"}
    for name, ref in ref_stats.items():
        got = stats[name]
        assert got.micro_batches == ref.micro_batches == 2, name
        assert torch.equal(got.tokens_per_expert, ref.tokens_per_expert), name
        assert torch.equal(got.routed_per_expert, ref.routed_per_expert), name
        assert (
            int(got.routed_per_expert.sum()) == 2 * 2 * 16 * 2
        )  # micro-batches x tokens x top-k, counted once
        assert torch.equal(got.aux_loss, ref.aux_loss) and got.aux_loss > 0, name
        assert torch.equal(got.z_loss, ref.z_loss) and got.z_loss > 0, name


def test_aux_gradient_is_injected_once_under_recompute():
    """The router's gradient with the aux losses on differs from the one without by exactly the
    aux losses' own gradient (computed here from the router alone); recompute changes nothing."""
    plan = PLANS["full-uniform-1"]
    _, with_aux, _, _ = _run(plan)
    _, without, _, _ = _run(plan, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    _, twice_coeff, _, _ = _run(plan, moe_aux_loss_coeff=0.2, moe_z_loss_coeff=0.02)
    name = "layers.0.mlp.router.weight"
    once = with_aux[name] - without[name]
    assert once.abs().max() > 0
    # the aux gradient is linear in the coefficients: doubling them doubles it (a second
    # injection by the recompute would show as 2x at coefficient c, i.e. not half of 2c's)
    torch.testing.assert_close(twice_coeff[name] - without[name], 2 * once, rtol=1e-4, atol=1e-7)
    _, ref, _, _ = _run(PLANS["none"])
    assert torch.equal(with_aux[name], ref[name])


def test_evaluation_records_no_statistics():
    _, _, _, model = _run(PLANS["none"])
    model.eval()
    with torch.no_grad():
        model(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    for _, m in moe_layers(model):
        assert m.stats.micro_batches == 0 and int(m.stats.routed_per_expert.sum()) == 0


def test_expert_bias_moves_toward_balance_from_the_step_counts():
    _, _, _, model = _run(PLANS["full-uniform-1"], micro_batches=1)
    # _run reset the statistics; one more micro-batch to have counts to update from
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    model(tokens, tokens).backward()
    for _, m in moe_layers(model):
        counts = m.stats.routed_per_expert.float()
        before = m.router.expert_bias.detach().clone()
        m.update_expert_bias()
        step = m.router.expert_bias - before
        rate = m.config.moe_router_bias_update_rate
        assert torch.equal(step, rate * torch.sign(counts.mean() - counts))


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_block_under_bf16_autocast_follows_fp32(capacity):
    """fp32 rows and fp32 expert weights under bf16 autocast (the trainer's mixed precision): the
    expert GEMMs run in bf16 in forward and backward (the backward runs outside the autocast
    region, so the expert op must not meet bf16 gradients with fp32 weights), the gradients reach
    the fp32 weights in fp32, and the block stays within bf16 rounding of the fp32 block."""
    from meshtrain.services.trainer.model.moe import MoE

    torch.manual_seed(0)
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=32,
        activation="swiglu",
        normalization="rmsnorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=96,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_expert_capacity_factor=capacity,
    )
    ref = MoE(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
    mixed = MoE(cfg)
    mixed.load_state_dict(ref.state_dict())
    x, gy = torch.randn(2, 32, 64), torch.randn(2, 32, 64)
    x_ref, x_mixed = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(gy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mixed(x_mixed)
    y.backward(gy)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.detach(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x_mixed.grad, x_ref.grad, rtol=2e-2, atol=2e-2)
    for (name, p_ref), p in zip(ref.named_parameters(), mixed.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        scale = p_ref.grad.abs().max()
        assert (p.grad - p_ref.grad).abs().max() <= 3e-2 * scale, name


def test_reset_stats_returns_the_counts_and_keeps_the_counters():
    """The counters are zeroed in place (a captured CUDA graph adds into the tensors it saw);
    what reset returns is a copy that later forwards leave alone."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG)).train()
    layer = moe_layers(model)[0][1]
    counters = [layer.stats.tokens_per_expert, layer.stats.micro_batches]
    tokens = torch.randint(0, 96, (2, 16))
    model(tokens, tokens.roll(-1, 1)).backward()
    first = layer.reset_stats()
    assert int(first.micro_batches) == 1 and int(first.tokens_per_expert.sum()) > 0
    assert layer.stats.tokens_per_expert is counters[0]
    assert layer.stats.micro_batches is counters[1]
    assert int(layer.stats.micro_batches) == 0 and int(layer.stats.tokens_per_expert.sum()) == 0
    model(tokens, tokens.roll(-1, 1)).backward()
    assert int(first.micro_batches) == 1  # the copy did not move
    assert int(layer.stats.micro_batches) == 1
