"""DPO sharded equals DPO in one process: tp=2, pp=2 and dp=2 (2 gloo ranks each).

The real trainer runs 4 steps of DPO with the frozen reference on the same mesh (sharded like
the policy) and is compared with one process on the same pairs: every step's loss and TRL's
metrics, and the final parameters read back from the checkpoints. The byte vocabulary (257)
does not divide by tp, so the vocab-parallel log-softmax's padding is exercised. Tolerance: fp32
with different reduction orders, as in tests/services/trainer/parallel/test_equivalence.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain.services.checkpoint.reader import load_checkpoint
from meshtrain.services.dataloader.preference import write_pairs
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.dist_utils import run_ranks
from tests.services.trainer.objectives.test_dpo_train import job_args, synthetic_pairs

pytestmark = pytest.mark.dist

STEPS = 4
COMMON = {
    "train.train_iters": STEPS,
    "train.eval_interval": 2,
    "train.eval_iters": 1,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 8,
}


def _rank_train(rank, world, args):
    result = train(load_config(args))
    rows = []
    if rank == 0:
        text = (result.run_dir / "metrics.jsonl").read_text()
        rows = [json.loads(x) for x in text.splitlines()]
    return {
        "losses": result.losses,
        "eval": result.eval_losses,
        "checkpoint": result.checkpoint,
        "rows": rows,
    }


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    tok = build_tokenizer("byte")
    synthetic_pairs(d / "train.jsonl", 40, seed=0)
    synthetic_pairs(d / "valid.jsonl", 16, seed=1)
    write_pairs(d / "train.jsonl", d / "train", tok, max_length=17)
    write_pairs(d / "valid.jsonl", d / "valid", tok, max_length=17)
    return d / "train", d / "valid"


_single: dict = {}


def single(pairs, tmp_path_factory, loss_type):
    if loss_type not in _single:
        run = tmp_path_factory.mktemp(f"single-{loss_type}")
        _single[loss_type] = _rank_train(0, 1, args_for(run, pairs, loss_type, {}))
    return _single[loss_type]


def args_for(run, pairs, loss_type, extra):
    losses = {
        "sigmoid": {"dpo.label_smoothing": 0.1},
        "ipo": {"dpo.loss_type": "ipo"},
        "simpo": {"dpo.loss_type": "simpo", "dpo.reference": "none", "dpo.beta": 2.0},
    }[loss_type]
    args = {**COMMON, **losses, **extra}
    out = job_args(run, pairs[0], pairs[1], **args)
    if "parallel.pp" in extra:  # held-out evaluation runs without a pipeline
        out = [a for a in out if not a.startswith("--dpo.valid_data_path")]
    return out


CASES = {
    "tp2": ({"parallel.tp": 2}, "sigmoid"),
    "tp2-sp-ipo": ({"parallel.tp": 2, "parallel.sequence_parallel": True}, "ipo"),
    "pp2": ({"parallel.pp": 2}, "sigmoid"),
    "dp2": ({}, "sigmoid"),
    "dp2-zero1-simpo": ({"parallel.use_distributed_optimizer": True}, "simpo"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_dpo_matches_single_process(case, pairs, tmp_path, tmp_path_factory):
    extra, loss_type = CASES[case]
    ref = single(pairs, tmp_path_factory, loss_type)
    got = run_ranks(
        _rank_train, 2, args_for(tmp_path / "run", pairs, loss_type, extra), timeout=300
    )
    r0 = got[0]
    assert sorted(r0["losses"]) == list(range(1, STEPS + 1))
    for step, loss in ref["losses"].items():
        assert r0["losses"][step] == pytest.approx(loss, rel=2e-6, abs=2e-6), f"step {step}"
    if "parallel.pp" not in extra:
        for step, loss in ref["eval"].items():
            assert r0["eval"][step] == pytest.approx(loss, rel=2e-6, abs=2e-6), f"eval {step}"
    want = [r for r in ref["rows"] if "rewards/margins" in r]
    have = [r for r in r0["rows"] if "rewards/margins" in r]
    assert len(have) == len(want) == STEPS
    for w, h in zip(want, have, strict=True):
        for name in ("rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert h[name] == pytest.approx(w[name], rel=1e-5, abs=1e-6), (name, w["step"])
    tensors, _ = load_checkpoint(r0["checkpoint"].rsplit("/", 1)[0], STEPS)
    ref_tensors, _ = load_checkpoint(ref["checkpoint"].rsplit("/", 1)[0], STEPS)
    weights = {name for name in ref_tensors if not name.startswith("rng.")}
    assert {name for name in tensors if not name.startswith("rng.")} == weights
    for name in weights:
        torch.testing.assert_close(tensors[name], ref_tensors[name], rtol=0, atol=2e-5, msg=name)
