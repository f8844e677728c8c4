"""The feed-forward block: GELU MLP (GPT-2) or SwiGLU with a fused gate/up projection (Llama).

For SwiGLU, `fc1` holds [gate; up] stacked along its output rows (gate first): the canonical
order checkpoints store; a tensor-parallel split takes the same slice of each half.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.kernels import dispatch
from meshtrain.services.common.model_config import ModelConfig


class MLP(nn.Module):
    """fc1 -> activation -> fc2."""

    def __init__(self, config: ModelConfig, ffn_size: int | None = None):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        ffn = (
            config.ffn_size if ffn_size is None else ffn_size
        )  # a MoE's shared expert has its own width
        self.fc1 = nn.Linear(
            config.hidden_size, 2 * ffn if self.swiglu else ffn, bias=config.add_bias_linear
        )
        self.fc2 = nn.Linear(ffn, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, hidden) -> (batch, seq, hidden)."""
        h = self.fc1(x)  # (b, s, ffn) or (b, s, 2*ffn) = [gate | up]
        return self.fc2(self.activation(h))

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """(b, s, 2*ffn) = [gate | up] for SwiGLU, else (b, s, ffn) -> (b, s, ffn)."""
        return dispatch.swiglu(h) if self.swiglu else dispatch.gelu(h)
