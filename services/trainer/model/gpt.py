"""The GPT family on one device: GPT-2 style and Llama style are settings of one model.

GPT-2: LayerNorm, GELU, learned positions, biases, tied embeddings. Llama: RMSNorm, SwiGLU, RoPE
(optionally Llama 3 scaled), grouped-query attention, no biases, untied output; Qwen2 adds q/k/v
biases, Qwen3 per-head q/k norms and a head width of its own. Parameter names are the canonical
names checkpoints use (`layers.<i>.attention.qkv.weight`, ...). Parallelism never reaches in
here: `parallel/` swaps or wraps modules (e.g. `recompute.apply`).

    model = GPT(config)                         # config: ModelConfig with vocab_size set
    loss = model(tokens, labels, loss_mask)     # mean token loss
    logits = model(tokens)                      # (batch, seq, vocab)
    loss = model(tokens, labels, loss_mask, document_ids, position_ids)  # packed documents
    loss = model(tokens, labels, loss_mask, images=images)  # with model.vision: LLaVA-style

With `config.vision` set the model also holds a vision encoder and a projector (`vision.py`):
`images` (n_images, 3, H, W) are encoded, projected, and put in place of the image placeholder
tokens' embeddings.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from meshtrain.kernels import dispatch
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model.attention import Attention, Documents, documents
from meshtrain.services.trainer.model.embedding import Embedding
from meshtrain.services.trainer.model.mlp import MLP
from meshtrain.services.trainer.model.moe import MoE
from meshtrain.services.trainer.model.norm import Norm
from meshtrain.services.trainer.model.rotary import rotary_tables
from meshtrain.services.trainer.model.vision import (
    Projector,
    VisionEncoder,
    image_features,
)


class LMHead(nn.Module):
    """Output projection + loss, without parameters (the weight is passed in, tied or not).

    A module of its own so `parallel.tensor` can swap in the vocab-parallel version, which
    never gathers the full logits.
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def loss(
        self,
        h: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Mean token loss; h (batch, seq, hidden), weight (padded_vocab, hidden)."""
        return dispatch.linear_cross_entropy(h, weight, labels, loss_mask, self.vocab_size)

    def logits(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """(batch, seq, vocab) fp32 logits, padding rows cut off."""
        logits = h @ weight[: self.vocab_size].t()
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def token_logps(
        self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """(batch, seq) fp32 log-probabilities of `labels` (preference tuning sums them)."""
        logits = self.logits(h, weight)  # (b, s, vocab)
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return -losses.view(labels.shape)


def rope_tables(
    cos: torch.Tensor | None, sin: torch.Tensor | None, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (cos, sin) rows blocks rotate by: the first rows (a whole sequence from position 0),
    or those of `positions`: (seq,) a context-parallel rank's tokens, (seq, d) rows; (batch,
    seq) positions within packed documents, (batch, seq, d) rows. None without RoPE."""
    if cos is None or sin is None:
        return None
    if positions is None:
        return cos, sin
    positions = positions.long()
    return cos[positions], sin[positions]


class SequenceLayout(Protocol):
    """Where this rank's tokens sit in each sequence, and its share of a sequence's loss: set
    on a model by context parallelism (parallel/context's `ContextParallel`)."""

    cp: int  # the ranks each sequence is split over
    group: dist.ProcessGroup | None  # theirs (None: the default group)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor: ...

    def loss_share(
        self, loss: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None
    ) -> torch.Tensor: ...


def token_positions(
    context: SequenceLayout | None,
    position_ids: torch.Tensor | None,
    seq: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The positions a forward embeds and rotates by: `position_ids` (batch, seq) when the batch
    has them (positions within documents, a context-parallel rank's columns already), else a
    context-parallel rank's global positions (seq,), else None (0, 1, ...)."""
    if position_ids is not None:
        return position_ids
    return context.positions(seq, device) if context is not None else None


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); `mlp` is a mixture of experts in
    the blocks `config.is_moe_layer(layer)` names."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_norm = Norm(config)
        self.attention = Attention(config)
        self.pre_mlp_norm = Norm(config)
        self.mlp = MoE(config) if config.is_moe_layer(layer) else MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        """x (batch, seq, hidden) -> (batch, seq, hidden); `docs` keeps attention inside
        documents."""
        x = x + self.dropout(self.attention(self.input_norm(x), rope, docs))
        return x + self.dropout(self.mlp(self.pre_mlp_norm(x)))


class GPT(nn.Module):
    """Decoder-only transformer language model."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError(
                "ModelConfig.vocab_size must be resolved (from the tokenizer) before building GPT"
            )
        self.config = config
        self.vocab_size = config.vocab_size
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_layers))
        self.final_norm = Norm(config)
        self.output_layer = (
            nn.Linear(config.hidden_size, config.padded_vocab_size(), bias=False)
            if config.untie_embeddings_and_output_weights
            else None
        )
        self.head = LMHead(config.vocab_size)
        # a reward model scores with `score` (hidden -> 1); its LM output layer stays (an LM
        # checkpoint loads into it, and back) but is not trained
        self.score = nn.Linear(config.hidden_size, 1, bias=False) if config.reward_head else None
        if self.score is not None and self.output_layer is not None:
            self.output_layer.requires_grad_(False)
        self.vision = VisionEncoder(config.vision) if config.vision is not None else None
        self.projector = Projector(config) if config.vision is not None else None
        self.rope_cos: torch.Tensor | None
        if config.position_embedding_type == "rope":
            cos, sin = rotary_tables(config)
            # Derived from the config, so not part of the state dict (persistent=False).
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        # Recompute plan (set by parallel.recompute.apply): blocks run in chunks of
        # `recompute_chunk`; a chunk whose first index is in `recompute_layers` keeps only its
        # input and is recomputed in backward.
        self.recompute_layers: frozenset[int] = frozenset()
        self.recompute_chunk = 1
        # Context parallelism (set by parallel.context.parallelize_context): this rank holds some
        # chunks of each sequence; it gives their positions and this rank's share of the loss.
        self.context: SequenceLayout | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, std) matrices and embeddings, scaled std for residual outputs, zero biases."""
        std = self.config.init_method_std
        scaled = Attention.scaled_init_std(self.config)
        vision = self.config.vision
        for name, p in self.named_parameters():
            if name.startswith("vision.class_embedding") and vision is not None:
                p.normal_(0.0, vision.hidden_size**-0.5)  # CLIP's
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith((".bias", "router.expert_bias")):
                p.zero_()
            elif name.endswith(
                (
                    "attention.proj.weight",
                    "mlp.fc2.weight",
                    "experts.fc2.weight",
                    "shared_expert.fc2.weight",
                )
            ):
                p.normal_(0.0, scaled)
            else:
                p.normal_(0.0, std)

    @property
    def output_weight(self) -> torch.Tensor:
        """(padded_vocab, hidden): the output projection (the word embedding when tied)."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def embed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual stream's first value (batch, seq, hidden): the token embeddings, with the
        image features in place of the placeholders' where `images` are given."""
        features = None
        if images is not None and images.shape[0]:
            if self.vision is None or self.projector is None:
                raise ValueError("images given to a text-only model (model.vision is unset)")
            features = image_features(self.vision, self.projector, images)
        image_token = self.config.vision.image_token_id if self.config.vision else None
        return self.embedding(tokens, positions, features, image_token)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (batch, seq) -> final-norm hidden states (batch, seq, hidden); see `forward`
        for the document ids, positions and images."""
        if tokens.shape[1] > self.config.seq_length:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens exceeds "
                f"model.seq_length={self.config.seq_length}"
            )
        positions = token_positions(self.context, position_ids, tokens.shape[1], tokens.device)
        rope = rope_tables(self.rope_cos, self.rope_sin, positions)
        docs = documents(document_ids)
        x = self.embed(tokens, positions, images)
        for start, end, recompute in self.layer_chunks():
            if recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    self._run_layers, start, end, x, rope, docs, use_reentrant=False
                )
            else:
                x = self._run_layers(start, end, x, rope, docs)
        return self.final_norm(x)

    def _run_layers(self, start: int, end: int, x: torch.Tensor, rope, docs) -> torch.Tensor:
        for layer in self.layers[start:end]:
            x = layer(x, rope, docs)
        return x

    def layer_chunks(self) -> list[tuple[int, int, bool]]:
        """(start, end, recomputed) runs of blocks, from the recompute plan."""
        n, k = len(self.layers), self.recompute_chunk
        if not self.recompute_layers:
            return [(0, n, False)]
        chunks = []
        for start in range(0, n, k):
            end = min(start + k, n)
            chunks.append((start, end, start in self.recompute_layers))
        return chunks

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean token loss when `labels` is given, else logits (batch, seq, vocab); a reward model
        (`config.reward_head`) gives its head's loss, else the scalar score after each token
        (batch, seq).

        Args:
            tokens: (batch, seq) int64 token ids.
            labels: (batch, seq) int64 next-token ids.
            loss_mask: (batch, seq) float weights (1 = counts).
            document_ids: (batch, seq) int, non-decreasing: the packed document of each token;
                attention then stays inside documents (None: the whole sequence).
            position_ids: (batch, seq) int: each token's position for RoPE or the learned
                position embedding, e.g. restarting at each document (None: 0, 1, ...).
            images: (n_images, 3, H, W) float, resized and normalized, in the order their
                placeholders appear (sample by sample, left to right); each takes the place of
                tokens_per_image copies of model.vision.image_token_id (None: no images).
        """
        h = self.hidden_states(tokens, document_ids, position_ids, images)
        if self.score is not None and labels is None:
            return self.score(h).squeeze(-1)  # (b, s): the reward of each prefix
        if labels is not None:
            # a reward model's objective head projects with the scalar head's (1, hidden) weight
            weight = self.output_weight if self.score is None else self.score.weight
            loss = self.head.loss(h, weight, labels, loss_mask)
            return (
                loss if self.context is None else self.context.loss_share(loss, labels, loss_mask)
            )
        return self.head.logits(h, self.output_weight)  # (b, s, vocab)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; padded vocabulary rows are not counted."""
        h = self.config.hidden_size
        pad = self.embedding.word_embeddings.weight.shape[0] - self.vocab_size
        total = sum(p.numel() for p in self.parameters()) - pad * h * (
            2 if self.output_layer is not None else 1
        )
        if exclude_embeddings:
            total -= self.vocab_size * h
            if self.embedding.position_embeddings is not None:
                total -= self.embedding.position_embeddings.weight.numel()
        return total

    def vision_parameters(self) -> int:
        """Parameters of the vision encoder and the projector (0 for a text-only model)."""
        parts = (self.vision, self.projector)
        return sum(p.numel() for m in parts if m is not None for p in m.parameters())

    def inactive_parameters(self) -> int:
        """Expert weights a token does not pass through: (experts - topk) of every MoE block's
        experts (expert parallelism holds a slice of them: counted from the config, not this
        rank)."""
        c = self.config
        if c.num_experts is None:
            return 0
        per_expert = (3 if c.activation == "swiglu" else 2) * c.moe_ffn_size * c.hidden_size
        moe_blocks = sum(c.is_moe_layer(i) for i in range(c.num_layers))
        return moe_blocks * (c.num_experts - c.moe_router_topk) * per_expert

    def flops_per_token(self, seq_length: int | None = None) -> float:
        """Training FLOPs per token: 6N + 12·L·s·a (N: weights that do matmuls, incl. the LM head;
        with experts, the active ones: top-k of each MoE block's experts; a: the attention width,
        heads x head_dim, the hidden size unless model.kv_channels sets another head width).

        The head multiplies by a (vocab x hidden) matrix once per token, tied or not; the input
        embedding is a lookup and does no matmul. (Counting an untied head twice would overstate
        MFU.) A vision encoder and projector are left out: they run per image patch, not per token.
        """
        c = self.config
        s = seq_length or c.seq_length
        head = self.vocab_size * c.hidden_size
        untied_head = head if self.output_layer is not None else 0  # already in the count below
        matmul_params = (
            self.num_parameters(exclude_embeddings=True)
            - untied_head
            + head
            - self.inactive_parameters()
            - self.vision_parameters()
        )
        return 6.0 * matmul_params + 12.0 * c.num_layers * s * c.num_attention_heads * c.head_dim
