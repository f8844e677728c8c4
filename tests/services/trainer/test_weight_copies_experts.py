"""train.expert_gradient_accumulation_fusion: the experts' weight gradients added into the fp32
.grads per expert GEMM train as the weight copies' hooks do (to the bf16 rounding of each
micro-batch's expert gradient that it no longer does), and where it cannot run it is refused."""

from __future__ import annotations

import pytest
import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.fp8.experts import Fp8GroupedExperts
from meshtrain.services.trainer.train import Trainer
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.fp8.moe_jobs import MOE_MODEL
from tests.services.trainer.test_weight_copies import _train as train_bf16

FUSION = "train.expert_gradient_accumulation_fusion"
FP8_EXPERTS = {"train.fp8": "hybrid", "train.fp8_recipe": "tensorwise", "train.fp8_experts": True}


def _train(corpus_cache, run_dir, steps: int, **extra):
    """`test_weight_copies._train` of the small MoE job on grouped GEMMs."""
    return train_bf16(
        corpus_cache, run_dir, steps, **{**MOE_MODEL, "model.moe_grouped_gemm": True, **extra}
    )


@pytest.mark.parametrize(
    "arch",
    [
        {},
        FP8_EXPERTS,
        {"parallel.recompute_granularity": "full"},  # the rerun forward on the fp32 weights
        {"parallel.recompute_granularity": "selective"},
    ],
    ids=["bf16", "fp8-experts", "recompute-full", "recompute-selective"],
)
def test_fused_expert_gradients_train_like_the_copies_hooks(arch, corpus_cache, tmp_path):
    """Losses to 2e-3 relative and parameters to bf16 rounding (an entry whose gradient is
    rounding noise may take Adam steps of the other sign: bounded by Adam's largest steps)."""
    steps = 5
    losses, params, hooks = _train(corpus_cache, tmp_path / "a", steps, **arch)
    losses_f, params_f, fused = _train(
        corpus_cache, tmp_path / "b", steps, **arch, **{FUSION: True}
    )
    experts = fused.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8GroupedExperts) == ("train.fp8" in arch)
    assert experts.fc1.main_weight is not None
    assert hooks.model.layers[0].mlp.experts.fc1.main_weight is None
    assert all(c.grad is None for c in fused.weight_copies.copies.values())
    assert losses_f[-1] < losses_f[0]
    assert losses_f == pytest.approx(losses, rel=2e-3)
    assert losses_f[1:] != losses[1:]  # the expert gradients were summed differently
    adam_bound = 3 * fused.job.optim.lr * steps
    for name, p in params.items():
        off = ~torch.isclose(params_f[name], p, rtol=1e-2, atol=2e-3)
        assert int(off.sum()) <= max(1, p.numel() // 1000), (name, int(off.sum()), p.numel())
        assert (params_f[name] - p).abs().max() <= adam_bound, name


# Inductor on CPU; the uncompiled fused expert tests stay in the suite
@pytest.mark.slow
def test_compiled_fused_expert_gradients_add_into_the_grads_without_recompiling(
    corpus_cache, tmp_path
):
    """Compiled (Inductor on CPU): the backward calls the experts' op on each fp32 .grad itself,
    once per expert projection (a copy of the gradient would cost what the fusion saves), and
    the .grads re-allocated each step do not recompile the graph."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    args = small_job_args(
        corpus_cache,
        tmp_path,
        **{
            **MOE_MODEL,
            "model.moe_grouped_gemm": True,
            "train.bf16": True,
            "train.compile": True,
            "train.eval_interval": 0,
            "train.train_iters": 4,
            FUSION: True,
        },
    )
    trainer = Trainer(load_config(args))
    first, codes = run_and_get_code(lambda: trainer.train_step(0)[0].item())
    op = "ops.meshtrain.accumulate_expert_weight_grads"
    calls = [line.strip() for c in codes for line in c.splitlines() if op in line]
    assert len(calls) == 2 * 2, calls  # 2 MoE layers x (fc1, fc2)
    # a graph input: the .grad
    assert all(c.split("(", 1)[1].startswith(("primals_", "arg")) for c in calls), calls
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    losses = [first] + [trainer.train_step(step)[0].item() for step in range(1, 3)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert losses[-1] < losses[0]
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "extra, keys",
    [
        ({}, "model.num_experts"),  # a dense model
        ({**MOE_MODEL, "model.moe_grouped_gemm": False}, "model.moe_grouped_gemm"),
        ({**MOE_MODEL, "train.bf16": False}, "train.bf16"),
        ({**MOE_MODEL, "train.bf16_weight_copies": False}, "train.bf16_weight_copies"),
        ({**MOE_MODEL, "parallel.ep": 2}, "single process"),
        ({**MOE_MODEL, "train.cuda_graph": True, "train.device": "cuda"}, "train.cuda_graph"),
    ],
    ids=["dense", "no-grouped-gemm", "fp32", "copies-off", "ep2", "cuda-graph"],
)
def test_expert_fusion_is_refused_where_it_cannot_run(extra, keys, corpus_cache, tmp_path):
    base = {"model.moe_grouped_gemm": True, "train.bf16": True, FUSION: True}
    args = small_job_args(corpus_cache, tmp_path, **{**base, **extra})
    with pytest.raises(ConfigError, match=FUSION) as refused:
        load_config(args)
    assert keys in str(refused.value)


def test_expert_fusion_is_off_by_default():
    assert load_config(["--bf16"]).train.expert_gradient_accumulation_fusion is False


def _build(rank, world, args):
    """The error building a trainer with `args` gives on this rank (None: it built)."""
    try:
        Trainer(load_config(args))
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_expert_fusion_is_refused_with_several_data_parallel_ranks(corpus_cache, tmp_path):
    args = small_job_args(
        corpus_cache,
        tmp_path,
        **{**MOE_MODEL, "model.moe_grouped_gemm": True, "train.bf16": True, FUSION: True},
    )
    errors = run_ranks(_build, 2, args)
    assert all(e is not None and FUSION in e and "2 ranks" in e for e in errors), errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", [{}, FP8_EXPERTS], ids=["bf16", "fp8-experts"])
def test_fused_expert_gradients_train_like_the_copies_hooks_on_cuda(arch, corpus_cache, tmp_path):
    """Compiled in bf16 on CUDA (grouped GEMMs where the card runs them, the fused sums through
    cuBLAS): the losses follow the run whose expert copies' bf16 gradients a hook adds (1e-2: the
    bf16 rounding of each micro-batch's expert gradient, which the fused run no longer does,
    compounds over the steps)."""
    cuda = {**arch, "train.device": "cuda", "train.compile": True}
    steps = 10
    torch._dynamo.reset()
    losses, _, _ = _train(corpus_cache, tmp_path / "a", steps, **cuda)
    torch._dynamo.reset()
    losses_f, _, fused = _train(corpus_cache, tmp_path / "b", steps, **cuda, **{FUSION: True})
    assert fused.model.layers[0].mlp.experts.fc1.main_weight is not None
    assert losses_f[-1] < losses_f[0] - 0.5
    assert losses_f == pytest.approx(losses, rel=1e-2)
