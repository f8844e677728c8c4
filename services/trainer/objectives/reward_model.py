"""Reward models in the trainer: the Bradley–Terry loss, the head that computes it, and the
objective `Trainer` runs when `train.objective = "reward"` (docs/grpo.md, "Reward models").

A reward model is the GPT with a scalar head (`model.reward_head`: `score.weight`, a bias-free
hidden -> 1 linear, saved in the checkpoint like every parameter, recorded in its model config).
Its reward of a sequence is the head applied to the final-norm hidden state of the sequence's
last token (prompt + completion; the EOD that ends the completion is a label, never an input).
On preference pairs (DPO's data, `reward.data_path`), with r_c and r_r the rewards of a pair's
chosen and rejected sequences, the loss is TRL RewardTrainer's

    loss = mean(-log sigmoid(r_c - r_r - margin)) + center_rewards_coefficient * mean((r_c + r_r)^2)

    loss, stats = reward_loss(chosen, rejected, RewardLoss(margin=0.0))
    head = RewardHead(model.head, RewardLoss())      # model.head <- head (`use_head`)
    rewards = last_token_rewards(h, score_weight, last_positions(loss_mask))

`RewardHead` stands in for the LM head as DPO's `PreferenceHead` does (without parameters of its
own: the scalar head is the model's, passed in as the forward's output weight).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.dataloader.tokenizers.base import absolute_spec, build_tokenizer
from meshtrain.services.trainer.config.reward import RewardConfig
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.data import TrainData
from meshtrain.services.trainer.objectives.base import Objective, check_token_ids
from meshtrain.services.trainer.objectives.dpo import (
    evaluate_pairs,
    pair_micro_batches,
    pair_sources,
    reduce_stats,
)
from meshtrain.services.trainer.objectives.heads import ObjectiveHead
from meshtrain.services.trainer.objectives.preference import PairTargets, finish_stats
from meshtrain.services.trainer.parallel.mesh import Mesh

log = logging.getLogger("meshtrain.train")

STAT_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "accuracy")
"""What `reward_loss` sums per pair, then the pair count."""


@dataclass(frozen=True)
class RewardLoss:
    """The loss's settings (the `[reward]` section's)."""

    margin: float = 0.0
    center_rewards_coefficient: float = 0.0


def last_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """(batch, seq) completion mask -> (batch,) index of each row's last masked position: the
    sequence's last input token (its label is the EOD)."""
    seq = loss_mask.shape[1]
    return seq - 1 - (loss_mask.flip(-1) > 0).int().argmax(-1)


def last_token_rewards(h: torch.Tensor, weight: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """(batch, seq, hidden) hidden states, the (1, hidden) scalar head, (batch,) positions ->
    (batch,) fp32 rewards."""
    rows = torch.arange(h.shape[0], device=h.device)
    picked = h[rows, last]  # (batch, hidden)
    return F.linear(picked, weight).squeeze(-1).float()


def reward_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, loss: RewardLoss
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean Bradley–Terry loss over (pairs,) rewards (module docstring), and the summed
    statistics: a (len(STAT_NAMES) + 1,) fp32 tensor, the last entry the pair count, detached."""
    value = -F.logsigmoid(chosen - rejected - loss.margin).mean()
    if loss.center_rewards_coefficient:
        value = value + loss.center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        stats = torch.stack(
            [
                chosen.sum(),
                rejected.sum(),
                (chosen - rejected).sum(),
                (chosen > rejected).float().sum(),
                torch.tensor(float(chosen.numel()), device=chosen.device),
            ]
        ).float()
    return value, stats


class RewardHead(ObjectiveHead):
    """A reward model's head under training: `loss(h, weight, labels, targets)`, `weight` the
    scalar head's (1, hidden), returns the micro-batch's mean Bradley–Terry loss over its pairs
    (chosen sequences first, then rejected) and keeps its statistics."""

    def __init__(self, base: nn.Module, loss: RewardLoss):
        super().__init__(base, loss)

    def loss(self, h, weight, labels, targets: PairTargets) -> torch.Tensor:
        rewards = last_token_rewards(h, weight, last_positions(targets.loss_mask))
        chosen, rejected = rewards.chunk(2)
        value, stats = reward_loss(chosen, rejected, self.objective)
        self.keep(stats)
        return value


def check_reward_job(job: JobConfig, mesh: Mesh) -> None:
    """Refuse what reward-model training does not run with, naming the setting.

    Raises:
        ConfigError: no pairs, the data service, pipeline or context parallelism, sequence
            parallelism, FSDP or CUDA graphs.
    """
    if not job.reward.data_path:
        raise ConfigError("train.objective='reward' needs reward.data_path (preprocessed pairs)")
    for what, bad in (
        ("parallel.pipeline_model_parallel_size > 1", mesh.pp > 1),
        ("parallel.cp > 1", mesh.cp > 1),
        # the last token's hidden state would sit on one rank's slice of the sequence
        ("parallel.sequence_parallel", job.parallel.sequence_parallel),
        ("parallel.use_torch_fsdp2", job.parallel.fully_sharded),
        ("train.cuda_graph", job.train.cuda_graph),
        ("data.service_addresses (pairs are read in-process)", bool(job.data.service_addresses)),
    ):
        if bad:
            raise ConfigError(f"train.objective='reward' with {what} is not supported yet")


def build_reward_data(job: JobConfig, dp_rank: int, dp_size: int) -> TrainData:
    """The train (and valid) pair sources of this data-parallel rank."""
    r = job.reward
    tok = build_tokenizer(job.data.tokenizer)
    assert r.data_path is not None  # check_reward_job
    train, valid = pair_sources(job, dp_rank, dp_size, r.data_path, r.valid_data_path)
    log.info("reward data: %s (%d pairs)", r.data_path, train.pairs.num_pairs)
    return TrainData(train, valid, tok.vocab_size, absolute_spec(job.data.tokenizer), r.data_path)


def reward_settings(r: RewardConfig) -> RewardLoss:
    return RewardLoss(r.margin, r.center_rewards_coefficient)


class RewardModeling(Objective):
    """train.objective = 'reward': pairs in, the Bradley–Terry loss out of the scalar head."""

    def __init__(self, job: JobConfig, mesh: Mesh):
        check_reward_job(job, mesh)
        super().__init__(job, mesh)
        self.config = job.reward
        self.head: RewardHead | None = None
        self.stats: torch.Tensor | None = None  # the last step's, summed on this rank
        self.eval_stats: dict[str, float] = {}

    def build_data(self, job: JobConfig, mesh: Mesh) -> TrainData:
        return build_reward_data(job, mesh.dp_rank, mesh.dp)

    def use_head(self, model: nn.Module) -> None:
        if getattr(model, "score", None) is None:
            raise ConfigError("train.objective='reward' needs model.reward_head (a scalar head)")
        self.head = RewardHead(cast(nn.Module, model.head), reward_settings(self.config))
        model.head = self.head

    def micro_batches(self, step: int, reads: bool) -> list | None:
        source: Any = self.trainer.data.train
        return source.micro_batches(step) if reads else None

    def inputs(self, micro: list | None, n: int) -> list:
        """(tokens, labels, PairTargets) of each micro-batch on the device."""
        trainer = self.trainer
        if micro is None:
            return [None] * n
        for b in micro:
            check_token_ids(b, trainer.job, trainer.data)
        return pair_micro_batches(micro, lambda ts: next(iter(trainer.uploader.upload([ts]))), None)

    def end_step(self) -> None:
        assert self.head is not None
        self.stats = self.head.take_stats()

    def step_metrics(self) -> dict[str, float]:
        stats = reduce_stats(self.stats, self.mesh, self.trainer.device, STAT_NAMES)
        return finish_stats(stats, STAT_NAMES)

    def evaluate(self) -> float:
        """The mean loss over the held-out pairs, and their statistics in `eval_metrics`."""
        loss, self.eval_stats = evaluate_pairs(self, STAT_NAMES)
        return loss

    def eval_metrics(self) -> dict[str, float]:
        return self.eval_stats
