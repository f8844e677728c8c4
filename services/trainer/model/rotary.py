"""Rotary position tables of a model: plain RoPE or with Llama 3's frequency scaling.

The rotation itself is `dispatch.rope`; this module computes the per-position (cos, sin) tables
it reads, from `model.rotary_base`, the head width and, when `model.rope_scaling_factor` is set,
Llama 3's rescaling of the inverse frequencies (long wavelengths divided by the factor, short ones
kept, a smooth blend between), as Hugging Face's `rope_type: llama3` computes them.
"""

from __future__ import annotations

import math

import torch

from meshtrain.services.common.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, device=None) -> torch.Tensor:
    """(head_dim / 2,) fp32 inverse frequencies of the model's RoPE, scaled as configured."""
    d = config.head_dim
    inv = 1.0 / (
        config.rotary_base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    )
    factor = config.rope_scaling_factor
    if factor is None:
        return inv
    original = config.rope_scaling_original_max_positions
    low, high = config.rope_scaling_low_freq_factor, config.rope_scaling_high_freq_factor
    wavelength = 2 * math.pi / inv
    # Beyond the old context a wavelength never completed a turn in training: stretch it by
    # `factor`; well inside it keep it; between, blend linearly in original / wavelength.
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv / factor + blend * inv
    return torch.where(
        wavelength > original / low,
        inv / factor,
        torch.where(wavelength < original / high, inv, scaled),
    )


def rotary_tables(config: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_length, head_dim) fp32, in the rotate-half layout that
    `dispatch.rope` takes."""
    inv = inverse_frequencies(config, device)
    angles = torch.outer(torch.arange(config.seq_length, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim): the halves share frequencies
    return angles.cos(), angles.sin()
