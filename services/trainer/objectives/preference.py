"""Preference-tuning losses (DPO, conservative DPO, IPO, SimPO) and the LM head that computes them.

The losses take per-sequence log-probabilities: the sum over a completion's tokens of
log p(token | prefix), under the policy and (except SimPO) under a frozen reference, and the
completion's token count. `preference_loss` returns the mean loss over the pairs and the
statistics TRL logs (`rewards/chosen`, `rewards/rejected`, `rewards/margins`,
`rewards/accuracies`, `logps/chosen`, `logps/rejected`), as sums a caller can add over
micro-batches and ranks before dividing by the pair count (`finish_stats`).

    loss, stats = preference_loss(policy, reference, DPOLoss("sigmoid", beta=0.1))

`PreferenceHead` takes the place of a model's LM head (`LMHead`, or `VocabParallelHead` under
tensor parallelism): the model's forward, the pipeline's last stage and the data-parallel
wrapper run as they do for pretraining, and the head turns the hidden states of a micro-batch of
pairs (chosen sequences first, then rejected, as TRL concatenates them) into the preference
loss. `SequenceLogpsHead` is the reference model's head: it returns the per-sequence sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.services.trainer.objectives.heads import ObjectiveHead, WrappedHead

LOSS_TYPES = ("sigmoid", "ipo", "simpo")
STAT_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
"""What `preference_loss` sums per pair (TRL's metric names), then the pair count."""


@dataclass(frozen=True)
class DPOLoss:
    """Which preference loss, and its settings (the `[dpo]` section's, see config/dpo.py)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r}; allowed: {', '.join(LOSS_TYPES)}")

    @property
    def uses_reference(self) -> bool:
        return self.loss_type != "simpo"


@dataclass
class SequenceLogps:
    """Per-sequence sums of completion-token log-probs, and completion token counts, of pairs."""

    chosen: torch.Tensor  # (pairs,) fp32
    rejected: torch.Tensor  # (pairs,)
    chosen_tokens: torch.Tensor  # (pairs,) fp32 counts
    rejected_tokens: torch.Tensor  # (pairs,)

    @classmethod
    def from_sequences(cls, logps: torch.Tensor, tokens: torch.Tensor) -> SequenceLogps:
        """From (2 * pairs,) per-sequence values laid out [chosen..., rejected...]."""
        c, r = logps.chunk(2)
        nc, nr = tokens.chunk(2)
        return cls(c, r, nc, nr)


def preference_loss(
    policy: SequenceLogps, reference: SequenceLogps | None, loss: DPOLoss
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean preference loss over the pairs, and the summed statistics.

    sigmoid (DPO; conservative DPO with label_smoothing e): with
    d = (pc - rc) - (pr - rr), loss = -(1 - e) log s(beta d) - e log s(-beta d).
    ipo: with length-normalized log-ratios (TRL's IPO), d = (pc - rc)/nc - (pr - rr)/nr,
    loss = (d - 1/(2 beta))^2.
    simpo (no reference): d = pc/nc - pr/nr - gamma/beta, loss as sigmoid's with the smoothing.
    Rewards are beta times the log-ratios (SimPO: beta times the mean log-probs), as TRL logs them.

    Returns:
        (loss, stats): stats is a (len(STAT_NAMES) + 1,) fp32 tensor of sums over the pairs,
        the last entry the pair count, detached.
    """
    nc = policy.chosen_tokens.clamp(min=1.0)
    nr = policy.rejected_tokens.clamp(min=1.0)
    beta, e = loss.beta, loss.label_smoothing
    if loss.loss_type == "simpo":
        chosen_score, rejected_score = policy.chosen / nc, policy.rejected / nr
        d = chosen_score - rejected_score - loss.simpo_gamma / beta
        losses = -(1 - e) * F.logsigmoid(beta * d) - e * F.logsigmoid(-beta * d)
    else:
        if reference is None:
            raise ValueError(f"loss_type {loss.loss_type!r} needs reference log-probs")
        chosen_score = policy.chosen - reference.chosen
        rejected_score = policy.rejected - reference.rejected
        if loss.loss_type == "sigmoid":
            d = chosen_score - rejected_score
            losses = -(1 - e) * F.logsigmoid(beta * d) - e * F.logsigmoid(-beta * d)
        else:  # ipo
            d = chosen_score / nc - rejected_score / nr
            losses = (d - 1 / (2 * beta)) ** 2
    with torch.no_grad():
        rc, rr = beta * chosen_score, beta * rejected_score
        stats = torch.stack(
            [
                rc.sum(),
                rr.sum(),
                (rc - rr).sum(),
                (rc > rr).float().sum(),
                policy.chosen.sum(),
                policy.rejected.sum(),
                torch.tensor(float(rc.numel()), device=rc.device),
            ]
        ).float()
    return losses.mean(), stats


def finish_stats(stats: torch.Tensor, names: tuple[str, ...] = STAT_NAMES) -> dict[str, float]:
    """Summed statistics (over micro-batches and ranks; the pair count last) -> means per pair,
    under `names` (DPO's: TRL's names)."""
    values = stats.tolist()
    n = max(values[-1], 1.0)
    return {name: v / n for name, v in zip(names, values[:-1], strict=True)}


def sequence_sums(
    token_logps: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, seq) per-token log-probs and completion mask -> per-sequence (sums, counts)."""
    mask = loss_mask.to(token_logps.dtype)
    return (token_logps * mask).sum(-1), mask.sum(-1)


@dataclass
class PairTargets:
    """What the preference head needs of a micro-batch besides its labels: the completion mask
    and, when the reference is not computed on the fly, its precomputed log-probs."""

    loss_mask: torch.Tensor  # (2 * pairs, seq) float: 1 on completion tokens
    reference: torch.Tensor | None = None  # (2 * pairs,) fp32 reference sums, or None

    def to(self, device: torch.device) -> PairTargets:
        ref = None if self.reference is None else self.reference.to(device, non_blocking=True)
        return PairTargets(self.loss_mask.to(device, non_blocking=True), ref)


class PreferenceHead(ObjectiveHead):
    """The LM head of a policy under preference tuning (see the module docstring).

    `loss(h, weight, labels, targets)` returns the micro-batch's mean preference loss and adds
    its statistics to `stats` (reset by the caller each step). Without parameters: swapping it in
    changes neither the optimizer nor the checkpoints.
    """

    def __init__(self, base: nn.Module, loss: DPOLoss):
        super().__init__(base, loss)

    def loss(self, h, weight, labels, targets: PairTargets) -> torch.Tensor:
        logps, counts = sequence_sums(self.base.token_logps(h, weight, labels), targets.loss_mask)
        policy = SequenceLogps.from_sequences(logps, counts)
        reference = None
        if self.objective.uses_reference:
            if targets.reference is None:
                raise ValueError("dpo: a micro-batch came without its reference log-probs")
            reference = SequenceLogps.from_sequences(targets.reference.to(logps.dtype), counts)
        value, stats = preference_loss(policy, reference, self.objective)
        self.keep(stats)
        return value


class SequenceLogpsHead(WrappedHead):
    """The reference model's head: `loss(h, weight, labels, loss_mask)` returns the per-sequence
    sums of completion log-probs, (batch,) fp32, instead of a mean loss."""

    def loss(self, h, weight, labels, loss_mask) -> torch.Tensor:
        return sequence_sums(self.base.token_logps(h, weight, labels), loss_mask)[0]
