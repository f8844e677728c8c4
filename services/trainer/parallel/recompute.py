"""Activation recompute (Megatron's --recompute-granularity), applied to a built model.

`full` keeps only the input of a run of blocks and recomputes the run in backward: with
`uniform`, the blocks are cut into chunks of recompute_num_layers and every chunk is
recomputed (fewer stored inputs, larger recompute working set); with `block`, only the first
recompute_num_layers blocks are recomputed one by one and the rest store activations,
trading memory for speed. `selective` recomputes only the attention core
(softmax(QK^T)V), whose activations grow with seq^2 when SDPA falls back to the math
backend, at almost no compute cost.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.model.attention import CoreAttention, Documents
from meshtrain.services.trainer.model.gpt import GPT, TransformerBlock


class RecomputedCore(nn.Module):
    """Wraps a parameter-free CoreAttention so its forward is recomputed in backward."""

    def __init__(self, core: CoreAttention):
        super().__init__()
        self.inner = core

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None = None
    ) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.inner(q, k, v, docs)
        return torch.utils.checkpoint.checkpoint(self.inner, q, k, v, docs, use_reentrant=False)


def apply(model: GPT, config: ParallelConfig) -> GPT:
    """Configure `model` in place for the recompute plan in `config`; returns it.

    Parameter names do not change (the core has no parameters, and full recompute is a
    plan the model's forward consults), so checkpoints are unaffected. Under `full` a vision
    encoder's blocks are recomputed one by one as well.
    """
    n = len(model.layers)
    if config.recompute_granularity == "full" and model.vision is not None:
        model.vision.recompute = True  # each encoder block keeps only its input
    if config.recompute_granularity == "full":
        k = config.recompute_num_layers or 1  # ParallelConfig's default with 'full'
        if config.recompute_method == "uniform":
            model.recompute_chunk = k
            model.recompute_layers = frozenset(range(0, n, k))
        else:
            model.recompute_chunk = 1
            model.recompute_layers = frozenset(range(min(k, n)))
    elif config.recompute_granularity == "selective":
        for layer in model.layers:
            if isinstance(layer, TransformerBlock) and isinstance(
                layer.attention.core, CoreAttention
            ):
                layer.attention.core = RecomputedCore(layer.attention.core)
    return model
