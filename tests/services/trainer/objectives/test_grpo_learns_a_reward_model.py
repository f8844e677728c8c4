"""GRPO rewarded by a trained reward model alone raises that model's score and the behaviour it
encodes; with the score's sign flipped it lowers both.

The task is a tiny chat ("Q: xy\\nA: " -> six letters of "abcd"). A byte-level reward model is
trained on preference pairs of random six-letter answers, the one with more 'a's chosen; it
must tell held-out pairs apart. A tiny policy learns the answer format by a short SFT run
(random letters: about a quarter are 'a'), then GRPO starts from its checkpoint with
`grpo.reward_model` as its only reward. Every completion the reward model scores is recorded,
so the behaviour is measured on the decoded completions themselves: the mean score and the
share of 'a' over the last steps must rise clearly above the first steps', and the same run
with `grpo.reward_model_weight = -1` must move both the other way (the test can fail).
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshtrain.services.dataloader.chat import load_chat_template
from meshtrain.services.dataloader.preference import write_pairs
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.objectives.reward_scorer import RewardScorer
from meshtrain.services.trainer.train import train
from tests.services.trainer.objectives.chat_task import (
    MODEL,
    cli_args,
    mean,
    metric_rows,
    train_sft,
    write_template,
)
from tests.services.trainer.objectives.test_reward_model import reward_args

LETTERS, LENGTH = "abcd", 6
ASKED = ["".join(p) for p in itertools.product("xyz", repeat=2)]  # the prompts' questions
SEQ = 20  # "Q: xy\nA: " + six letters, "\n" and EOD, for both models
POLICY = {**MODEL, "model.seq_length": SEQ}
RM_ITERS, SFT_ITERS, GRPO_ITERS = 30, 30, 20


def _answer(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(LENGTH))


def _write_chats(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            messages = [
                {"role": "user", "content": rng.choice(ASKED)},
                {"role": "assistant", "content": _answer(rng)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _write_pairs(folder: Path, name: str, template: Path, n: int, seed: int) -> Path:
    """Preference pairs of two random answers with unequal counts of 'a', the one with more
    chosen (conversational rows, rendered with the chat template as SFT renders them)."""
    rng = random.Random(seed)
    with open(folder / f"{name}.jsonl", "w") as f:
        for _ in range(n):
            a, b = _answer(rng), _answer(rng)
            while a.count("a") == b.count("a"):
                b = _answer(rng)
            chosen, rejected = (a, b) if a.count("a") > b.count("a") else (b, a)
            row = {"prompt": rng.choice(ASKED), "chosen": chosen, "rejected": rejected}
            f.write(json.dumps(row) + "\n")
    tok = build_tokenizer("byte")
    chat = load_chat_template(str(template), tok)
    write_pairs(folder / f"{name}.jsonl", folder / name, tok, SEQ + 1, chat_template=chat)
    return folder / name


def train_reward_model(folder: Path, template: Path, iters: int) -> tuple[Path, float]:
    """The checkpoint root of a reward model preferring 'a', and its held-out accuracy."""
    pairs = _write_pairs(folder, "pairs", template, 320, 0)
    valid = _write_pairs(folder, "valid", template, 128, 1)
    root = folder / "rm"
    extra = {
        "model.seq_length": SEQ,
        "train.train_iters": iters,
        "train.eval_interval": iters,
        "train.eval_iters": 8,  # all 128 held-out pairs
        "log.run_dir": str(folder / "rm-run"),
        "checkpoint.save": str(root),
    }
    result = train(load_config(reward_args(folder, pairs, valid, **extra)))
    evals = [r["eval_accuracy"] for r in metric_rows(result.run_dir) if "eval_accuracy" in r]
    return root, evals[-1]


@dataclass
class Task:
    """The trained pieces a GRPO run starts from."""

    template: Path
    prompts: Path
    reward_model: Path
    accuracy: float  # the reward model's on held-out pairs
    policy: Path  # the SFT checkpoint


class Run:
    """Per step of a GRPO run: the reward model's mean score of the step's completions
    (`rewards/reward_model/mean`, before the weight), and the completions' answers as decoded
    from what the reward model was given."""

    def __init__(self, scores: list[float], answers: list[list[str]]):
        self.scores, self.answers = scores, answers

    def share(self, step: int, letters: str = "a") -> float:
        """The share of the step's answer characters that are among `letters`."""
        text = "".join(self.answers[step])
        return sum(c in letters for c in text) / max(len(text), 1)

    def shares(self) -> list[float]:
        return [self.share(step) for step in range(len(self.answers))]


def grpo(folder: Path, task: Task, iters: int, weight: float, monkeypatch) -> Run:
    """A GRPO run from the SFT checkpoint rewarded by the reward model alone, its score
    weighted by `weight`."""
    answers: list[list[str]] = []
    real = RewardScorer.score
    tok = build_tokenizer("byte")

    def recording(self, sequences):
        # prompt + completion without its EOD: the answer follows the last "A: "
        answers.append([tok.decode(s).rpartition("A: ")[2].rstrip("\n") for s in sequences])
        return real(self, sequences)

    monkeypatch.setattr(RewardScorer, "score", recording)
    settings = {
        **POLICY,
        "train.objective": "grpo",
        "train.micro_batch_size": 32,
        "train.global_batch_size": 64,
        "train.train_iters": iters,
        "train.seed": 3,
        "optim.lr": 1e-3,
        "optim.min_lr": 1e-3,
        "log.run_dir": str(folder),
        "log.log_interval": 1,
        "checkpoint.load": str(task.policy),
        "checkpoint.finetune": True,
        "grpo.prompts_path": str(task.prompts),
        "grpo.chat_template": str(task.template),
        "grpo.group_size": 8,
        "grpo.max_new_tokens": LENGTH + 2,
        "grpo.reward_funcs": "[]",
        "grpo.reward_model": str(task.reward_model),
        "grpo.reward_model_weight": weight,
    }
    try:
        result = train(load_config(cli_args(**settings)))
    finally:
        monkeypatch.setattr(RewardScorer, "score", real)
    rows = [r for r in metric_rows(result.run_dir) if "reward" in r]
    assert len(rows) == len(answers) == iters
    for row in rows:  # the reward GRPO used is the weighted score
        assert row["reward"] == pytest.approx(weight * row["rewards/reward_model/mean"], abs=1e-5)
    return Run([r["rewards/reward_model/mean"] for r in rows], answers)


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Task:
    """The reward model and the SFT policy, trained once for the module."""
    folder = tmp_path_factory.mktemp("task")
    template = write_template(folder)
    prompts = folder / "prompts.jsonl"
    with open(prompts, "w") as f:
        for asked in ASKED:
            f.write(json.dumps({"messages": [{"role": "user", "content": asked}]}) + "\n")
    reward_model, accuracy = train_reward_model(folder, template, RM_ITERS)
    chats = _write_chats(folder / "chats.jsonl", 400, 2)
    policy = train_sft(folder, chats, template, SFT_ITERS, **{"model.seq_length": SEQ})
    return Task(template, prompts, reward_model, accuracy, policy)


def _first_last(xs: list[float], first: int, last: int) -> tuple[float, float]:
    return mean(xs[:first]), mean(xs[-last:])


@pytest.mark.e2e
@pytest.mark.slow  # a reward model, SFT and two 20-step GRPO runs: about a minute on 2 cores
def test_grpo_raises_a_reward_models_score_and_its_behaviour(task, tmp_path, monkeypatch):
    assert task.accuracy > 0.9, task.accuracy  # the reward model learned the preference
    up = grpo(tmp_path / "up", task, GRPO_ITERS, 1.0, monkeypatch)
    down = grpo(tmp_path / "down", task, GRPO_ITERS, -1.0, monkeypatch)
    seen = {
        "scores": [round(x, 3) for x in up.scores],
        "flipped scores": [round(x, 3) for x in down.scores],
        "share of a": [round(x, 3) for x in up.shares()],
        "flipped share of a": [round(x, 3) for x in down.shares()],
    }
    # the same SFT policy, seed and prompts: the same first completions
    assert up.answers[0] == down.answers[0] and up.scores[0] == down.scores[0]
    assert up.share(0, LETTERS) > 0.9, up.answers[0]  # SFT taught the answer format
    assert 0.15 < up.share(0) < 0.4, seen  # random letters: about a quarter are 'a'
    first, last = _first_last(up.scores, 3, 5)
    flipped_first, flipped_last = _first_last(down.scores, 3, 5)
    first_a, last_a = _first_last(up.shares(), 3, 5)
    flipped_first_a, flipped_last_a = _first_last(down.shares(), 3, 5)
    print(  # the numbers docs/grpo.md quotes (pytest -s shows them)
        f"reward model accuracy {task.accuracy:.3f}; score {first:.2f} -> {last:.2f} "
        f"(flipped {flipped_last:.2f}), share of 'a' {first_a:.2f} -> {last_a:.2f} "
        f"(flipped {flipped_last_a:.2f})"
    )
    # step-to-step noise: the spread of the last steps' means about their mean
    noise = max(statistics.pstdev(up.scores[-5:]), statistics.pstdev(down.scores[-5:]))
    assert last > first + max(1.0, 10 * noise), seen
    assert last_a > first_a + 0.3, seen
    # the SFT policy's few 'a's already score near the reward model's floor: less room down
    assert flipped_last < flipped_first - max(0.3, 5 * noise), seen
    assert flipped_last_a < flipped_first_a - 0.1, seen
