"""Plain-torch reference of every fused op: the specification and the CPU path.

Each function here defines what the matching Triton kernel in `kernels/<op>.py` must compute
(forward and, through autograd, backward). They are written for clarity and numerical
safety (statistics in fp32), not speed; dispatch (`kernels/__init__.py`) uses them wherever
no faster implementation applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` computes in here: autocast's, when autocast is on for x's
    device and x is floating point; else x's own.

    One rule for every place that must agree with what autocast will do: the fused loss's
    chunk logits, the collectives on a matmul's input, the residual stream's dtype.
    """
    dev = x.device.type
    if x.is_floating_point() and dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in its accumulation dtype: fp32 for half types, unchanged for fp32/fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, statistics in fp32."""
    xf = _acc(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * _acc(weight)).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with affine weight and optional bias."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (GPT-2's)."""
    return F.gelu(x, approximate="tanh")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] last dim: silu(gate) * up, halving the width."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for rotary embeddings, each (seq_len, head_dim), in fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim): halves share frequencies
    return angles.cos(), angles.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention (the one Hugging Face Llama uses).

    Args:
        x: (batch, heads, seq, head_dim).
        cos, sin: (seq, head_dim) from `rope_cos_sin`.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (_acc(x) * cos + _acc(rotated) * sin).to(x.dtype)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean token cross-entropy in fp32, weighted by `loss_mask` when given.

    Args:
        logits: (..., vocab).
        labels: (...) int64.
        loss_mask: (...) float, 1 where the token counts.
    """
    losses = F.cross_entropy(_acc(logits).flatten(0, -2), labels.flatten(), reduction="none")
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.flatten().to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None, vocab_size: int | None = None, *, ce=None,
) -> torch.Tensor:
    """Output projection followed by cross-entropy; rows of `weight` past `vocab_size` are padding.

    Args:
        hidden: (..., hidden).
        weight: (padded_vocab, hidden).
        labels: (...) int64 in [0, vocab_size).
        loss_mask: optional (...) float.
        vocab_size: the real vocabulary; padded rows are left out of the softmax.
        ce: the cross-entropy applied to the logits; default `cross_entropy` above (the
            dispatcher passes its own, so the Triton cross-entropy can follow this projection).
    """
    logits = hidden @ weight.t()
    if vocab_size is not None and vocab_size < weight.shape[0]:
        # the GEMM over every row, padding included, then the padding's logits cut off: with
        # the weight sliced instead, the GEMM's N is the unaligned vocabulary, and the compiled
        # backward held two logit-sized gradient buffers beside the saved logits (gpt2-125m on
        # an H200: +1.8 GB at the peak; BENCHMARKS.md)
        logits = logits[..., :vocab_size]
    return (ce or cross_entropy)(logits, labels, loss_mask)
