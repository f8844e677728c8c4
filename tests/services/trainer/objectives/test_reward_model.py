"""Reward models: the Bradley–Terry loss and its gradient against a hand computation, a tiny
reward model that learns a preference (and one that cannot, its labels shuffled), the scalar
head's save -> load round trip, and the refusals."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.dataloader.preference import (
    PreferenceBatchSource,
    PreferencePairs,
    write_pairs,
)
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.objectives.preference import PairTargets, finish_stats
from meshtrain.services.trainer.objectives.reward_model import (
    STAT_NAMES,
    RewardHead,
    RewardLoss,
    last_positions,
    reward_loss,
)
from meshtrain.services.trainer.train import Trainer

LETTERS, DIGITS = "abcdefghij", "0123456789"


def digit_pairs(path, n, seed, shuffle=False):
    """Chosen completions hold more digits than rejected ones (shuffle: a coin decides which is
    chosen, so nothing can be learned)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice(LETTERS) for _ in range(4)) + ":"
            many, few = rng.randint(3, 5), rng.randint(0, 2)
            a = "".join(
                rng.sample(list(DIGITS), many) + [rng.choice(LETTERS) for _ in range(5 - many)]
            )
            b = "".join(
                rng.sample(list(DIGITS), few) + [rng.choice(LETTERS) for _ in range(5 - few)]
            )
            a, b = "".join(rng.sample(a, len(a))), "".join(rng.sample(b, len(b)))
            if shuffle and rng.random() < 0.5:
                a, b = b, a
            f.write(json.dumps({"prompt": prompt, "chosen": a, "rejected": b}) + "\n")


def reward_args(tmp_path, prefix, valid=None, **extra):
    args = {
        "model.num_layers": 2,
        "model.hidden_size": 32,
        "model.num_attention_heads": 4,
        "model.seq_length": 12,
        "data.tokenizer": "byte",
        "train.objective": "reward",
        "train.micro_batch_size": 8,
        "train.global_batch_size": 16,
        "train.train_iters": 40,
        "train.eval_interval": 40,
        "train.eval_iters": 2,
        "train.device": "cpu",
        "train.seed": 3,
        "optim.lr": 3e-3,
        "optim.min_lr": 3e-4,
        "optim.lr_warmup_iters": 2,
        "log.log_interval": 1,
        "log.run_dir": str(tmp_path / "run"),
        "log.plot": False,
        "reward.data_path": str(prefix),
    }
    if valid is not None:
        args["reward.valid_data_path"] = str(valid)
    args.update(extra)
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in args.items()]


def make_pairs(tmp_path, name, n, seed, shuffle=False):
    digit_pairs(tmp_path / f"{name}.jsonl", n, seed, shuffle)
    write_pairs(tmp_path / f"{name}.jsonl", tmp_path / name, build_tokenizer("byte"), max_length=13)
    return tmp_path / name


def held_out_accuracy(model, valid) -> float:
    """Fraction of held-out pairs whose chosen sequence the model scores higher (its own
    forward: the score after each token, read at the last one)."""
    source = PreferenceBatchSource(PreferencePairs(valid), 12, 32, 64)
    right = total = 0
    with torch.no_grad():
        for b in source.micro_batches(0):
            scores = model(b.tokens)  # (2B, seq)
            r = scores[torch.arange(len(scores)), last_positions(b.loss_mask)]
            c, rj = r.chunk(2)
            right += int((c > rj).sum())
            total += len(c)
    return right / total


# ------------------------------------------------------------------------- the loss


def test_loss_and_gradient_equal_a_hand_computation():
    torch.manual_seed(0)
    h = torch.randn(4, 5, 3, requires_grad=True)  # 2 pairs: rows 0, 1 chosen; 2, 3 rejected
    w = torch.randn(1, 3, requires_grad=True)
    mask = torch.zeros(4, 5)
    ends = [4, 2, 3, 1]  # each row's last completion position
    for row, end in enumerate(ends):
        mask[row, 1 : end + 1] = 1.0
    head = RewardHead(torch.nn.Identity(), RewardLoss(margin=0.5, center_rewards_coefficient=0.1))
    loss = head.loss(h, w, None, PairTargets(mask))
    loss.backward()
    # by hand, in float64
    hd, wd = h.detach().double(), w.detach().double()[0]
    r = [float(hd[row, end] @ wd) for row, end in enumerate(ends)]
    rc, rr = r[:2], r[2:]
    want = sum(-math.log(1 / (1 + math.exp(-(c - j - 0.5)))) for c, j in zip(rc, rr)) / 2
    want += 0.1 * sum((c + j) ** 2 for c, j in zip(rc, rr)) / 2
    assert loss.item() == pytest.approx(want, rel=1e-5)
    # d/dr_c = (-(1 - s(d)) + 0.2 (c + j)) / 2, d/dr_j = ((1 - s(d)) + 0.2 (c + j)) / 2
    sig = [1 / (1 + math.exp(-(c - j - 0.5))) for c, j in zip(rc, rr)]
    dr = [(-(1 - s) + 0.2 * (c + j)) / 2 for s, c, j in zip(sig, rc, rr)]
    dr += [((1 - s) + 0.2 * (c + j)) / 2 for s, c, j in zip(sig, rc, rr)]
    want_w = sum(d * hd[row, end] for d, (row, end) in zip(dr, enumerate(ends)))
    assert torch.allclose(w.grad.double()[0], want_w, rtol=1e-5, atol=1e-6)
    want_h = torch.zeros(4, 5, 3, dtype=torch.float64)
    for row, end in enumerate(ends):
        want_h[row, end] = dr[row] * wd
    assert torch.allclose(h.grad.double(), want_h, rtol=1e-5, atol=1e-6)
    stats = finish_stats(head.take_stats(), STAT_NAMES)
    assert stats["accuracy"] == sum(c > j for c, j in zip(rc, rr)) / 2
    assert stats["rewards/margins"] == pytest.approx((rc[0] - rr[0] + rc[1] - rr[1]) / 2, rel=1e-5)


def test_plain_loss_is_trls():
    c, r = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.5])
    loss, stats = reward_loss(c, r, RewardLoss())
    assert loss.item() == pytest.approx(-F.logsigmoid(c - r).mean().item())
    assert stats.tolist()[-2:] == [1.0, 3.0]  # one pair right of three


# --------------------------------------------------------------------- training


@pytest.mark.e2e
def test_a_tiny_reward_model_learns_more_digits_and_not_shuffled_labels(tmp_path):
    train, valid = make_pairs(tmp_path, "train", 320, 0), make_pairs(tmp_path, "valid", 64, 1)
    trainer = Trainer(load_config(reward_args(tmp_path, train, valid)))
    assert trainer.job.model.reward_head  # set by the objective
    result = trainer.run()
    learned = held_out_accuracy(trainer.model, valid)
    assert learned > 0.9, learned
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "accuracy" in r]
    assert len(steps) == 40 and steps[-1]["rewards/margins"] > 0
    assert [r for r in rows if "eval_accuracy" in r][-1]["eval_accuracy"] > 0.9

    shuffled = make_pairs(tmp_path, "shuffled", 320, 0, shuffle=True)
    args = reward_args(tmp_path, shuffled, None, **{"log.run_dir": str(tmp_path / "run2")})
    noise = Trainer(load_config(args))
    noise.run()
    chance = held_out_accuracy(noise.model, valid)
    assert 0.25 < chance < 0.75, chance


# ----------------------------------------------------------------- refusals


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="reward.data_path"):
        Trainer(load_config(reward_args(tmp_path, "")))
    with pytest.raises(ConfigError, match="model.reward_head"):
        load_config(["--model.reward_head=true", "--train.objective=lm"])
    with pytest.raises(ConfigError, match="center_rewards_coefficient"):
        load_config(["--train.objective=reward", "--reward.center_rewards_coefficient=-1"])
