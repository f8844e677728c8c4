"""DPO end to end on CPU: preprocessed pairs, the trainer's loop, and a tiny model that learns a
preference it can only get from the loss (chosen completions are vowels, rejected consonants)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from meshtrain.services.dataloader.preference import (
    PreferenceBatchSource,
    PreferencePairs,
    write_pairs,
)
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import Trainer

VOWELS, CONSONANTS = "aeiou", "bcdfghjklmnpqrstvwxz"


def synthetic_pairs(path, n, seed):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice(VOWELS + CONSONANTS) for _ in range(6)) + ":"
            chosen = "".join(rng.choice(VOWELS) for _ in range(5))
            rejected = "".join(rng.choice(CONSONANTS) for _ in range(5))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")


def job_args(tmp_path, prefix, valid, **extra):
    args = {
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.num_attention_heads": 4,
        "model.seq_length": 16,
        "data.tokenizer": "byte",
        "train.objective": "dpo",
        "train.micro_batch_size": 4,
        "train.global_batch_size": 8,
        "train.train_iters": 30,
        "train.eval_interval": 10,
        "train.eval_iters": 4,
        "train.device": "cpu",
        "train.seed": 3,
        "optim.lr": 3e-3,
        "optim.min_lr": 3e-4,
        "optim.lr_warmup_iters": 2,
        "log.log_interval": 1,
        "log.run_dir": str(tmp_path / "run"),
        "log.plot": False,
        "dpo.data_path": str(prefix),
        "dpo.valid_data_path": str(valid),
        "dpo.beta": 0.5,
    }
    args.update(extra)
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in args.items()]


@pytest.fixture()
def pair_data(tmp_path):
    tok = build_tokenizer("byte")
    synthetic_pairs(tmp_path / "train.jsonl", 200, seed=0)
    synthetic_pairs(tmp_path / "valid.jsonl", 64, seed=1)
    write_pairs(tmp_path / "train.jsonl", tmp_path / "train", tok, max_length=17)
    write_pairs(tmp_path / "valid.jsonl", tmp_path / "valid", tok, max_length=17)
    return tmp_path / "train", tmp_path / "valid"


def held_out_gap_accuracy(trainer: Trainer, valid) -> float:
    """Fraction of held-out pairs whose chosen completion the policy finds likelier."""
    source = PreferenceBatchSource(PreferencePairs(valid), 16, 32, 64)
    right = total = 0
    with torch.no_grad():
        for b in source.micro_batches(0):
            h = trainer.model.hidden_states(b.tokens)
            logps = trainer.model.head.base.token_logps(h, trainer.model.output_weight, b.labels)
            sums = (logps * b.loss_mask).sum(-1)
            c, r = sums.chunk(2)
            right += int((c > r).sum())
            total += len(c)
    return right / total


@pytest.mark.e2e
def test_the_policy_learns_the_preference(tmp_path, pair_data):
    prefix, valid = pair_data
    trainer = Trainer(load_config(job_args(tmp_path, prefix, valid)))
    before = held_out_gap_accuracy(trainer, valid)
    result = trainer.run()
    after = held_out_gap_accuracy(trainer, valid)
    assert 0.2 < before < 0.8, before  # an untrained model has no preference
    assert after > 0.9, (before, after)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rewards/accuracies" in r]
    assert len(steps) == 30
    assert steps[-1]["rewards/margins"] > 0
    evals = [r for r in rows if "eval_rewards/accuracies" in r]
    assert evals[-1]["eval_rewards/accuracies"] > 0.9
