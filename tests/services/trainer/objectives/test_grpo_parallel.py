"""GRPO sharded equals GRPO in one process: tp=2 and dp=2 (2 gloo ranks each).

The real trainer samples, scores and trains 3 steps (num_iterations=2, beta > 0: the frozen
reference and the recorded old log-probs both take part) and is compared with one process on
the same prompts: the losses, the rewards (so the sampled completions), and TRL's metrics. Each
dp rank generates for its own prompts, each prompt from its own seed; the tp ranks of a group
draw the same tokens from the same gathered logits. Tolerance: fp32 with different reduction
orders, as in test_dpo_parallel.py.
"""

from __future__ import annotations

import json

import pytest

from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.dist_utils import run_ranks
from tests.services.trainer.objectives.test_grpo_train import job_args, write_prompts

pytestmark = pytest.mark.dist

EXTRA = {
    "train.train_iters": 3,
    "train.global_batch_size": 16,
    "train.micro_batch_size": 4,
    "grpo.group_size": 4,
    "grpo.num_iterations": 2,
    "grpo.beta": 0.05,
    "grpo.loss_type": "sequence-mean",
}


def _rank_train(rank, world, args):
    result = train(load_config(args))
    rows = []
    if rank == 0:
        text = (result.run_dir / "metrics.jsonl").read_text()
        rows = [json.loads(x) for x in text.splitlines() if '"reward"' in x]
    return {"losses": result.losses, "rows": rows}


@pytest.mark.parametrize("layout", [{"parallel.tp": 2}, {}], ids=["tp2", "dp2"])
def test_sharded_grpo_matches_single_process(layout, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=10)
    ref = _rank_train(0, 1, job_args(tmp_path / "one", prompts, **EXTRA))
    got = run_ranks(
        _rank_train, 2, job_args(tmp_path / "two", prompts, **EXTRA, **layout), timeout=300
    )[0]
    assert sorted(got["losses"]) == [1, 2, 3]
    for step, loss in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, rel=2e-5, abs=2e-6), f"step {step}"
    assert len(got["rows"]) == len(ref["rows"]) == 3
    for w, h in zip(ref["rows"], got["rows"], strict=True):
        for name in ("reward", "reward_std", "completions/mean_length"):
            assert h[name] == w[name], (name, w["step"])  # the same tokens were sampled
        for name in ("kl", "clip_ratio/region_mean"):
            assert h[name] == pytest.approx(w[name], rel=1e-4, abs=1e-6), (name, w["step"])
