"""What every post-training head shares: it stands in for the model's LM head (an `LMHead` or
a `VocabParallelHead`, kept as `base`), adds no parameters (so swapping it in changes neither
the optimizer nor the checkpoints), passes `logits` through, and, for a policy's head, sums
each micro-batch's statistics until the loop takes them once a step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class WrappedHead(nn.Module):
    """A head over `base` (LMHead or VocabParallelHead: `token_logps`, `logits`)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base: Any = base

    @property
    def vocab_size(self) -> int:
        return int(self.base.vocab_size)

    def logits(self, h, weight):
        return self.base.logits(h, weight)


class ObjectiveHead(WrappedHead):
    """A policy's head whose `loss` computes an objective and keeps its statistics."""

    def __init__(self, base: nn.Module, objective: Any):
        super().__init__(base)
        self.objective = objective
        self.stats: torch.Tensor | None = None

    def keep(self, stats: torch.Tensor) -> None:
        """Add one micro-batch's statistics to the step's."""
        self.stats = stats if self.stats is None else self.stats + stats

    def take_stats(self) -> torch.Tensor | None:
        """The statistics summed since the last call (None if no micro-batch ran here)."""
        stats, self.stats = self.stats, None
        return stats
