"""The `[dpo]` section: preference tuning's loss, its reference model and its data.

Read when `train.objective = "dpo"`; docs/dpo.md gives TRL's and NeMo's name for each key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from meshtrain.services.common.errors import ConfigError

if TYPE_CHECKING:
    from meshtrain.services.trainer.config.sections import JobConfig


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
    step; precomputed: read from the column `meshtrain dpo reference --config CONFIG` wrote
    beside the data (PREFIX.ref_logps.npy, computed by the same model once);
    none: no reference (SimPO only)."""
    reference_load: str | None = None
    """Checkpoint root the reference model loads, frozen or in `meshtrain dpo reference`
    (unset: the policy as this run starts it, i.e. checkpoint.load; a run with a frozen
    reference resumed past step 0 must set it)."""
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


def reference_checkpoint(job: JobConfig) -> tuple[str, int | None]:
    """(root, step or None for its newest) of the model the reference is: dpo.reference_load,
    else checkpoint.load.

    Raises:
        ConfigError: neither is set, or the loss takes no reference.
    """
    d, c = job.dpo, job.checkpoint
    if d.reference == "none":
        raise ConfigError(
            f"dpo.loss_type={d.loss_type!r} with dpo.reference='none' takes no reference "
            "log-probs: nothing to compute"
        )
    if d.reference_load:
        return d.reference_load, d.reference_load_step
    if c.load:
        return c.load, c.load_step
    raise ConfigError(
        "the reference pass needs the model the run starts from: set checkpoint.load (--load) "
        "or dpo.reference_load"
    )


def check_reference_job(job: JobConfig) -> None:
    """What `meshtrain dpo reference` refuses before torch is imported."""
    reference_checkpoint(job)
    if not job.dpo.data_path:
        raise ConfigError("the reference pass needs dpo.data_path (preprocessed pairs)")
    if job.parallel.cp > 1:
        raise ConfigError("train.objective='dpo' with parallel.cp > 1 is not supported yet")
