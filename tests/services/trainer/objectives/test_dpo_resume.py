"""The frozen reference across checkpoints: loaded from dpo.reference_load (another checkpoint
than the policy's start), a resume past step 0 without it refused, and a DPO run stopped at a
checkpoint and resumed giving the uninterrupted run's losses exactly (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from meshtrain.services.checkpoint.reader import list_checkpoints
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.checkpointing import load_checkpoint
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.objectives.dpo import pair_micro_batches
from meshtrain.services.trainer.train import Trainer, train
from tests.services.trainer.objectives.test_dpo_reference import (  # noqa: F401 (fixtures)
    args,
    pairs,
    start,
    starting_checkpoint,
)


def weights(model) -> dict[str, torch.Tensor]:
    """Parameters by the plain GPT's names (the DPO heads wrap the LM head as `base`)."""
    return {n.replace("head.base.", "head."): p.detach() for n, p in model.named_parameters()}


def test_the_reference_loads_dpo_reference_load(tmp_path, pairs, start):
    other = starting_checkpoint(tmp_path / "o", pairs, tmp_path / "other", seed=11)
    job = load_config(
        args(tmp_path / "r", pairs, **{"checkpoint.load": start, "dpo.reference_load": other})
    )
    trainer = Trainer(job)
    assert trainer.reference is not None
    want, policy = GPT(trainer.job.model), GPT(trainer.job.model)
    load_checkpoint(other, want)
    load_checkpoint(start, policy)
    ref, pol = weights(trainer.reference.model), weights(trainer.model)
    assert ref.keys() == weights(want).keys()
    for name, w in weights(want).items():
        assert torch.equal(ref[name], w), name
        assert torch.equal(pol[name], weights(policy)[name]), name
    assert any(not torch.equal(ref[n], pol[n]) for n in ref)  # two models, not one
    # the reference's log-probs are the other checkpoint's, not the policy's
    b = trainer.data.train.micro_batches(0)[0]
    (sums,) = trainer.reference.logps(pair_micro_batches([b], lambda ts: ts, None))
    assert sums is not None
    want_logps = (
        want.head.token_logps(want.hidden_states(b.tokens), want.output_weight, b.labels)
        * b.loss_mask
    ).sum(-1)
    torch.testing.assert_close(sums, want_logps, rtol=0, atol=0)


def test_resume_past_step_zero_needs_dpo_reference_load(tmp_path, pairs, start):
    ckpt = str(tmp_path / "ckpt")
    common = {"checkpoint.save_interval": 2, "train.train_iters": 4}
    train(
        load_config(
            args(
                tmp_path / "a",
                pairs,
                **common,
                **{"checkpoint.load": start, "checkpoint.save": ckpt},
            )
        )
    )
    assert list_checkpoints(ckpt) == [2, 4]
    resumed = {"checkpoint.load": ckpt, "checkpoint.load_step": 2, "checkpoint.save": ckpt + "2"}
    with pytest.raises(ConfigError, match="resumes at step 2.*set dpo.reference_load"):
        Trainer(load_config(args(tmp_path / "b", pairs, **common, **resumed)))


@pytest.mark.e2e
def test_a_resumed_dpo_run_equals_the_uninterrupted_one(tmp_path, pairs, start):
    ckpt = str(tmp_path / "ckpt")
    # dropout: the policy's RNG, restored from its checkpoint, must not be moved by the
    # reference's load (which restores the RNG states of the checkpoint it reads)
    common = {
        "checkpoint.save_interval": 2,
        "train.train_iters": 5,
        "train.eval_interval": 2,
        "model.hidden_dropout": 0.1,
        "model.attention_dropout": 0.1,
    }
    full = train(
        load_config(
            args(
                tmp_path / "a",
                pairs,
                **common,
                **{"checkpoint.load": start, "checkpoint.save": ckpt},
            )
        )
    )
    assert list_checkpoints(ckpt) == [2, 4, 5]
    resumed = train(
        load_config(
            args(
                tmp_path / "b",
                pairs,
                **common,
                **{
                    "checkpoint.load": ckpt,
                    "checkpoint.load_step": 2,
                    "checkpoint.save": str(tmp_path / "ck2"),
                    "dpo.reference_load": start,
                },
            )
        )
    )
    assert sorted(resumed.losses) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed.losses[step] == full.losses[step], step
    assert resumed.eval_losses == {s: v for s, v in full.eval_losses.items() if s > 2}
    assert resumed.eval_losses  # evaluation ran after the resume
