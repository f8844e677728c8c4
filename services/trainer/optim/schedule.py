"""Learning rate: linear warmup from 0 to lr, then a decay to min_lr (cosine, linear, WSD, inverse
square root, or none), then flat.

A pure function of the step, so a resumed run needs only the step to restore it. The decay styles
are Megatron-LM's (`--lr-decay-style`, `--lr-wsd-decay-style`); the warmup counts the first update
as step 1 of it, so the first step trains at lr / warmup rather than 0.
"""

from __future__ import annotations

import math

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.sections import OptimConfig


def warmup_iters(config: OptimConfig, train_iters: int) -> int:
    """Warmup steps: lr_warmup_iters, or lr_warmup_fraction of the decay length (rounded down)."""
    if config.lr_warmup_fraction is not None:
        return int(config.lr_warmup_fraction * (config.lr_decay_iters or train_iters))
    return config.lr_warmup_iters


def _wsd_coeff(style: str, progress: float) -> float:
    """The WSD anneal's share of (lr - min_lr) left at `progress` (0 to 1) through it."""
    if style == "linear":
        return 1.0 - progress
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if style == "exponential":
        return 2.0 * 0.5**progress - 1.0
    return 1.0 - math.sqrt(progress)  # minus_sqrt


def lr_at(step: int, config: OptimConfig, train_iters: int) -> float:
    """Learning rate for optimizer step `step` (0-based: the first update uses lr_at(0)).

    Args:
        step: optimizer steps already taken.
        config: lr, min_lr, warmup and decay settings.
        train_iters: total steps; the decay length when lr_decay_iters is unset.

    Raises:
        ConfigError: a WSD anneal longer than the decay after warmup.
    """
    warmup = warmup_iters(config, train_iters)
    if warmup > 0 and step < warmup:
        return config.lr * (step + 1) / warmup
    decay_iters = config.lr_decay_iters or train_iters
    style = config.lr_decay_style
    if style == "constant":
        return config.lr
    if decay_iters <= warmup:
        return config.lr
    if step > decay_iters:
        return config.min_lr
    if style == "inverse-square-root":
        return max(config.min_lr, config.lr * math.sqrt(max(warmup, 1) / max(step, 1)))
    if style == "wsd":
        anneal = config.lr_wsd_decay_iters
        if anneal is None:  # OptimConfig refuses it; a config changed after its checks
            raise ConfigError("optim.lr_decay_style='wsd' needs optim.lr_wsd_decay_iters")
        if anneal > decay_iters - warmup:
            raise ConfigError(
                f"optim.lr_wsd_decay_iters={anneal} is longer than the decay after warmup "
                f"({decay_iters} - {warmup} steps)"
            )
        start = decay_iters - anneal  # the stable phase ends here
        coeff = (
            1.0 if step <= start else _wsd_coeff(config.lr_wsd_decay_style, (step - start) / anneal)
        )
    else:
        progress = (step - warmup) / (decay_iters - warmup)
        coeff = 1.0 - progress if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + coeff * (config.lr - config.min_lr)
