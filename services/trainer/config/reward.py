"""The `[reward]` section: training a reward model on preference pairs (Bradley–Terry).

Read when `train.objective = "reward"`; the pairs are DPO's (`meshtrain data preprocess-pairs`),
and docs/grpo.md gives TRL's name for each key.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.services.common.errors import ConfigError


@dataclass
class RewardConfig:
    """Reward-model training (TRL's RewardTrainer)."""

    data_path: str | None = None
    """Prefix of the preference pairs (`meshtrain data preprocess-pairs` writes it, as for DPO)."""
    valid_data_path: str | None = None
    """Prefix of held-out pairs, evaluated every train.eval_interval steps (unset: none)."""
    margin: float = 0.0
    """Subtracted from every pair's reward difference inside the loss,
    -log sigmoid(r_chosen - r_rejected - margin) (TRL takes one per pair from a `margin` column;
    here one for all pairs)."""
    center_rewards_coefficient: float = 0.0
    """Weight of the mean squared (r_chosen + r_rejected) added to the loss, which keeps the
    rewards centered on zero (TRL's center_rewards_coefficient; 0: off)."""

    def __post_init__(self) -> None:
        if self.center_rewards_coefficient < 0:
            raise ConfigError(
                f"reward.center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0"
            )
