"""The `[dpo]` section: preference tuning's loss, its reference model and its data.

Read when `train.objective = "dpo"`; docs/dpo.md gives TRL's and NeMo's name for each key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshtrain.services.common.errors import ConfigError


@dataclass
class DPOConfig:
    """Preference tuning (DPO and its variants)."""

    data_path: str | None = None
    """Prefix of the preference pairs (`meshtrain data preprocess-pairs` writes it)."""
    valid_data_path: str | None = None
    """Prefix of held-out pairs, evaluated every train.eval_interval steps (unset: none)."""
    loss_type: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"
    """sigmoid: DPO (conservative DPO with label_smoothing); ipo: IPO on length-normalized
    log-ratios; simpo: SimPO (reference-free, length-normalized, with a margin)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward (IPO: its regularization tau)."""
    label_smoothing: float = 0.0
    """Probability that a preference label is flipped (conservative DPO, SimPO); in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (the loss subtracts gamma / beta)."""
    reference: Literal["frozen", "precomputed", "none"] = "frozen"
    """frozen: a copy of the starting model on the same mesh computes reference log-probs each
    step; precomputed: read from the column `meshtrain dpo reference` wrote beside the data;
    none: no reference (SimPO only)."""
    reference_load: str | None = None
    """Checkpoint root the frozen reference loads (unset: a copy of the policy as this run
    starts it; a run resumed past step 0 must set it)."""
    reference_load_step: int | None = None
    """Which step of reference_load (unset: its newest)."""

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta={self.beta} must be positive")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ConfigError("dpo.label_smoothing has no meaning for loss_type='ipo'; leave it 0")
        if (self.loss_type == "simpo") != (self.reference == "none"):
            raise ConfigError(
                f"dpo.loss_type={self.loss_type!r} with dpo.reference={self.reference!r}: SimPO is "
                "reference-free (reference='none'), and sigmoid and ipo need a reference "
                "('frozen' or 'precomputed')"
            )
