"""The model's normalization layer: LayerNorm (GPT-2) or RMSNorm (Llama), through `dispatch`.

One class serves the blocks' norms over the hidden size and the per-head query/key norms
(`model.qk_norm`, Qwen3) over the head width.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.kernels import dispatch
from meshtrain.services.common.model_config import ModelConfig


class Norm(nn.Module):
    """LayerNorm (weight + bias) or RMSNorm (weight only) over the last dim, of width `width`
    (default: the hidden size)."""

    def __init__(self, config: ModelConfig, width: int | None = None):
        super().__init__()
        width = width or config.hidden_size
        self.rms = config.normalization == "rmsnorm"
        self.eps = config.norm_epsilon
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., width) -> (..., width)."""
        if self.rms:
            return dispatch.rms_norm(x, self.weight, self.eps)
        return dispatch.layer_norm(x, self.weight, self.bias, self.eps)
