"""Post-training on CUDA in bf16, through the real loop: SFT (packed conversations, the
assistant-only mask, attention within documents), DPO (with the frozen reference), GRPO (rollouts
sampled by the policy on the trainer's device).

Each runs a few steps and checks finite losses that fall (GRPO: a reward that rises) and one
cheap equivalence: SFT's and DPO's first step against the fp32 CPU run's, DPO's first loss at
ln 2 (the policy is its reference), GRPO's rollout log-probs against the trainer's recomputation
of the same tokens (the old log-probs of the importance ratio). The bodies take their device from
`gpu_device` (conftest.py: CUDA, and the CPU under MESHTRAIN_GPU_TESTS_ON_CPU=1). About 25 s
together on one H100.
"""

import math

import pytest
import torch

from meshtrain.services.dataloader.preference import write_pairs
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import Trainer, train
from tests.services.trainer import test_sft_training as sft
from tests.services.trainer.conftest import first_step_loss, losses_in_order
from tests.services.trainer.objectives import test_dpo_train as dpo
from tests.services.trainer.objectives import test_grpo_train as grpo

pytestmark = pytest.mark.gpu


def _on(device: str) -> list[str]:
    return [f"--train.device={device}", "--train.bf16=true"]


def _finite(losses: list[float]) -> bool:
    return bool(torch.isfinite(torch.tensor(losses)).all())


def test_sft_bf16_training(gpu_device, tmp_path):
    data = sft._example().make_data(tmp_path / "data", conversations=400)
    steps = ["--train.train_iters=10", "--train.eval_interval=10", "--optim.lr_warmup_iters=2"]
    cpu = first_step_loss(_args(sft, data, tmp_path / "cpu", *steps))
    result = train(_job(sft, data, tmp_path / "run", *steps, *_on(gpu_device)))
    losses = losses_in_order(result)
    assert len(losses) == 10 and _finite(losses), losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert losses[0] == pytest.approx(cpu, rel=1e-2)
    assert math.isfinite(result.eval_losses[10])


def _args(module, data, run_dir, *extra) -> list[str]:
    """sft-tiny.toml's command line (test_sft_training._job's) with `extra`."""
    return [
        "--config",
        str(module.REPO / "deploy/configs/sft-tiny.toml"),
        f'--data.data_path=["{data["prefix"]}"]',
        f"--data.tokenizer={data['tokenizer']}",
        f"--log.run_dir={run_dir}",
        "--log.plot=false",
        "--log.log_interval=1",
        *extra,
    ]


def _job(module, data, run_dir, *extra):
    return load_config(_args(module, data, run_dir, *extra))


@pytest.fixture()
def pairs(tmp_path):
    tok = build_tokenizer("byte")
    dpo.synthetic_pairs(tmp_path / "train.jsonl", 200, seed=0)
    dpo.synthetic_pairs(tmp_path / "valid.jsonl", 64, seed=1)
    write_pairs(tmp_path / "train.jsonl", tmp_path / "train", tok, max_length=17)
    write_pairs(tmp_path / "valid.jsonl", tmp_path / "valid", tok, max_length=17)
    return tmp_path / "train", tmp_path / "valid"


def test_dpo_bf16_training(gpu_device, tmp_path, pairs):
    prefix, valid = pairs
    extra = {"train.train_iters": 10, "train.eval_interval": 10, "train.eval_iters": 2}
    cpu = first_step_loss(dpo.job_args(tmp_path / "cpu", prefix, valid, **extra))
    run = {**extra, "train.device": gpu_device, "train.bf16": True}
    result = train(load_config(dpo.job_args(tmp_path / "dev", prefix, valid, **run)))
    losses = losses_in_order(result)
    assert len(losses) == 10 and _finite(losses), losses
    # the policy starts as its reference: every pair's margin is 0, its loss -log sigmoid(0)
    assert cpu == pytest.approx(math.log(2), abs=1e-5)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-2)
    assert sum(losses[-3:]) / 3 < math.log(2) - 0.1, losses
    assert result.eval_losses[10] < math.log(2), result.eval_losses


def test_grpo_bf16_training_raises_the_reward(gpu_device, tmp_path):
    prompts = grpo.write_prompts(tmp_path / "prompts.jsonl")
    run = {"train.device": gpu_device, "train.bf16": True}
    result = train(load_config(grpo.job_args(tmp_path / "run", prompts, **run)))
    rewards = grpo._rewards(result.run_dir)
    losses = losses_in_order(result)
    assert len(rewards) == 25 and _finite(losses) and _finite(rewards)
    first, last = grpo._mean(rewards[:3]), grpo._mean(rewards[-3:])
    assert last > first + 0.3, rewards


def test_grpo_rollout_logps_are_the_trainers(gpu_device, tmp_path):
    """The colocated generator's log-probs of its sampled tokens (fp32 weights, KV cache, one
    token at a time) equal the trainer's bf16 recomputation of the same tokens in one forward,
    which is what the first step's importance ratio is taken against; and that ratio is 1."""
    prompts = grpo.write_prompts(tmp_path / "prompts.jsonl")
    run = {"train.device": gpu_device, "train.bf16": True, "train.train_iters": 2}
    trainer = Trainer(load_config(grpo.job_args(tmp_path / "run", prompts, **run)))
    try:
        rollouts = trainer.rollouts
        assert rollouts is not None
        sampled = []
        generate = rollouts.backend.generate

        def keep(request):
            out = generate(request)
            sampled.extend(out)
            return out

        rollouts.backend.generate = keep  # type: ignore[method-assign]
        trainer.train_step(0)
        stats = trainer.objective.stats  # this step's summed loss statistics
        assert stats is not None and float(stats[1:4].sum()) == 0  # ratio 1: nothing clipped
        rows = [(t, tg) for _, _, tg in rollouts.micro for t in range(len(tg.advantages))]
        assert len(rows) == len(sampled) == 32
        worst = 0.0
        for c, (row, targets) in zip(sampled, rows, strict=True):
            mask = targets.loss_mask[row] > 0
            assert targets.old_logps is not None
            recomputed = targets.old_logps[row][mask].cpu()
            assert recomputed.shape == (len(c.tokens),)
            rolled = torch.tensor(c.logprobs)
            worst = max(worst, float((recomputed - rolled).abs().max()))
        # bf16 logits (8 mantissa bits) of a log-softmax near -ln(257): a few hundredths
        assert worst < 0.1, worst
    finally:
        trainer.release_run_dir()
