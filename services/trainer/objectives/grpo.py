"""The GRPO loss (group-relative policy optimization) and the LM head that computes it.

A batch of rollouts holds, for each prompt, a group of G sampled completions with their rewards.
`group_advantages` turns the rewards into advantages, each completion's reward minus its group's
mean, divided by the group's standard deviation (+ eps) unless `scale_rewards = "none"` (Dr.
GRPO). `grpo_loss` is the clipped policy-ratio loss over the completion tokens, with a KL penalty
against a frozen reference (the k3 estimator, weight beta):

    ratio_t = exp(logp_t - old_logp_t)
    loss_t  = -min(ratio_t A, clip(ratio_t, 1 - eps_low, 1 + eps_high) A)
              + beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

aggregated per token over the whole batch ("token-mean", TRL's `dapo`, verl's `token-mean`), per
sequence then over sequences ("sequence-mean", the GRPO paper, TRL's `grpo`), or summed and
divided by sequences x max_new_tokens ("sequence-sum-norm", Dr. GRPO, TRL's `dr_grpo`).

The batch is split over micro-batches and data-parallel ranks, so the loss of a micro-batch is
its share of the batch's: the sums over its tokens (or sequences) times `RolloutTargets.scale`,
which the caller sets from the global token (or sequence) count. The statistics (KL, clip ratios)
are sums a caller adds over micro-batches and ranks before dividing (`finish_loss_stats`).

`GRPOHead` takes the place of a model's LM head (`LMHead`, or `VocabParallelHead` under tensor
parallelism), as `PreferenceHead` does for DPO. Its micro-batches' old log-probs are the
policy's own, taken in the forward of the first optimizer step on a batch of rollouts (with the
same weights as before the first update, so equal to TRL's recomputation) and kept in the
targets for the batch's later steps (`num_iterations` > 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.services.trainer.objectives.heads import ObjectiveHead, WrappedHead

LOSS_TYPES = ("token-mean", "sequence-mean", "sequence-sum-norm")
SCALE_REWARDS = ("group", "batch", "none")
LOSS_STAT_NAMES = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""What `grpo_loss` sums per completion token (TRL's metric names), then the token count."""


@dataclass(frozen=True)
class GRPOLoss:
    """The loss's settings (the `[grpo]` section's, see config/grpo.py)."""

    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    """Upper clip (DAPO's clip-higher); None: epsilon."""
    loss_type: str = "token-mean"
    max_new_tokens: int = 64
    """The completion budget: sequence-sum-norm divides by it."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r}; allowed: {', '.join(LOSS_TYPES)}")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Advantages of (prompts * G,) rewards laid out group by group.

    A = r - mean(group); divided by std(group) + eps ("group", sample std as TRL), by the std of
    the whole batch + eps ("batch"), or not at all ("none", Dr. GRPO). TRL's eps is 1e-4.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards {scale_rewards!r}; allowed: {', '.join(SCALE_REWARDS)}")
    grouped = rewards.view(-1, group_size)  # (prompts, G)
    advantages = (grouped - grouped.mean(1, keepdim=True)).flatten()
    if scale_rewards == "group":
        std = grouped.std(1) if group_size > 1 else torch.zeros(grouped.shape[0])
        advantages = advantages / (std.repeat_interleave(group_size) + eps)
    elif scale_rewards == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (std + eps)
    return advantages


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss: GRPOLoss,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's share of the GRPO loss, and its summed statistics.

    Args:
        logps: (batch, seq) log-probs of the completion tokens under the policy (with grad).
        old_logps: (batch, seq) the same under the policy that the ratio is taken against.
        ref_logps: (batch, seq) under the frozen reference; None when beta is 0.
        advantages: (batch,) one per completion.
        mask: (batch, seq) 1 on completion tokens.
        loss: the settings.
        scale: 1 / the batch's completion tokens (token-mean), sequences (sequence-mean) or
            sequences x max_new_tokens (sequence-sum-norm), times what the caller's averaging
            over micro-batches and ranks divides by.

    Returns:
        (loss, stats): stats is a (len(LOSS_STAT_NAMES) + 1,) fp32 tensor of sums over the
        completion tokens, the last entry their count, detached.
    """
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)  # (batch, 1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - loss.epsilon, 1 + loss.eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if loss.beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo: beta > 0 needs the reference log-probs")
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1  # k3: unbiased, non-negative estimate of KL(policy || ref)
        per_token = per_token + loss.beta * kl
    if loss.loss_type == "sequence-mean":
        value = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() * scale
    else:
        value = (per_token * mask).sum() * scale
    with torch.no_grad():
        low = ((ratio < 1 - loss.epsilon) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + loss.eps_high) & (adv > 0)).to(mask.dtype)
        kl_sum = (kl * mask).sum() if kl is not None else mask.new_zeros(())
        stats = torch.stack(
            [
                kl_sum,
                (low * mask).sum(),
                (high * mask).sum(),
                (torch.maximum(low, high) * mask).sum(),
                mask.sum(),
            ]
        ).float()
    return value, stats


def finish_loss_stats(stats: torch.Tensor, beta: float) -> dict[str, float]:
    """Summed statistics (over micro-batches and ranks) -> TRL's means per completion token."""
    values = stats.tolist()
    n = max(values[-1], 1.0)
    out = {name: v / n for name, v in zip(LOSS_STAT_NAMES, values[:-1], strict=True)}
    if beta == 0.0:
        del out["kl"]  # TRL logs it only with a reference
    return out


@dataclass
class RolloutTargets:
    """What the GRPO head needs of a micro-batch besides its labels (tokens shifted by one)."""

    loss_mask: torch.Tensor  # (batch, seq) float: 1 on completion tokens (as labels)
    advantages: torch.Tensor  # (batch,) fp32
    scale: float
    """See `grpo_loss`."""
    ref_logps: torch.Tensor | None = None  # (batch, seq) fp32, or None (beta 0)
    old_logps: torch.Tensor | None = None
    """(batch, seq) fp32; None until the first step on the batch fills it in (module docstring)."""


class GRPOHead(ObjectiveHead):
    """The LM head of a policy under GRPO (see the module docstring).

    `loss(h, weight, labels, targets)` returns the micro-batch's share of the GRPO loss and adds
    its statistics to `stats` (reset by the caller each step). Without parameters: swapping it in
    changes neither the optimizer nor the checkpoints.
    """

    def __init__(self, base: nn.Module, loss: GRPOLoss):
        super().__init__(base, loss)

    def loss(self, h, weight, labels, targets: RolloutTargets) -> torch.Tensor:
        logps = self.base.token_logps(h, weight, labels).float()  # (batch, seq)
        if targets.old_logps is None:
            targets.old_logps = logps.detach()
        value, stats = grpo_loss(
            logps,
            targets.old_logps,
            targets.ref_logps,
            targets.advantages,
            targets.loss_mask,
            self.objective,
            targets.scale,
        )
        self.keep(stats)
        return value


class TokenLogpsHead(WrappedHead):
    """The frozen reference's head under GRPO: `loss(h, weight, labels, loss_mask)` returns the
    (batch, seq) fp32 log-probs of the labels, zero outside the mask."""

    def loss(self, h, weight, labels, loss_mask) -> torch.Tensor:
        logps = self.base.token_logps(h, weight, labels).float()
        return logps * loss_mask.to(logps.dtype)
