"""FP8 expert weights quantized once per optimizer step (`Fp8WeightCache` with
`Fp8GroupedExperts`): the buffers it fills, what the layer does with them, which runs get a
cache, and training through the Trainer bit for bit equal to quantizing in every micro-batch."""

import torch

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.fp8 import Recipe, apply_fp8
from meshtrain.services.trainer.fp8.experts import (
    FP8_EXPERT_BUFFERS,
    Fp8GroupedExperts,
    fp8_grouped_linear,
    quantize_rows,
    quantize_weight,
)
from meshtrain.services.trainer.fp8.scaling import E4M3
from meshtrain.services.trainer.fp8.weights import Fp8WeightCache
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.train import Trainer
from meshtrain.services.trainer.weight_copies import WeightCopies, call_with
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.fp8.moe_jobs import MOE_MODEL
from tests.services.trainer.fp8.test_fp8_experts import MOE

EXPERTS = ["layers.0.mlp.experts", "layers.2.mlp.experts", "layers.3.mlp.experts"]


def _model(recipe: Recipe, experts: bool = True):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**MOE))
    handle = apply_fp8(model, recipe, Mesh.single(), experts=experts)
    return model, handle


def test_rowwise_dense_with_experts_caches_the_experts_only():
    model, handle = _model(Recipe("e4m3", "rowwise"))
    cache = Fp8WeightCache.for_run(model, handle)
    assert cache is not None
    assert set(cache.entries) == {f"{m}.{b}" for m in EXPERTS for b in FP8_EXPERT_BUFFERS}
    # without the experts rowwise keeps no cache, as before
    model, handle = _model(Recipe("e4m3", "rowwise"), experts=False)
    assert Fp8WeightCache.for_run(model, handle) is None
    # a per-tensor dense recipe: the dense layers' three entries each, and the experts'
    model, handle = _model(Recipe("hybrid", "tensorwise"))
    cache = Fp8WeightCache.for_run(model, handle)
    assert cache is not None
    dense = [n for n in cache.entries if ".fp8_weight" in n and ".mlp.experts." not in n]
    assert len(dense) == 3 * len(handle.layers)
    assert len(cache.entries) == len(dense) + len(EXPERTS) * len(FP8_EXPERT_BUFFERS)


def test_refresh_fills_the_expert_buffers_with_the_quantized_weights_and_adds_no_state():
    model, handle = _model(Recipe("e4m3", "rowwise"))
    keys = set(model.state_dict())
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:  # rows of very different sizes: per-row factors matter
            p.data.mul_(torch.rand(p.shape[:-1]).unsqueeze(-1) * 4)
    copies = WeightCopies(model, torch.bfloat16)
    cache = Fp8WeightCache.for_run(model, handle)
    assert cache is not None
    cache.refresh(copies.copies)
    params = dict(model.named_parameters())
    for m in EXPERTS:
        for i, fc in enumerate(("fc1", "fc2")):
            w = copies.copies.get(f"{m}.{fc}.weight", params[f"{m}.{fc}.weight"])
            wb = w.to(torch.bfloat16)
            g, n, k = wb.shape
            want = (*quantize_rows(wb), *quantize_rows(wb.transpose(1, 2).contiguous()))
            names = FP8_EXPERT_BUFFERS[4 * i : 4 * i + 4]
            got = [cache.entries[f"{m}.{b}"] for b in names]
            assert [t.shape for t in got] == [(g, n, k), (g, n), (g, k, n), (g, k)]
            assert [t.dtype for t in got] == [E4M3, torch.float32, E4M3, torch.float32]
            assert got[2].is_contiguous()
            for b, a, e in zip(names, got, want, strict=True):
                assert torch.equal(
                    a.view(torch.uint8) if a.dtype == E4M3 else a,
                    e.view(torch.uint8) if e.dtype == E4M3 else e,
                ), (m, b)
    assert set(model.state_dict()) == keys
    for m in EXPERTS:  # the layers' own buffers stay empty: the cache's come in by name
        experts = model.get_submodule(m)
        assert all(getattr(experts, b).numel() == 0 for b in FP8_EXPERT_BUFFERS)


def test_the_model_on_the_cache_gives_the_uncached_loss_and_gradients():
    """The same forward and gradients on the copies with and without the cache's entries, and
    with the entries spoiled a different loss (the layers really read them)."""
    model, handle = _model(Recipe("hybrid", "tensorwise"))
    copies = WeightCopies(model, torch.bfloat16)
    cache = Fp8WeightCache.for_run(model, handle)
    assert cache is not None
    cache.refresh(copies.copies)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    results = []
    for entries in (copies.copies, {**copies.copies, **cache.entries}):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = call_with(model, entries, tokens[:, :-1], tokens[:, 1:]).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (cached, cached_grads) = results
    assert torch.equal(plain, cached)
    assert plain_grads.keys() == cached_grads.keys()
    for name in plain_grads:
        assert torch.equal(plain_grads[name], cached_grads[name]), name
    spoiled = {**copies.copies, **cache.entries}
    spoiled[f"{EXPERTS[0]}.fp8_fc1_weight_inv"] = (
        cache.entries[f"{EXPERTS[0]}.fp8_fc1_weight_inv"] * 2
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        other = call_with(model, spoiled, tokens[:, :-1], tokens[:, 1:]).float().mean()
    assert not torch.equal(other, plain)


def test_backward_keeps_the_quantized_transpose_and_no_bf16_weight():
    """Saved for backward, cached or not: x, the counts and Wᵀ's quantization (G, K, N) with its
    factors, never the weight's bf16 cast (G, N, K); the same shapes and dtypes both ways (what
    activation recompute checks between the cached forward and its uncached rerun). Under
    no_grad no graph is kept."""
    torch.manual_seed(0)
    x = torch.randn(12, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, 48, 32) * 0.1).requires_grad_(True)
    counts = torch.tensor([3, 0, 5, 4])
    saved_by = []
    for quantized in (None, quantize_weight(w.detach())):
        saved: list = []

        def pack(t, saved=saved):
            saved.append((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fp8_grouped_linear(x, w, counts, grouped=True, quantized=quantized)
        y.float().sum().backward()
        assert ((4, 48, 32), torch.bfloat16) not in saved, saved
        assert ((4, 32, 48), E4M3) in saved and ((4, 32), torch.float32) in saved, saved
        saved_by.append(saved)
    assert saved_by[0] == saved_by[1]
    with torch.no_grad():
        assert fp8_grouped_linear(x, w, counts, grouped=True).grad_fn is None


def _moe_job(tmp_path, corpus_cache, name, **extra):
    return load_config(
        small_job_args(
            corpus_cache,
            tmp_path / name,
            **{
                **MOE_MODEL,
                "train.bf16": True,
                "train.bf16_weight_copies": True,
                "train.fp8": "hybrid",
                "train.fp8_experts": True,
                "train.eval_interval": 0,
                "train.train_iters": 3,
                **extra,
            },
        )
    )


def test_experts_quantized_once_a_step_train_as_quantized_in_every_micro_batch(
    corpus_cache, tmp_path, monkeypatch
):
    """Two micro-batches a step, 3 steps: the cache's expert entries against a cache without
    them (each expert layer quantizes its weight in every forward and backward), and the cache
    under full recompute (the rerun forward, outside the copies, quantizes in the layer): the same
    losses and final parameters, bit for bit."""
    runs = []
    for name, extra in (
        ("cached", {}),
        ("recompute", {"parallel.recompute_granularity": "full"}),
        ("uncached", {}),
    ):
        if name == "uncached":
            monkeypatch.setattr(Fp8WeightCache, "_add_experts", lambda self, name, experts: None)
        trainer = Trainer(_moe_job(tmp_path, corpus_cache, name, **extra))
        assert trainer.weight_copies is not None and trainer.fp8_weights is not None
        experts = [n for n, m in trainer.model.named_modules() if isinstance(m, Fp8GroupedExperts)]
        assert len(experts) == 2
        cached = [n for n in trainer.fp8_weights.entries if ".mlp.experts." in n]
        assert len(cached) == (0 if name == "uncached" else 16)
        losses = [trainer.train_step(step)[0].item() for step in range(3)]
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.release_run_dir()
        runs.append((name, losses, params))
    _, ref_losses, ref_params = runs[-1]
    for name, losses, params in runs[:-1]:
        assert losses == ref_losses, name
        for p_name, p in params.items():
            assert torch.equal(p, ref_params[p_name]), (name, p_name)
    assert ref_losses[-1] != ref_losses[0]  # it trained
