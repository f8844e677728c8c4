"""Causal self-attention with a fused QKV projection, grouped-query heads and optional RoPE.

The fused QKV weight (and its bias, with `model.qkv_bias` or `model.add_bias_linear`) is laid
out per query group: for each of the `groups` KV heads, its `heads/groups` query heads, then its
key head, then its value head. This is the canonical order checkpoints store, and it makes a
tensor-parallel split by query groups a contiguous slice of rows. With `model.qk_norm` each
query and key head is normalized over its width (one weight per layer, shared by the heads)
before RoPE. The attention core is `scaled_dot_product_attention` (flash / cuDNN on GPU).

Packed documents (`data.reset_attention_mask`): given the tokens' document ids (`Documents`),
attention is causal within each document and never crosses into another. On CUDA that is
FlexAttention with a block mask built once per forward from the ids (a variable-length
kernel: blocks that cross documents are skipped, no s x s mask is materialized); elsewhere the
reference, SDPA with a dense boolean mask.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshtrain.kernels import dispatch
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model.norm import Norm

BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
"""SDPA backends `model.attention_backend` can pin; 'auto' is PyTorch's own choice."""

_SDPA = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# Backends that take grouped-query attention natively (enable_gqa); the others get the key and
# value heads expanded to one per query head first (the same function, more memory traffic).
_NATIVE_GQA = ("auto", "flash", "math")


class Documents(NamedTuple):
    """Which document each token of a packed sequence belongs to, for attention that stays
    inside documents; built once per forward (`documents`) and handed to every block."""

    ids: torch.Tensor
    """(batch, seq) int: non-decreasing along the sequence, one value per document."""
    block_mask: Any = None
    """FlexAttention's BlockMask for `ids` on CUDA; None where the reference runs."""


def documents(ids: torch.Tensor | None) -> Documents | None:
    """The `Documents` of (batch, seq) document ids (None: attention over the whole sequence);
    on CUDA with its block mask, which every block (and tensor-parallel rank) shares."""
    if ids is None:
        return None
    return Documents(ids, document_block_mask(ids) if ids.is_cuda else None)


def document_block_mask(ids: torch.Tensor):
    """FlexAttention BlockMask: causal, and query and key in the same document; (b, 1, s, s)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = ids.shape

    def same_document(batch, head, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[batch, q_idx] == ids[batch, kv_idx])

    return create_block_mask(same_document, b, None, s, s, device=ids.device)


@functools.cache
def _compiled_flex():
    # FlexAttention is a kernel only when compiled; eager, it falls back to a dense reference
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, dropout: float = 0.0
) -> torch.Tensor:
    """Causal attention within documents: query i sees key j <= i of its own document.

    q (batch, heads, seq, d), k/v (batch, groups, seq, d) -> (batch, heads, seq, d); `docs.ids`
    (batch, seq). On CUDA FlexAttention with `docs.block_mask` (built here when absent), which
    has no dropout; elsewhere SDPA with a dense (batch, 1, seq, seq) boolean mask.
    """
    gqa = k.shape[1] != q.shape[1]
    if q.is_cuda:
        if dropout:
            raise ValueError(
                "attention within documents (data.reset_attention_mask) runs FlexAttention on "
                "CUDA, which has no attention dropout: set model.attention_dropout=0"
            )
        mask = docs.block_mask if docs.block_mask is not None else document_block_mask(docs.ids)
        return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=gqa)
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    same = docs.ids[:, :, None] == docs.ids[:, None, :]  # (b, s, s)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=(same & causal)[:, None], dropout_p=dropout, enable_gqa=gqa
    )


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    backend: str = "auto",
    expand_kv: bool | None = None,
) -> torch.Tensor:
    """Causal attention through SDPA, pinned to `backend` unless it is 'auto'.

    q (batch, heads, seq, d), k/v (batch, groups, seq, d) -> (batch, heads, seq, d). Query head
    j attends with key/value group j // (heads / groups). `expand_kv` (default: by backend)
    repeats the key/value heads instead of passing `enable_gqa`.
    """
    gqa = k.shape[1] != q.shape[1]
    if gqa and (backend not in _NATIVE_GQA if expand_kv is None else expand_kv):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        gqa = False
    with contextlib.nullcontext() if backend == "auto" else sdpa_kernel(_SDPA[backend]):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa
        )


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v, causal (and within documents when given their ids); a module
    of its own so recompute can wrap it."""

    def __init__(self, dropout: float, backend: str = "auto"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
        self.dropout = dropout
        self.backend = backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None = None
    ) -> torch.Tensor:
        """q (batch, heads, seq, d), k/v (batch, groups, seq, d) -> (batch, heads, seq, d)."""
        dropout = self.dropout if self.training else 0.0
        if docs is not None:
            return document_attention(q, k, v, docs, dropout)
        return sdpa(q, k, v, dropout, self.backend)


class Attention(nn.Module):
    """Self-attention block body: qkv projection, RoPE, core attention, output projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.groups = config.groups
        self.head_dim = config.head_dim
        qkv_out = (self.heads + 2 * self.groups) * self.head_dim
        self.qkv = nn.Linear(
            config.hidden_size, qkv_out, bias=config.add_bias_linear or config.qkv_bias
        )
        # Per-head norms: tensor parallelism leaves them whole (each rank normalizes its own heads).
        self.q_norm = Norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = Norm(config, self.head_dim) if config.qk_norm else None
        # parallel/ may wrap it (recompute's RecomputedCore, context parallelism's attention)
        self.core: nn.Module = CoreAttention(config.attention_dropout, config.attention_backend)
        self.proj = nn.Linear(
            self.heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear
        )

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (batch, seq, hidden) -> q (b, heads, s, d), k and v (b, groups, s, d), before RoPE."""
        per_group = self.heads // self.groups
        qkv = self.qkv(x)
        b, s, _ = qkv.shape  # s is the full sequence even when x is a sequence-parallel shard
        qkv = qkv.view(b, s, self.groups, per_group + 2, self.head_dim)
        q = qkv[:, :, :, :per_group].reshape(b, s, self.heads, self.head_dim)  # (b, s, heads, d)
        k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]  # (b, s, groups, d)
        if self.q_norm is not None and self.k_norm is not None:  # set together
            q, k = self.q_norm(q), self.k_norm(k)  # over d, per head
        return tuple(t.transpose(1, 2) for t in (q, k, v))  # (b, heads|groups, s, d)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        """x (batch, seq, hidden) -> (batch, seq, hidden).

        `rope`: (cos, sin) tables, (seq_length, d) read from row 0, or (seq, d) / (batch, seq,
        d) rows already gathered at the tokens' positions. `docs`: the tokens' documents, for
        attention that stays within them (None: the whole sequence).
        """
        q, k, v = self.project(x)
        b, _, s, _ = q.shape
        if rope is not None:
            cos, sin = rope
            if cos.dim() == 2:
                cos, sin = cos[:s], sin[:s]
            q, k = dispatch.rope(q, cos, sin), dispatch.rope(k, cos, sin)
        out = self.core(q, k, v) if docs is None else self.core(q, k, v, docs)  # (b, heads, s, d)
        return self.proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))

    @staticmethod
    def scaled_init_std(config: ModelConfig) -> float:
        """Std for residual output projections (GPT-2 / Megatron scaled init)."""
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
