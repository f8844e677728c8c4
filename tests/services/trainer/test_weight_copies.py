"""bf16 weight copies (train.bf16_weight_copies) train exactly as bf16 autocast of the fp32 weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.common.errors import ConfigError
from services.trainer.config import load_config
from services.trainer.train import Trainer
from services.trainer.weight_copies import WeightCopies, call_with
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args

LLAMA = {"model.normalization": "rmsnorm", "model.activation": "swiglu", "model.position_embedding_type": "rope",
         "model.num_query_groups": 2, "model.add_bias_linear": False, "model.untie_embeddings_and_output_weights": True}


def _train(corpus_cache, run_dir, steps: int, **extra) -> tuple[list[float], dict[str, torch.Tensor], Trainer]:
    """(losses, final fp32 parameters, trainer) of `steps` bf16 steps of two micro-batches each
    (the job is planned for one step more)."""
    args = small_job_args(corpus_cache, run_dir, **{"train.bf16": True, "train.eval_interval": 0,
                                                    "train.train_iters": steps + 1, **extra})
    trainer = Trainer(load_config(args))
    losses = [trainer.train_step(step)[0].item() for step in range(steps)]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


@pytest.mark.parametrize("arch", [
    {},
    LLAMA,
    dict(LLAMA, **{"parallel.recompute_granularity": "full"}),  # the recomputed forward casts the fp32 weights
], ids=["gpt2", "llama", "llama-recompute"])
def test_copies_train_bit_for_bit_like_autocast(arch, corpus_cache, tmp_path):
    """Eager on CPU the values are autocast's exactly: the same bf16 weights, and each bf16
    gradient added to an fp32 sum equals adding its exact fp32 cast."""
    losses, params, plain = _train(corpus_cache, tmp_path / "a", 6, **arch, **{"train.bf16_weight_copies": False})
    losses_c, params_c, trainer = _train(corpus_cache, tmp_path / "b", 6, **arch)  # on by default here
    assert plain.weight_copies is None
    assert trainer.weight_copies is not None and trainer.weight_copies.numel() > 0
    assert losses[-1] < losses[0]
    assert losses_c == losses
    for name, p in params.items():
        assert params_c[name].dtype == torch.float32
        assert torch.equal(params_c[name], p), name


def test_compiled_copies_train_like_compiled_autocast(corpus_cache, tmp_path):
    """Compiled (Inductor on CPU), the copies are graph inputs; its fusions may round a little
    differently from the autocast graph's, so a bf16 tolerance."""
    extra = dict(LLAMA, **{"train.compile": True})
    losses, params, _ = _train(corpus_cache, tmp_path / "a", 4, **extra, **{"train.bf16_weight_copies": False})
    torch._dynamo.reset()
    losses_c, params_c, _ = _train(corpus_cache, tmp_path / "b", 4, **extra, **{"train.bf16_weight_copies": True})
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
    assert torch.equal(copies["layers.0.mlp.fc1.weight"], before.to(torch.bfloat16))  # cast at step 2's start
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
    assert model.norm.weight.grad is not None  # the non-copied parameters get their gradients as usual
    # the same two passes through autocast of the fp32 weights
    reference = _Tied()
    reference.load_state_dict(model.state_dict())
    for x in xs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference(x).backward()
    assert torch.equal(model.a.weight.grad, reference.a.weight.grad)
    assert not torch.equal(grads[0], grads[1])


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


def _build(rank, world, args):
    """(whether the unset option took copies, the error asking for them gives)."""
    took = Trainer(load_config(args)).weight_copies is not None
    try:
        Trainer(load_config(args + ["--train.bf16_weight_copies=true"]))
    except ConfigError as e:
        return took, str(e)
    return took, None


@pytest.mark.dist
def test_copies_are_off_with_several_ranks_and_refused_when_asked_for(corpus_cache, tmp_path):
    args = small_job_args(corpus_cache, tmp_path, **{"train.bf16": True})
    results = run_ranks(_build, 2, args)
    assert all(not took for took, _ in results), results
    assert all(e is not None and "single process" in e and "dp=2" in e for _, e in results), results
