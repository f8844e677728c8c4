"""Token (and, GPT-2 style, learned position) embeddings.

The word-embedding table has `padded_vocab_size` rows so its shape suits the hardware (and,
later, the tensor-parallel split); rows past the tokenizer's vocabulary are never looked up
and are cut off before the loss and before a checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.kernels.reference import compute_dtype
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model.vision import merge_image_features


class Embedding(nn.Module):
    """Word embeddings plus optional learned absolute positions, then dropout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size(), config.hidden_size)
        self.position_embeddings = (
            nn.Embedding(config.max_positions, config.hidden_size)
            if config.position_embedding_type == "learned"
            else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.fp32_residual = config.fp32_residual_connection

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        image_features: torch.Tensor | None = None,
        image_token_id: int | None = None,
    ) -> torch.Tensor:
        """tokens (batch, seq) int64 -> (batch, seq, hidden): the residual stream's first value.

        `positions` (seq,) or (batch, seq): the tokens' positions (default 0, 1, ...; a
        context-parallel rank holds chunks from the sequence's middle; with packed documents
        and data.reset_position_ids, positions restart at each document).

        In the tables' dtype, or under autocast with `fp32_residual_connection` off, in
        autocast's dtype (the lookups and the position sum in fp32, then one rounding).
        `image_features` (n_images, tokens_per_image, hidden) replace the word embeddings of the
        `image_token_id` placeholders, in reading order (`vision.merge_image_features`): here,
        before the sequence-parallel scatter that follows this module.
        """
        x = self.word_embeddings(tokens)
        if image_features is not None:
            assert image_token_id is not None
            x = merge_image_features(x, tokens, image_features, image_token_id)
        if self.position_embeddings is not None:
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.position_embeddings(positions)  # (seq | batch x seq, hidden)
        x = self.dropout(x)
        if not self.fp32_residual:
            x = x.to(compute_dtype(x))
        return x
