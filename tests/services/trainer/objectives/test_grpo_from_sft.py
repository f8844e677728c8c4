"""SFT, then GRPO from its checkpoint, with the rollouts sampled by a separate worker process.

The task is single-digit addition with a sum below ten, asked in a small chat format
("Q: 3+4=\\nA: " -> "7\\n"). A tiny byte-level model is trained on the chats for a few dozen
steps through the real SFT path (`preprocess_chat`, `data.format = "sft"`): it learns the
format but still gets many sums wrong. GRPO then starts from that checkpoint
(`checkpoint.load` + `checkpoint.finetune`, as docs/grpo.md says), rewarded by the repository's
exact-match reward (`rewards.exact_answer`: 1 for "7\\n", 0.5 for a right digit followed by
other text), with every completion sampled by `meshtrain rollout serve` in its own process and
the weights streamed to it before each batch. Each policy is scored the same way, through
the worker: 16 samples of every prompt at temperature 1 with fixed seeds. The reward must rise
clearly above the SFT model's (observed 0.374 -> 0.483, the run's last ten steps 0.48); the
same run with the advantages' sign flipped must fall instead (observed 0.000), so the test can
fail. GRPO sharpens the policy towards its most likely answer, so the gain is bounded by how
often that answer is right; a higher learning rate (2e-3) wrecks the SFT policy within a step.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.services.dataloader.chat import load_chat_template
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.objectives import grpo_steps
from meshtrain.services.trainer.objectives.rewards import exact_answer
from meshtrain.services.trainer.train import train
from tests.services.trainer.objectives.chat_task import (
    MODEL,
    cli_args,
    mean,
    metric_rows,
    train_sft,
    write_template,
)

ROOT = Path(__file__).resolve().parents[4]
PAIRS = [(a, b) for a in range(10) for b in range(10) if a + b < 10]
SFT_ITERS = 90
GRPO_ITERS = 30
GRPO_BATCH, GROUP, GRPO_LR = 128, 16, 1e-3
LAST = 10  # the steps the learned reward is averaged over


def _write_task(folder: Path) -> tuple[Path, Path, Path]:
    """The chat template, the SFT chats (400 random sums) and the GRPO prompts (every sum)."""
    template = write_template(folder)
    rng = random.Random(0)
    chats = folder / "chats.jsonl"
    with open(chats, "w") as f:
        for _ in range(400):
            a, b = rng.choice(PAIRS)
            asked = [{"role": "user", "content": f"{a}+{b}="}]
            answer = {"role": "assistant", "content": str(a + b)}
            f.write(json.dumps({"messages": [*asked, answer]}) + "\n")
    prompts = folder / "prompts.jsonl"
    with open(prompts, "w") as f:
        for a, b in PAIRS:
            asked = [{"role": "user", "content": f"{a}+{b}="}]
            f.write(json.dumps({"messages": asked, "answer": str(a + b)}) + "\n")
    return template, chats, prompts


class Worker:
    """`meshtrain rollout serve` on the SFT checkpoint, in its own process, on a free port; it
    loads the steps the GRPO run saves under `published` when asked (`exact_match`)."""

    def __init__(self, ckpt: Path, published: Path):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        env.pop("MESHTRAIN_TOKEN", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshtrain.services.cli", "rollout", "serve"]
            + ["--load", str(ckpt), "--version", "0", "--eod-id", "256"]
            + ["--checkpoint-root", str(published), "--port", "0", "--device", "cpu"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._address: str | None = None

    @property
    def address(self) -> str:
        """host:port, once the worker says it listens (it prints the port it bound)."""
        if self._address is None:
            assert self.proc.stdout is not None
            lines = []
            for line in self.proc.stdout:
                lines.append(line)
                if line.startswith("listening on "):
                    self._address = line.split()[-1]
                    break
            else:
                pytest.fail(f"rollout serve exited ({self.proc.wait()}):\n{''.join(lines)}")
        return self._address

    def exact_match(self, template: Path, step: int | None = None) -> float:
        """The mean exact-match reward of its policy (after loading `step` of the published
        checkpoints, when given) over 16 samples of every prompt, with fixed seeds."""
        from meshtrain.services.rollout.rpc.client import RolloutClient
        from meshtrain.services.rollout.types import RolloutRequest, SamplingParams

        tok = build_tokenizer("byte")
        chat = load_chat_template(str(template), tok)
        asked = [chat.render([{"role": "user", "content": f"{a}+{b}="}], True) for a, b in PAIRS]
        request = RolloutRequest(
            [tok.encode(text) for text in asked],
            group_size=16,
            sampling=SamplingParams(max_new_tokens=2, seed=11),
        )
        with RolloutClient([self.address], timeout_s=120) as client:
            if step is not None:
                client.update_weights(step)
            completions = client.generate(request)
        scores = [
            exact_answer(
                prompt=asked[c.prompt_index],
                completion=tok.decode([t for t in c.tokens if t != tok.eod_id]),
                answer=str(sum(PAIRS[c.prompt_index])),
            )
            for c in completions
        ]
        assert len(scores) == 16 * len(PAIRS)
        return sum(scores) / len(scores)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def _grpo(folder: Path, ckpt: Path, prompts: Path, template: Path, worker: Worker) -> list[float]:
    """The mean reward of each step of a GRPO run from the SFT checkpoint, which saves its
    last step under `folder`/ckpt."""
    settings = {
        **MODEL,
        "train.objective": "grpo",
        "train.micro_batch_size": 32,
        "train.global_batch_size": GRPO_BATCH,
        "train.train_iters": GRPO_ITERS,
        "train.seed": 3,
        "optim.lr": GRPO_LR,
        "optim.min_lr": GRPO_LR,
        "log.run_dir": str(folder),
        "log.log_interval": 1,
        "checkpoint.load": str(ckpt),
        "checkpoint.finetune": True,
        "checkpoint.save": str(folder / "ckpt"),
        "checkpoint.save_interval": GRPO_ITERS,
        "grpo.prompts_path": str(prompts),
        "grpo.chat_template": str(template),
        "grpo.group_size": GROUP,
        "grpo.max_new_tokens": 2,
        "grpo.reward_funcs": '["meshtrain.services.trainer.objectives.rewards:exact_answer"]',
        "grpo.rollout": "service",
        "grpo.rollout_addresses": json.dumps([worker.address]),
        "grpo.max_staleness": 0,
    }
    result = train(load_config(cli_args(**settings)))
    return [r["reward"] for r in metric_rows(result.run_dir) if "reward" in r]


@pytest.mark.e2e
@pytest.mark.slow  # SFT, two GRPO runs and two worker processes: about a minute on 2 cores
def test_grpo_from_an_sft_checkpoint_raises_the_exact_match_reward(tmp_path, monkeypatch):
    template, chats, prompts = _write_task(tmp_path)
    ckpt = train_sft(tmp_path, chats, template, SFT_ITERS)
    runs = {name: tmp_path / name for name in ("grpo", "flipped")}
    # one worker per run (a run numbers its versions from 0); both start up together
    workers = {name: Worker(ckpt, folder / "ckpt") for name, folder in runs.items()}
    try:
        sft = workers["grpo"].exact_match(template)
        rewards = _grpo(runs["grpo"], ckpt, prompts, template, workers["grpo"])
        learned = workers["grpo"].exact_match(template, GRPO_ITERS)
        real = grpo_steps.group_advantages
        monkeypatch.setattr(grpo_steps, "group_advantages", lambda *a, **k: -real(*a, **k))
        flipped = _grpo(runs["flipped"], ckpt, prompts, template, workers["flipped"])
        unlearned = workers["flipped"].exact_match(template, GRPO_ITERS)
    finally:
        for w in workers.values():
            w.stop()
    seen = f"exact match: sft {sft:.3f}, grpo {learned:.3f}, flipped {unlearned:.3f}"
    assert len(rewards) == len(flipped) == GRPO_ITERS
    assert flipped[0] == rewards[0]  # the same SFT policy, seed and prompts: the same samples
    assert 0.15 < sft < 0.6, seen  # SFT taught the format, not every sum
    assert learned > sft + 0.06, (seen, rewards)
    assert mean(rewards[-LAST:]) > sft + 0.06, (seen, rewards)  # the run's samples agree
    assert unlearned < sft - 0.1, (seen, flipped)
