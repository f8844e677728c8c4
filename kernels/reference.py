"""Plain-torch reference of every fused op: the specification and the CPU path.

Each function here defines what the matching Triton kernel in `kernels/<op>.py` must compute
(forward and, through autograd, backward). They are written for clarity and numerical
safety (statistics in fp32), not speed; dispatch (`kernels/dispatch.py`) uses them wherever
no faster implementation applies.
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

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


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dim with affine weight and optional bias."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (GPT-2's)."""
    return F.gelu(x, approximate="tanh")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] last dim: silu(gate) * up, halving the width."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) as a 0-d fp32 tensor (0 for an empty x)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().float()


def fp8_cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    transpose: bool = True,
    amax: bool = False,
    out: torch.Tensor | None = None,
    out_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x (M, N) cast to FP8: q = (x in fp32 · scale) clamped to ±fp8_max, rounded to `dtype`;
    with its contiguous transpose qᵀ (N, M) if `transpose` and amax(|x|) if `amax` (else None);
    written into `out` / `out_t` when given."""
    limit = torch.finfo(dtype).max
    q = (x.float() * scale.reshape(()).float()).clamp(-limit, limit).to(dtype)
    if out is not None:
        q = out.copy_(q)
    qt = None
    if transpose:
        qt = out_t.copy_(q.t()) if out_t is not None else q.t().contiguous()
    return q, qt, fp8_amax(x) if amax else None


def _fp8_copy(
    y: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the FP8 copy of y as an FP8 linear casts it: bf16(y) · scale, saturated, shaped like y,
    or None without a scale; amax(|bf16(y)|))."""
    yb = y.detach().to(torch.bfloat16)
    amax = fp8_amax(yb)
    if scale is None:
        return None, amax
    q = fp8_cast_transpose(yb.reshape(-1, yb.shape[-1]), scale, dtype, transpose=False)[0]
    return q.view(y.shape), amax


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`rms_norm`, then the FP8 copy of its output (None without a scale) and its amax."""
    y = rms_norm(x, weight, eps)
    return (y, *_fp8_copy(y, scale, dtype))


def layer_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`layer_norm`, then the FP8 copy of its output (None without a scale) and its amax."""
    y = layer_norm(x, weight, bias, eps)
    return (y, *_fp8_copy(y, scale, dtype))


def swiglu_fp8(
    gate_up: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`swiglu`, then the FP8 copy of its output (None without a scale) and its amax."""
    y = swiglu(gate_up)
    return (y, *_fp8_copy(y, scale, dtype))


def gelu_fp8(
    x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`gelu`, then the FP8 copy of its output (None without a scale) and its amax."""
    y = gelu(x)
    return (y, *_fp8_copy(y, scale, dtype))


def rope_cos_sin(
    seq_len: int, head_dim: int, base: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for rotary embeddings, each (seq_len, head_dim), in fp32."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim): halves share frequencies
    return angles.cos(), angles.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention (the one Hugging Face Llama uses).

    Args:
        x: (batch, heads, seq, head_dim).
        cos, sin: (seq, head_dim) from `rope_cos_sin`, or (batch, seq, head_dim): each
            sequence's own rows (its tokens' positions, e.g. restarting at each document).
    """
    if cos.dim() == 3:  # per sequence: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (_acc(x) * cos + _acc(rotated) * sin).to(x.dtype)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
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
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    *,
    ce=None,
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
        # backward held two logit-sized gradient buffers beside the saved logits, raising the
        # peak (measured: BENCHMARKS.md, 'Training throughput, one GPU')
        logits = logits[..., :vocab_size]
    return (ce or cross_entropy)(logits, labels, loss_mask)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, groups, s, d) key/value heads repeated to (b, heads, s, d): query head j uses group j //
    (heads/groups)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold_kv(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `_expand_kv` for gradients: the heads sharing a group summed into it."""
    b, h, s, d = g.shape
    return g if h == groups else g.view(b, groups, h // groups, s, d).sum(2)


def _attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    scale: float | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 (b, heads, sq, sk) scaled scores, -inf above the diagonal when causal (sq == sk)
    and wherever `mask` (b, sq, sk) bool, True where a query sees a key, is False."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(_acc(q), _acc(_expand_kv(k, q.shape[1])).transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(
            torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf")
        )
    if mask is not None:
        s = s.masked_fill(~mask[:, None], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with the -inf of rows that see no key replaced by 0: exp(-inf - 0) is then their
    probabilities' 0, where exp(-inf - (-inf)) would be NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block that also returns its row log-sum-exp, the quantity two blocks'
    partial outputs are merged by (context parallelism). Materializes the (sq, sk) scores in
    fp32: the specification, not a kernel.

    Args:
        q: (batch, heads, sq, d); k, v: (batch, groups, sk, d), heads a multiple of groups.
        causal: mask keys after each query (sq == sk, aligned at the start).
        scale: score scale; default 1/sqrt(d).
        mask: (batch, sq, sk) bool, True where a query may see a key (packed documents); a
            query that sees no key of the block gets out 0 and lse -inf, which merge as nothing.

    Returns:
        out (batch, heads, sq, d) in q's dtype, lse (batch, heads, sq) fp32: log sum_k exp(score).
    """
    s = _attention_scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    out = torch.matmul(p, _acc(_expand_kv(v, q.shape[1])))
    return out.to(q.dtype), lse


def attention_lse_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* output and log-sum-exp of its query rows.

    With `out` and `lse` of the whole attention (every key block merged), the result is this
    block's exact share of dq and its keys' full dk, dv: P = exp(S - lse) is the block's slice of
    the global softmax, and D = rowsum(dout * out) is the global correction term. `mask` as in
    `attention_lse`.

    Returns:
        dq (batch, heads, sq, d), dk, dv (batch, groups, sk, d), fp32.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = _attention_scores(q, k, causal, scale, mask)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))  # (b, h, sq, sk)
    do = _acc(dout)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, _acc(_expand_kv(v, q.shape[1])).transpose(-1, -2))
    ds = p * (dp - (do * _acc(out)).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, _acc(_expand_kv(k, q.shape[1])))
    dk = torch.matmul(ds.transpose(-1, -2), _acc(q))
    return dq, _fold_kv(dk, k.shape[1]), _fold_kv(dv, k.shape[1])
