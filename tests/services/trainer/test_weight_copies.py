"""bf16 weight copies (train.bf16_weight_copies) train exactly as bf16 autocast of the fp32 weights;
with train.gradient_accumulation_fusion their weight gradients go straight into the fp32 .grads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.model.main_grad import accumulate_weight_grad
from meshtrain.services.trainer.train import Trainer
from meshtrain.services.trainer.weight_copies import (
    MainGradLinear,
    WeightCopies,
    call_with,
)
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.fp8.moe_jobs import MOE_MODEL

LLAMA = {
    "model.normalization": "rmsnorm",
    "model.activation": "swiglu",
    "model.position_embedding_type": "rope",
    "model.num_query_groups": 2,
    "model.add_bias_linear": False,
    "model.untie_embeddings_and_output_weights": True,
}


def _train(
    corpus_cache, run_dir, steps: int, **extra
) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    """(losses, final fp32 parameters, trainer) of `steps` bf16 steps of two micro-batches each
    (the job is planned for one step more)."""
    args = small_job_args(
        corpus_cache,
        run_dir,
        **{"train.bf16": True, "train.eval_interval": 0, "train.train_iters": steps + 1, **extra},
    )
    trainer = Trainer(load_config(args))
    losses = [trainer.train_step(step)[0].item() for step in range(steps)]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


@pytest.mark.parametrize(
    "arch",
    [
        {},
        LLAMA,
        dict(
            LLAMA, **{"parallel.recompute_granularity": "full"}
        ),  # the recomputed forward casts the fp32 weights
        dict(LLAMA, **MOE_MODEL),  # the stacked expert weights are copied too
        dict(LLAMA, **MOE_MODEL, **{"parallel.recompute_granularity": "full"}),
    ],
    ids=["gpt2", "llama", "llama-recompute", "moe", "moe-recompute"],
)
def test_copies_train_bit_for_bit_like_autocast(arch, corpus_cache, tmp_path):
    """Eager on CPU the values are autocast's exactly: the same bf16 weights, and each bf16
    gradient added to an fp32 sum equals adding its exact fp32 cast."""
    losses, params, plain = _train(
        corpus_cache, tmp_path / "a", 6, **arch, **{"train.bf16_weight_copies": False}
    )
    losses_c, params_c, trainer = _train(
        corpus_cache, tmp_path / "b", 6, **arch
    )  # on by default here
    assert plain.weight_copies is None
    assert trainer.weight_copies is not None and trainer.weight_copies.numel() > 0
    stacked = [n for n in params if ".experts.fc" in n]
    assert set(stacked) <= set(trainer.weight_copies.copies)
    assert bool(stacked) == ("model.num_experts" in arch)
    assert losses[-1] < losses[0]
    assert losses_c == losses
    for name, p in params.items():
        assert params_c[name].dtype == torch.float32
        assert torch.equal(params_c[name], p), name


# Inductor on CPU compiles two models: a minute (the GPU tests compile on every run)
@pytest.mark.slow
def test_compiled_copies_train_like_compiled_autocast(corpus_cache, tmp_path):
    """Compiled (Inductor on CPU), the copies are graph inputs; its fusions may round a little
    differently from the autocast graph's, so a bf16 tolerance."""
    extra = dict(LLAMA, **{"train.compile": True})
    losses, params, _ = _train(
        corpus_cache, tmp_path / "a", 4, **extra, **{"train.bf16_weight_copies": False}
    )
    torch._dynamo.reset()
    losses_c, params_c, _ = _train(
        corpus_cache, tmp_path / "b", 4, **extra, **{"train.bf16_weight_copies": True}
    )
    torch._dynamo.reset()
    assert losses_c == pytest.approx(losses, rel=1e-3)
    for name, p in params.items():
        torch.testing.assert_close(params_c[name], p, rtol=1e-2, atol=1e-3, msg=name)


def test_a_step_refreshes_the_copies_from_the_updated_parameters(corpus_cache, tmp_path):
    _, _, trainer = _train(corpus_cache, tmp_path, 2)
    copies = trainer.weight_copies.copies
    weight = trainer.model.layers[0].mlp.fc1.weight
    assert all(c.grad is None for c in copies.values())  # each gradient went into an fp32 .grad
    # cast at step 1's start: step 1's update is not in them yet
    assert not torch.equal(copies["layers.0.mlp.fc1.weight"], weight.detach().to(torch.bfloat16))
    before = weight.detach().clone()
    trainer.train_step(2)
    assert torch.equal(
        copies["layers.0.mlp.fc1.weight"], before.to(torch.bfloat16)
    )  # cast at step 2's start
    assert not torch.equal(weight, before)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.b(self.norm(self.a(x))).sum()


def test_one_copy_per_parameter_and_only_linear_parameters():
    torch.manual_seed(0)
    model = _Tied()
    copies = WeightCopies(model, torch.bfloat16)
    assert set(copies.copies) == {"a.weight", "a.bias", "b.weight"}
    assert copies.copies["a.weight"] is copies.copies["b.weight"]
    assert copies.numel() == 16 + 4
    assert all(c.dtype == torch.bfloat16 and c.is_leaf for c in copies.copies.values())


def test_gradients_accumulate_in_fp32_across_calls():
    """Two backward passes: the fp32 .grad is the fp32 sum of the copies' bf16 gradients."""
    torch.manual_seed(0)
    model = _Tied()
    copies = WeightCopies(model, torch.bfloat16)
    xs = [torch.randn(3, 4) for _ in range(2)]
    grads = []
    for x in xs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = call_with(model, copies.copies, x)
        loss.backward()
        grads.append(model.a.weight.grad.clone())
    assert model.a.weight.grad.dtype == torch.float32
    assert copies.copies["a.weight"].grad is None
    assert (
        model.norm.weight.grad is not None
    )  # the non-copied parameters get their gradients as usual
    # the same two passes through autocast of the fp32 weights
    reference = _Tied()
    reference.load_state_dict(model.state_dict())
    for x in xs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference(x).backward()
    assert torch.equal(model.a.weight.grad, reference.a.weight.grad)
    assert not torch.equal(grads[0], grads[1])


@pytest.mark.parametrize(
    "arch",
    [
        {},
        # untied output layer: its weight reaches the loss without the linear's forward
        # (the hook's path)
        LLAMA,
        dict(
            LLAMA, **{"parallel.recompute_granularity": "full"}
        ),  # the recomputed forward runs the fused linears again
    ],
    ids=["gpt2", "llama", "llama-recompute"],
)
def test_fused_gradient_accumulation_trains_like_the_copies_hooks(arch, corpus_cache, tmp_path):
    """train.gradient_accumulation_fusion: the same training as the hooks' bf16 gradients, to
    within the bf16 rounding of each micro-batch's gradient that it no longer does."""
    losses, params, hooks = _train(corpus_cache, tmp_path / "a", 6, **arch)  # unset: on CUDA only
    losses_f, params_f, fused = _train(
        corpus_cache, tmp_path / "b", 6, **arch, **{"train.gradient_accumulation_fusion": True}
    )
    assert not hooks.weight_copies.fused and fused.weight_copies.fused
    assert isinstance(fused.model.layers[0].mlp.fc1, MainGradLinear)
    assert set(fused.model.state_dict()) == set(hooks.model.state_dict())
    assert all(c.grad is None for c in fused.weight_copies.copies.values())
    assert losses_f[-1] < losses_f[0]
    assert losses_f == pytest.approx(losses, rel=2e-3)
    assert (
        losses_f[1:] != losses[1:]
    )  # the first step's loss is before any update; later ones differ
    # Adam moves an entry whose gradient is rounding noise (the keys' bias, which softmax
    # ignores; the embedding row of a byte the batches hardly hold) by lr-sized steps of either
    # sign, whichever way the noise falls: those may differ by up to Adam's largest steps (at
    # most about 3 lr each); every other entry agrees to bf16 rounding.
    adam_bound = 3 * fused.job.optim.lr * 6  # 6 steps at most at the peak rate
    for name, p in params.items():
        off = ~torch.isclose(params_f[name], p, rtol=1e-2, atol=2e-3)
        if not name.endswith("qkv.bias"):  # there every entry of the keys' part is such noise
            assert int(off.sum()) <= max(1, p.numel() // 1000), (name, int(off.sum()), p.numel())
        assert (params_f[name] - p).abs().max() <= adam_bound, name


# Inductor on CPU, twice; the uncompiled fused accumulation tests stay in the suite
@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_fused_gradient_accumulation_adds_in_place_without_recompiling(
    recompute, corpus_cache, tmp_path
):
    """Compiled (Inductor on CPU): the backward calls the op on the fp32 .grad itself (a copy of
    the gradient would cost what the fusion saves), and the .grads a step re-allocates after
    zero_grad(set_to_none=True) do not recompile the graph. With full recompute the compiled
    backward replays the forward itself; the op still runs once per linear."""
    from torch._inductor.utils import run_and_get_code

    extra = dict(
        LLAMA,
        **{
            "train.compile": True,
            "train.gradient_accumulation_fusion": True,
            "parallel.recompute_granularity": recompute,
        },
    )
    args = small_job_args(
        corpus_cache,
        tmp_path / "a",
        **{"train.bf16": True, "train.eval_interval": 0, "train.train_iters": 5, **extra},
    )
    torch._dynamo.reset()
    trainer = Trainer(load_config(args))
    first, codes = run_and_get_code(lambda: trainer.train_step(0)[0].item())
    backward = [c for c in codes if "accumulate_weight_grad" in c]
    assert backward, "no compiled graph calls the fused accumulation"
    calls = [
        line.strip()
        for c in backward
        for line in c.splitlines()
        if "ops.meshtrain.accumulate_weight_grad" in line
    ]
    linears = sum(isinstance(m, MainGradLinear) for m in trainer.model.layers.modules())
    assert linears == 2 * 4  # 2 layers x (qkv, proj, fc1, fc2); the output layer's weight
    # goes to the loss, not through its forward, so its gradient takes the copy's hook
    # Compiled whole, one backward holds both layers' calls; under full recompute each block is
    # compiled on its own, and the two (alike) blocks run one block's graph.
    assert len(calls) == (linears if recompute == "none" else linears // 2), calls
    assert all(c.split("(", 1)[1].startswith(("primals_", "arg")) for c in calls), (
        calls
    )  # a graph input: the .grad
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    losses = [first] + [trainer.train_step(step)[0].item() for step in range(1, 4)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert losses[-1] < losses[0]
    torch._dynamo.reset()


@pytest.mark.e2e
def test_a_fused_run_resumes_where_it_stopped(corpus_cache, tmp_path):
    """Evaluation and a checkpoint between steps, then a resume: the restored parameters get
    fresh copies and .grads, and the resumed losses equal the uninterrupted run's."""
    from meshtrain.services.trainer.train import train

    common = dict(
        LLAMA,
        **{
            "train.bf16": True,
            "train.gradient_accumulation_fusion": True,
            "train.train_iters": 4,
            "train.eval_interval": 2,
        },
    )
    full = train(
        load_config(
            small_job_args(
                corpus_cache, tmp_path / "full", **common, **{"checkpoint.save_interval": 2}
            )
        )
    )
    resumed = train(
        load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "resumed",
                **common,
                **{
                    "checkpoint.load": str(tmp_path / "full" / "checkpoints"),
                    "checkpoint.load_step": 2,
                },
            )
        )
    )
    assert sorted(resumed.losses) == [3, 4]
    assert [resumed.losses[s] for s in (3, 4)] == [full.losses[s] for s in (3, 4)]
    assert resumed.eval_losses[4] == full.eval_losses[4]
    assert full.losses[4] < full.losses[1]


def test_fused_accumulation_is_closer_to_exact_than_bf16_gradients():
    """Eight micro-batches into one fp32 .grad: the fused sums (no bf16 rounding per micro-batch)
    land nearer the exact sum than the hooks' bf16 gradients do. The loss makes each output's
    gradient a bf16 constant, so both paths multiply the same bf16 operands."""
    torch.manual_seed(0)
    xs = [torch.randn(256, 64) for _ in range(8)]
    cs = [torch.randn(256, 32).to(torch.bfloat16).float() for _ in range(8)]
    grads = {}
    for fuse in (False, True):
        torch.manual_seed(1)
        model = nn.Linear(64, 32, bias=False)
        copies = WeightCopies(model, torch.bfloat16, fuse_weight_grads=fuse)
        assert copies.fused == fuse and isinstance(model, MainGradLinear) == fuse
        for x, c in zip(xs, cs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = call_with(model, copies.copies, x)
            (y.float() * c).sum().backward()
        grads[fuse] = model.weight.grad.double()
    exact = sum(c.double().t() @ x.to(torch.bfloat16).double() for x, c in zip(xs, cs))
    err_hooks = (grads[False] - exact).abs().max().item()
    err_fused = (grads[True] - exact).abs().max().item()
    assert err_fused < err_hooks / 10, (err_fused, err_hooks)


def test_tied_fused_linears_both_add_into_the_one_gradient():
    """A weight shared by two linears: each use's backward adds into the same fp32 .grad (the
    second after the first has changed it, so the .grad is not a saved tensor)."""
    torch.manual_seed(0)
    xs = [torch.randn(16, 4) for _ in range(3)]
    grads = {}
    for fuse in (False, True):
        torch.manual_seed(1)
        model = _Tied()
        copies = WeightCopies(model, torch.bfloat16, fuse_weight_grads=fuse)
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                call_with(model, copies.copies, x).backward()
        grads[fuse] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=2e-2, atol=2e-2, msg=name)
    assert grads[True]["a.weight"].abs().sum() > 0


def test_accumulate_weight_grad_adds_over_every_leading_dimension():
    torch.manual_seed(0)
    dy, x = torch.randn(2, 5, 3), torch.randn(2, 5, 4)
    main = torch.randn(3, 4)
    want = main + torch.einsum("bso,bsi->oi", dy, x)
    ptr = main.data_ptr()
    accumulate_weight_grad(main, dy, x)
    torch.testing.assert_close(main, want)
    assert main.data_ptr() == ptr
    accumulate_weight_grad(
        main, dy.to(torch.bfloat16), x.to(torch.bfloat16)
    )  # widened to fp32 off CUDA
    torch.testing.assert_close(
        main, want + torch.einsum("bso,bsi->oi", dy.bfloat16().float(), x.bfloat16().float())
    )


def test_a_fused_linear_without_a_grad_to_add_into_says_so():
    model = nn.Linear(4, 4)
    copies = WeightCopies(model, torch.bfloat16, fuse_weight_grads=True)
    assert model.weight.grad is not None  # refresh() gave it one
    model.weight.grad = None
    with pytest.raises(RuntimeError, match="refresh"):
        call_with(model, copies.copies, torch.randn(2, 4))
    assert model(torch.randn(2, 4)).dtype == torch.float32  # on its own fp32 weight: nn.Linear
    copies.refresh()
    call_with(model, copies.copies, torch.randn(2, 4)).sum().backward()
    assert model.weight.grad.abs().sum() > 0


def test_gradient_accumulation_fusion_needs_the_copies(corpus_cache, tmp_path):
    with pytest.raises(ConfigError, match="gradient_accumulation_fusion"):
        load_config(["--gradient-accumulation-fusion"])  # fp32
    with pytest.raises(ConfigError, match="bf16_weight_copies left on"):
        load_config(
            ["--bf16", "--gradient-accumulation-fusion", "--train.bf16_weight_copies=false"]
        )
    assert (
        load_config(
            ["--bf16", "--no-gradient-accumulation-fusion"]
        ).train.gradient_accumulation_fusion
        is False
    )
    assert (
        load_config(["--bf16"]).train.gradient_accumulation_fusion is None
    )  # the Trainer picks: CUDA or not


def test_a_model_without_wide_linear_parameters_is_refused():
    with pytest.raises(ValueError, match="no nn.Linear"):
        WeightCopies(nn.Sequential(nn.LayerNorm(4)), torch.bfloat16)
    with pytest.raises(ValueError, match="wider than"):
        WeightCopies(nn.Linear(4, 4).to(torch.bfloat16), torch.bfloat16)


def test_copies_need_bf16_and_are_off_without_it(corpus_cache, tmp_path):
    with pytest.raises(ConfigError, match="needs train.bf16=true"):
        load_config(["--train.bf16_weight_copies=true"])
    trainer = Trainer(load_config(small_job_args(corpus_cache, tmp_path)))  # fp32: nothing to copy
    assert trainer.weight_copies is None


def _build(rank, world, args, ask):
    """(whether the unset option took copies, the error asking for them with `ask` gives)."""
    took = Trainer(load_config(args)).weight_copies is not None
    try:
        Trainer(load_config(args + [ask]))
    except ConfigError as e:
        return took, str(e)
    return took, None


@pytest.mark.dist
def test_copies_are_off_with_several_ranks_and_refused_when_asked_for(corpus_cache, tmp_path):
    args = small_job_args(corpus_cache, tmp_path, **{"train.bf16": True})
    results = run_ranks(_build, 2, args, "--train.bf16_weight_copies=true")
    assert all(not took for took, _ in results), results
    assert all(e is not None and "single process" in e and "dp=2" in e for _, e in results), results
    results = run_ranks(_build, 2, args, "--gradient-accumulation-fusion")
    assert all(e is not None and "2 ranks" in e and "single process" in e for _, e in results), (
        results
    )
