"""bf16 device parameters under the offloaded optimizer (optim.offload_bf16_params,
services/trainer/optim/main_grads.py): a step equals fused CPU AdamW on fp32 masters, computed
here by hand from the micro-batches' bf16 gradients summed in fp32, then rounded to bf16, bit
for bit; checkpoints hold the fp32 masters and a resume from one gives the uninterrupted
losses; dp2 + ZeRO-1 equals plain dp2.

Every comparison is exact: both sides run the same CPU kernels on the same values (the fused
CPU AdamW, bf16 rounding to nearest even on the host and in the model's casts alike).
"""

from __future__ import annotations

import copy

import pytest
import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.optim.main_grads import grad_of
from meshtrain.services.trainer.optim.offload import OffloadedAdamW
from meshtrain.services.trainer.optim.optimizer import build_optimizer, is_decayed, set_lr

CFG = ModelConfig(vocab_size=97, num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16)


def _micro_batches(n: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (4, 17), generator=gen) for _ in range(n)]


def _backward(model: GPT, tokens: torch.Tensor, n: int) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:], None) / n
    loss.backward()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_equals_fp32_master_adamw_on_fp32_summed_grads(overlap):
    torch.manual_seed(0)
    model = GPT(CFG)
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the reference model: the same weights rounded to bf16, gradients kept per micro-batch
    ref = copy.deepcopy(model).to(torch.bfloat16)
    config = OptimConfig(
        lr=1e-2,
        weight_decay=0.1,
        optimizer_cpu_offload=True,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        cpu_offload_chunk_numel=3000,
    )
    opt = build_optimizer(model, config, bf16_params=True)
    assert isinstance(opt, OffloadedAdamW) and opt.bf16_params
    assert len(opt.chunks) > 3 if overlap else len(opt.chunks) == 1
    names = {p: n for n, p in model.named_parameters()}
    for p, m in opt.master_of.items():  # fp32 masters on the host, bf16 on the device
        assert p.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32
        assert m.dtype == torch.float32 and torch.equal(m, fp32[names[p]])
    set_lr(opt, 1e-2)
    batches = _micro_batches()
    for tokens in batches:
        _backward(model, tokens, len(batches))
    # by hand: each micro-batch's bf16 gradient, summed in fp32
    summed = {n: torch.zeros_like(t) for n, t in fp32.items()}
    for tokens in batches:
        ref.zero_grad(set_to_none=True)
        _backward(ref, tokens, len(batches))
        for n, p in ref.named_parameters():
            assert p.grad.dtype == torch.bfloat16
            summed[n] += p.grad.float()
    for n, p in model.named_parameters():
        assert p.grad is None and torch.equal(p.main_grad, summed[n]), n
    opt.step()
    masters = {n: torch.nn.Parameter(t.clone()) for n, t in fp32.items()}
    for n, m in masters.items():
        m.grad = summed[n]
    decayed = [masters[n] for n, p in ref.named_parameters() if is_decayed(n, p, config)]
    others = [masters[n] for n, p in ref.named_parameters() if not is_decayed(n, p, config)]
    by_hand = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        fused=True,
    )
    by_hand.step()
    for p, m in opt.master_of.items():
        n = names[p]
        assert torch.equal(m, masters[n]), n
        assert torch.equal(p.detach(), masters[n].detach().to(torch.bfloat16)), n
        assert torch.equal(opt.state[p]["exp_avg"], by_hand.state[masters[n]]["exp_avg"]), n
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in opt.master_of.values())
    opt.zero_grad()
    assert all(not torch.any(grad_of(p)) for p in model.parameters())
    assert opt.host_bytes() >= sum(12 * p.numel() for p in model.parameters())


def test_bf16_params_refuse_what_adds_gradients_outside_autograd():
    from meshtrain.services.trainer.config.load import load_config

    base = ["--optim.optimizer_cpu_offload=true", "--train.bf16=true"]
    with pytest.raises(ConfigError, match="offload_bf16_params.*train.bf16_weight_copies"):
        load_config([*base, "--train.bf16_weight_copies=true"])
    with pytest.raises(ConfigError, match="offload_bf16_params.*gradient_accumulation_fusion"):
        load_config([*base, "--train.gradient_accumulation_fusion=true"])
    job = load_config(
        [*base, "--optim.offload_bf16_params=false", "--train.bf16_weight_copies=true"]
    )
    assert not job.optim.offload_bf16_params


def _trainer(corpus_cache, run_dir, **extra):
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer
    from tests.services.trainer.conftest import small_job_args

    args = {"train.eval_interval": 0, "train.train_iters": 4, "train.bf16": True, **extra}
    return Trainer(load_config(small_job_args(corpus_cache, run_dir, **args)))


ON = {
    "optim.optimizer_cpu_offload": True,
    "optim.overlap_cpu_optimizer_d2h_h2d": True,
    "optim.cpu_offload_chunk_numel": 20_000,
}


@pytest.mark.e2e
def test_checkpoints_hold_the_fp32_masters_and_resume_exactly(corpus_cache, tmp_path):
    from meshtrain.services.checkpoint.reader import load_checkpoint

    root = tmp_path / "ckpt"
    first = _trainer(
        corpus_cache,
        tmp_path / "a",
        **ON,
        **{"checkpoint.save": root, "checkpoint.save_interval": 2},
    )
    assert isinstance(first.optimizer, OffloadedAdamW) and first.optimizer.bf16_params
    assert first.weight_copies is None  # the model runs on its bf16 parameters
    losses = first.run().losses
    saved, _ = load_checkpoint(str(root))  # step 4
    names = {p: n for n, p in first.model.named_parameters()}
    for p, m in first.optimizer.master_of.items():
        t = saved[names[p]]
        rows = m[tuple(slice(0, s) for s in t.shape)]  # the padded vocabulary is not stored
        assert t.dtype == torch.float32 and torch.equal(t, rows), names[p]
    assert any(
        not torch.equal(saved[n], saved[n].to(torch.bfloat16).float()) for n in names.values()
    )
    resumed = _trainer(
        corpus_cache,
        tmp_path / "b",
        **ON,
        **{"checkpoint.load": root, "checkpoint.load_step": 2},
    )
    assert resumed.run().losses == {k: losses[k] for k in (3, 4)}
    # and without offload (fp32 parameters under autocast) from the same fp32 weights
    plain = _trainer(
        corpus_cache, tmp_path / "c", **{"checkpoint.load": root, "checkpoint.load_step": 2}
    )
    assert next(plain.model.parameters()).dtype == torch.float32
    again = plain.run().losses
    assert again.keys() == {3, 4} and again[3] == pytest.approx(losses[3], rel=2e-2)


def _dp2_runs(rank, world, args_by_run):
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer

    return [Trainer(load_config(args)).run().losses for args in args_by_run]


@pytest.mark.dist
@pytest.mark.slow
def test_zero1_dp2_bf16_params_equal_plain_dp2_and_resume(corpus_cache, tmp_path):
    """No clipping: ZeRO-1 sums the squares of its slices in another order than plain data
    parallelism, and a clip coefficient one ulp apart would be the only difference."""
    from tests.dist_utils import run_ranks
    from tests.services.trainer.conftest import small_job_args

    root = str(tmp_path / "ckpt")
    common = {
        "train.eval_interval": 0,
        "train.train_iters": 3,
        "train.bf16": True,
        "optim.clip_grad": 0.0,
        **ON,
    }
    zero1 = {"parallel.use_distributed_optimizer": True, "parallel.overlap_grad_reduce": True}
    sharded = small_job_args(
        corpus_cache,
        tmp_path / "z",
        **common,
        **zero1,
        **{"checkpoint.save": root, "checkpoint.save_interval": 2},
    )
    plain = small_job_args(corpus_cache, tmp_path / "p", **common)
    resumed = small_job_args(
        corpus_cache,
        tmp_path / "r",
        **common,
        **zero1,
        **{"checkpoint.load": root, "checkpoint.load_step": 2},
    )
    resumed = [a for a in resumed if not a.startswith("--checkpoint.save=")]
    results = run_ranks(_dp2_runs, 2, [sharded, plain, resumed], timeout=240)
    for losses_sharded, losses_plain, losses_resumed in results:
        assert losses_sharded == losses_plain and len(losses_plain) == 3
        assert losses_resumed == {3: losses_plain[3]}
