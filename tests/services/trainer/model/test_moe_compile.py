"""The MoE block under torch.compile: one graph, no break, and the same numbers as eager.

Router, top-k, the token permutation, the expert GEMMs (on CPU the per-expert loop as one custom
op), the un-permutation and the statistics all trace into one graph, dropless and with a
capacity. Compiled runs use the `aot_eager` backend: it traces exactly what Inductor would be
given (Dynamo + AOT autograd) but runs the ATen ops as eager does, so outputs, gradients and
statistics are bit-identical on CPU and the comparisons use exact equality; Inductor would
reorder fp32 sums and only cost compile time here.
"""

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.fp8.experts import Fp8GroupedExperts
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.model.grouped_gemm import grouped_linear_loop, grouped_mm_loop
from meshtrain.services.trainer.model.moe import (
    MoE,
    expert_counts,
    moe_layers,
    route,
    set_moe_loss_scale,
)
from meshtrain.services.trainer.weight_copies import WeightCopies, call_with

CFG = dict(
    num_layers=2,
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
    moe_aux_loss_coeff=0.1,
    moe_z_loss_coeff=0.01,
    moe_router_enable_expert_bias=True,
    moe_shared_expert_intermediate_size=16,
    moe_shared_expert_gate=True,
)
CAPACITY = {"dropless": None, "capacity": 1.0}


def _block(capacity: float | None) -> MoE:
    torch.manual_seed(0)
    block = MoE(ModelConfig(**CFG, moe_expert_capacity_factor=capacity))
    for p in block.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    return block.train()


@pytest.mark.parametrize("capacity", list(CAPACITY))
def test_moe_block_traces_without_graph_breaks(capacity):
    block = _block(CAPACITY[capacity])
    x = torch.randn(2, 16, 32, requires_grad=True)
    explained = torch._dynamo.explain(block)(x)
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-experts"])
def test_fused_expert_gradients_keep_the_block_one_graph(fp8):
    """train.expert_gradient_accumulation_fusion: the backward's per-expert accumulation (the
    counts read on the host) is a custom op inside the graph, so the block on its weight copies
    traces as one graph with no break, compiles with fullgraph, and adds into the fp32 .grads
    what eager adds (aot_eager: the same ops, so equal)."""
    torch._dynamo.reset()
    grads = []
    for compiled in (False, True):
        block = _block(None)
        if fp8:
            block.experts.__class__ = Fp8GroupedExperts
            block.experts.make_fp8(0)
        copies = WeightCopies(block, torch.bfloat16, fuse_expert_weight_grads=True)
        run = functools.partial(call_with, block)
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16):
            if compiled:
                explained = torch._dynamo.explain(run)(copies.copies, x)
                reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
                assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons
                run = torch.compile(run, backend="aot_eager", fullgraph=True)
            run(copies.copies, x).float().square().sum().backward()
        assert copies.copies["experts.fc1.weight"].grad is None  # added into the fp32 .grad
        grads.append([block.experts.fc1.weight.grad, block.experts.fc2.weight.grad])
    for eager, compiled_grad in zip(*grads):
        assert eager.abs().sum() > 0 and torch.equal(eager, compiled_grad)


@pytest.mark.parametrize("capacity", list(CAPACITY))
def test_compiled_moe_block_matches_eager(capacity):
    """Outputs, input and parameter gradients and the routing statistics over two forwards."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        block = _block(CAPACITY[capacity])
        run = torch.compile(block, backend="aot_eager", fullgraph=True) if compiled else block
        gen = torch.Generator().manual_seed(1)
        outs, x_grads = [], []
        for _ in range(2):
            x = torch.randn(2, 16, 32, generator=gen, requires_grad=True)
            y = run(x)
            (y * torch.randn(y.shape, generator=gen)).sum().backward()
            outs.append(y.detach())
            x_grads.append(x.grad)
        grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
        stats = block.reset_stats()
        results.append((outs, x_grads, grads, stats))
    (eo, ex, eg, es), (co, cx, cg, cs) = results
    assert all(torch.equal(a, b) for a, b in zip(eo + ex, co + cx))
    assert eg.keys() == cg.keys() and "experts.fc1.weight" in eg
    assert all(torch.equal(eg[n], cg[n]) for n in eg), [
        n for n in eg if not torch.equal(eg[n], cg[n])
    ]
    for field in ("tokens_per_expert", "routed_per_expert", "aux_loss", "z_loss", "micro_batches"):
        assert torch.equal(getattr(es, field), getattr(cs, field)), field
    assert int(cs.micro_batches) == 2 and int(cs.routed_per_expert.sum()) == 2 * 2 * 16 * 2
    if capacity == "capacity":
        assert cs.tokens_per_expert.sum() < cs.routed_per_expert.sum()  # some choices dropped


@pytest.mark.slow
def test_compiled_model_under_full_recompute_counts_each_forward_once():
    """Blocks compiled one by one (as with a pipeline or FSDP2) and recomputed by a checkpoint
    around them: the compiled block rerun in backward must see that it is a rerun at run time,
    so the statistics match an eager run without recompute, and it must not recompile when the
    statistics are reset between steps."""
    torch._dynamo.reset()

    def steps(compile_blocks: bool):
        torch.manual_seed(0)
        model = GPT(ModelConfig(**CFG))
        set_moe_loss_scale(model, 0.5)
        if compile_blocks:
            model.recompute_layers, model.recompute_chunk = frozenset({0, 1}), 1
            for layer in model.layers:
                layer.compile(backend="aot_eager", fullgraph=True)
        gen = torch.Generator().manual_seed(1)
        stats, graphs = [], []
        for _ in range(2):  # two steps of two micro-batches each
            for _ in range(2):
                tokens = torch.randint(0, 96, (2, 16), generator=gen)
                (model(tokens, tokens.roll(-1, 1)) * 0.5).backward()
            stats.append([m.reset_stats() for _, m in moe_layers(model)])
            graphs.append(counters["stats"]["unique_graphs"])
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return stats, grads, graphs

    ref_stats, ref_grads, _ = steps(False)
    counters.clear()
    stats, grads, graphs = steps(True)
    assert graphs[0] >= 1 and graphs[1] == graphs[0]  # the second step compiled nothing new
    for ref_step, step in zip(ref_stats, stats):
        for ref, got in zip(ref_step, step):
            assert int(got.micro_batches) == 2
            assert torch.equal(ref.tokens_per_expert, got.tokens_per_expert)
            assert torch.allclose(ref.aux_loss, got.aux_loss) and torch.allclose(
                ref.z_loss, got.z_loss
            )
    for n in ref_grads:  # recompute under compile trains as eager does
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_grouped_mm_loop_matches_the_loop_reference():
    """The custom op (forward and both gradients) against plain autograd through the loop, with
    an expert that gets no rows, odd sizes, and rows past the counts (zero, no gradient)."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(11, 7, generator=gen, requires_grad=True)  # rows 9, 10: past the counts
    w = torch.randn(4, 5, 7, generator=gen, requires_grad=True)
    g = torch.randn(11, 5, generator=gen)
    out = grouped_mm_loop(x, w, counts)
    (out * g).sum().backward()
    xr, wr = x.detach()[:9].requires_grad_(), w.detach().clone().requires_grad_()
    ref = grouped_linear_loop(xr, wr, counts)
    (ref * g[:9]).sum().backward()
    assert torch.equal(out[:9], ref) and not out[9:].any()
    assert torch.equal(x.grad[:9], xr.grad) and not x.grad[9:].any()
    torch.testing.assert_close(w.grad, wr.grad)
    assert not w.grad[1].any()
    torch.library.opcheck(grouped_mm_loop, (x.detach(), w.detach(), counts))


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_routing_keeps_what_the_policy_says(policy):
    """Per (sequence, expert): the `capacity` highest-weighted (probs) or earliest (position)
    choices are kept, in expert-major token order, and the dropped ones come after them."""
    gen = torch.Generator().manual_seed(3)
    t, k, e, seq, cap = 24, 2, 4, 8, 3
    experts = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    r = route(experts, weights, e, cap, policy, seq)
    flat, w = experts.reshape(-1).tolist(), weights.reshape(-1).tolist()
    kept = set()
    for s in range(t // seq):
        for ex in range(e):
            mine = [i for i in range(s * seq * k, (s + 1) * seq * k) if flat[i] == ex]
            if policy == "probs":
                mine.sort(key=lambda i: -w[i])
            kept |= set(mine[:cap])
    want = sorted(kept, key=lambda i: (flat[i], i))
    n = int(r.counts.sum())
    assert r.order[:n].tolist() == want
    assert sorted(r.order[n:].tolist()) == sorted(set(range(t * k)) - kept)
    assert torch.equal(r.counts, expert_counts(experts.reshape(-1)[r.order[:n]], e))
    assert torch.equal(r.routed, torch.bincount(experts.reshape(-1), minlength=e))
