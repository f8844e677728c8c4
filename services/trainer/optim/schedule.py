"""Learning rate: linear warmup from 0 to lr, then cosine / linear decay to min_lr, then flat.

A pure function of the step, so a resumed run needs only the step to restore it.
"""

from __future__ import annotations

import math

from meshtrain.services.trainer.config import OptimConfig


def lr_at(step: int, config: OptimConfig, train_iters: int) -> float:
    """Learning rate for optimizer step `step` (0-based: the first update uses lr_at(0)).

    Args:
        step: optimizer steps already taken.
        config: lr, min_lr, warmup and decay settings.
        train_iters: total steps; the decay length when lr_decay_iters is unset.
    """
    warmup = config.lr_warmup_iters
    if warmup > 0 and step < warmup:
        return config.lr * (step + 1) / warmup
    decay_iters = config.lr_decay_iters or train_iters
    if config.lr_decay_style == "constant" or decay_iters <= warmup:
        return config.lr
    progress = min(1.0, (step - warmup) / (decay_iters - warmup))
    if config.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + coeff * (config.lr - config.min_lr)
