"""GRPO end to end on CPU: the real trainer samples, scores and learns.

A tiny byte-level model, trained from scratch by GRPO alone, is rewarded for the share of
digits in its completions of addition prompts ("3+4="). At random initialization about 10 of
257 bytes are digits; GRPO must raise the mean reward well above that within a few dozen steps,
and the same run with the advantages' sign flipped must not (the test can fail).
"""

from __future__ import annotations

import json

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.objectives import grpo_steps
from meshtrain.services.trainer.train import Trainer, train


def digit_share(prompt: str, completion: str, **columns) -> float:
    """The share of the completion's characters that are digits (0 for an empty one)."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0


def write_prompts(path, n=24, seed=0):
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randrange(10), rng.randrange(10)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def job_args(tmp_path, prompts, **extra):
    args = {
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.num_attention_heads": 4,
        "model.seq_length": 16,
        "data.tokenizer": "byte",
        "train.objective": "grpo",
        "train.micro_batch_size": 16,
        "train.global_batch_size": 32,
        "train.train_iters": 25,
        "train.eval_interval": 0,
        "train.device": "cpu",
        "train.seed": 3,
        "optim.lr": 3e-3,
        "optim.min_lr": 3e-3,
        "optim.lr_warmup_iters": 0,
        "log.log_interval": 1,
        "log.run_dir": str(tmp_path / "run"),
        "log.plot": False,
        "grpo.prompts_path": str(prompts),
        "grpo.group_size": 8,
        "grpo.max_new_tokens": 4,
        "grpo.reward_funcs": '["tests.services.trainer.objectives.test_grpo_train:digit_share"]',
    }
    args.update(extra)
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in args.items()]


def _rewards(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward"] for r in rows if "reward" in r]


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.e2e  # two short training runs: seconds on 2 idle cores, kept in `make test`
def test_grpo_raises_the_reward_and_a_flipped_sign_does_not(tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    result = train(load_config(job_args(tmp_path / "a", prompts)))
    rewards = _rewards(result.run_dir)
    assert len(rewards) == 25
    first, last = _mean(rewards[:3]), _mean(rewards[-3:])
    assert first < 0.2, rewards
    assert last > first + 0.3, rewards

    real = grpo_steps.group_advantages
    monkeypatch.setattr(grpo_steps, "group_advantages", lambda *a, **k: -real(*a, **k))
    flipped = _rewards(train(load_config(job_args(tmp_path / "b", prompts))).run_dir)
    assert flipped[0] == rewards[0]  # same start: same seed, same samples
    assert _mean(flipped[-3:]) < first + 0.05, flipped


def test_grpo_refuses_what_it_does_not_run_with(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    with pytest.raises(ConfigError, match="group_size"):
        load_config(job_args(tmp_path, prompts, **{"grpo.group_size": 1}))
    with pytest.raises(ConfigError, match="reward_model_step needs grpo.reward_model"):
        load_config(job_args(tmp_path, prompts, **{"grpo.reward_model_step": 3}))
    with pytest.raises(ConfigError, match="multiple of grpo.group_size"):
        Trainer(
            load_config(
                job_args(
                    tmp_path,
                    prompts,
                    **{"train.global_batch_size": 12, "train.micro_batch_size": 4},
                )
            )
        )
    with pytest.raises(ConfigError, match="cannot import"):
        Trainer(load_config(job_args(tmp_path, prompts, **{"grpo.reward_funcs": '["nope.x:f"]'})))
    with pytest.raises(ConfigError, match="rollout_timeout_s"):
        load_config(job_args(tmp_path, prompts, **{"grpo.rollout_timeout_s": 0}))
    with pytest.raises(ConfigError, match="publish"):
        load_config(job_args(tmp_path, prompts, **{"grpo.publish": "carrier-pigeon"}))
    with pytest.raises(ConfigError, match="needs grpo.rollout_addresses"):
        Trainer(load_config(job_args(tmp_path, prompts, **{"grpo.rollout": "service"})))
    with pytest.raises(ConfigError, match="seq_length"):
        Trainer(load_config(job_args(tmp_path, prompts, **{"grpo.max_new_tokens": 14})))
