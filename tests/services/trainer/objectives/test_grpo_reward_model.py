"""A reward model as GRPO's reward (grpo.reward_model): the scorer loads what the reward run
saved and scores as its model does; GRPO adds those scores to the rewards; a
checkpoint without a scalar head, or with another tokenizer, is refused. That GRPO raises a
reward model's score, and the behaviour it encodes, is test_grpo_learns_a_reward_model.py's."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain.services.common.errors import CheckpointError, ConfigError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.objectives.reward_scorer import RewardScorer
from meshtrain.services.trainer.train import Trainer, train
from tests.services.trainer.objectives.test_grpo_train import job_args as grpo_args
from tests.services.trainer.objectives.test_grpo_train import write_prompts
from tests.services.trainer.objectives.test_reward_model import make_pairs, reward_args


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    """A tiny reward model trained to prefer digits, saved at its last step: (trainer, root)."""
    tmp = tmp_path_factory.mktemp("rm")
    pairs = make_pairs(tmp, "train", 320, 0)
    root = tmp / "ckpt"
    args = reward_args(tmp, pairs, None, **{"checkpoint.save": str(root), "train.eval_interval": 0})
    trainer = Trainer(load_config(args))
    trainer.run()
    return trainer, str(root)


def own_scores(model, sequences):
    """Each sequence's score by the trained model's own forward, one at a time."""
    with torch.no_grad():
        return [model(torch.tensor([s]))[0, -1].item() for s in sequences]


@pytest.mark.e2e
def test_save_load_round_trip_scores_identically(reward_run):
    trainer, root = reward_run
    job = trainer.job
    scorer = RewardScorer.load(root, None, job, torch.device("cpu"), trainer.autocast, 3)
    seqs = [list(b"ab:12345"), list(b"cd:xyz"), list(b"q:9"), list(b"abcd:1a2b3"), list(b"x")]
    got = scorer.score(seqs)  # batched, padded
    want = own_scores(trainer.model, seqs)
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(x, 4) for x in got)) > 1  # a trained model tells them apart


@pytest.mark.e2e
def test_grpo_adds_the_reward_models_scores(reward_run, tmp_path, monkeypatch):
    trainer, root = reward_run
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    extra = {"grpo.reward_model": root, "grpo.reward_funcs": "[]", "train.train_iters": 3}
    job = load_config(grpo_args(tmp_path, prompts, **extra))

    seen: list[tuple[list[list[int]], list[float]]] = []
    real = RewardScorer.score

    def recording(self, sequences):
        out = real(self, sequences)
        seen.append(([list(s) for s in sequences], out))
        return out

    monkeypatch.setattr(RewardScorer, "score", recording)
    result = train(job)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert len(rewards) == 3 and len(seen) == 3
    # the reward column is the reward model's score of each sampled prompt + completion
    for row, (sequences, scores) in zip([r for r in rows if "reward" in r], seen, strict=True):
        assert row["rewards/reward_model/mean"] == pytest.approx(
            sum(scores) / len(scores), abs=1e-5
        )
        assert row["reward"] == pytest.approx(row["rewards/reward_model/mean"], abs=1e-5)
    first = seen[0][0]
    assert own_scores(trainer.model, first[:4]) == pytest.approx(seen[0][1][:4], abs=1e-5)


def test_refusals(reward_run_free_checkpoints):
    lm_root, tmp_path = reward_run_free_checkpoints
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    job = load_config(grpo_args(tmp_path, prompts, **{"grpo.reward_model": lm_root}))
    with pytest.raises(ConfigError, match="not a reward model"):
        Trainer(job)


@pytest.fixture()
def reward_run_free_checkpoints(tmp_path):
    """A language model's checkpoint (no scalar head), one step."""
    prompts = write_prompts(tmp_path / "p.jsonl")
    root = tmp_path / "lm"
    extra = {
        "train.train_iters": 1,
        "checkpoint.save": str(root),
        "log.run_dir": str(tmp_path / "r"),
    }
    train(load_config(grpo_args(tmp_path, prompts, **extra)))
    return str(root), tmp_path


def test_another_tokenizer_is_refused(tmp_path):
    from meshtrain.services.trainer.objectives.reward_scorer import check_same_tokenizer

    pairs = make_pairs(tmp_path, "train", 32, 0)
    root = tmp_path / "ckpt"
    args = reward_args(
        tmp_path, pairs, None, **{"checkpoint.save": str(root), "train.train_iters": 1}
    )
    Trainer(load_config(args)).run()
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    policy = load_config(grpo_args(tmp_path, prompts))
    policy.model.vocab_size = 300
    with pytest.raises(ConfigError, match="vocabulary of 257"):
        check_same_tokenizer(str(root), 1, policy, 257)
    policy.model.vocab_size = 257
    policy.data.tokenizer = "null:256"  # 256 ids + its EOD: the same size, other ids
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_same_tokenizer(str(root), 1, policy, 257)


def test_a_reward_model_starts_from_a_language_models_weights(reward_run_free_checkpoints):
    lm_root, tmp_path = reward_run_free_checkpoints
    pairs = make_pairs(tmp_path, "train", 32, 0)
    same = {"model.hidden_size": 64, "model.seq_length": 16, "train.train_iters": 1}
    args = reward_args(tmp_path, pairs, None, **same, **{"checkpoint.load": lm_root})
    with pytest.raises(CheckpointError, match="finetune"):
        Trainer(load_config(args))  # a resume would take the LM's optimizer state as its own
    trainer = Trainer(load_config([*args, "--checkpoint.finetune=true"]))
    lm = Trainer(
        load_config(grpo_args(tmp_path, tmp_path / "p.jsonl", **{"checkpoint.load": lm_root}))
    )
    ours, theirs = dict(trainer.model.named_parameters()), dict(lm.model.named_parameters())
    assert set(ours) - set(theirs) == {"score.weight"}
    for name, p in theirs.items():
        assert torch.equal(ours[name], p), name
