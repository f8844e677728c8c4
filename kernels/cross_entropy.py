"""Cross-entropy in Triton over given logits, and the per-row kernels the fused output
projection + cross-entropy (`kernels/linear_cross_entropy.py`) runs on each chunk.

Per-row kernels (one program per token row, looping over the vocabulary in blocks):
  * `_row_stats`: one online pass gives the row max m, sum(exp(x - m)) and the label's logit;
  * `_row_grad`: a second pass writes (softmax - one_hot) * scale, in place if asked.
The single-device kernel runs both passes in one program, saving a launch and the
statistics' round trip; the second read still comes from DRAM at training shapes (about a
thousand 256 KB rows are in flight at once, far more than L2 holds). The two
halves are also exposed separately (`logit_stats`, `softmax_grad_`) so a vocab-parallel
version can put an all-reduce between them:

    m, s, t = logit_stats(local_logits, labels, vocab_start)      # (rows,) each, fp32
    m_all = all_reduce(m.clone(), MAX, tp)                        # global max
    s = all_reduce(s * exp(m - m_all), SUM, tp)                   # rescale, then sum
    t = all_reduce(t, SUM, tp)                                    # only the owner's is non-zero
    lse = m_all + log(s); loss_rows = lse - t
    softmax_grad_(local_logits, labels, lse, scale, vocab_start)  # local dlogits, in place
    grad_hidden = all_reduce(dlogits @ W_local, SUM, tp)          # or reduce-scatter under SP

Label -100 is ignored like F.cross_entropy's default; any other label outside the vocabulary
is an error, checked on the device. Eager autograd goes through `_CrossEntropy`;
torch.compile through the custom op `meshtrain::cross_entropy` (an opaque node with a fake
implementation for shapes). Spec: `meshtrain.kernels.reference.cross_entropy`.
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import torch
import triton
import triton.language as tl

from meshtrain.kernels._launch import as_rows, kernel_op, wrap_triton

IGNORE_INDEX = -100
# Vocabulary block per loop iteration; tests lower it to exercise the multi-block path.
MAX_BLOCK = 4096


@triton.jit
def _row_stats(row_ptr, n_cols, label_local, BLOCK: tl.constexpr):
    """(max, sum(exp(x - max)), x[label_local] or 0) of one row, online over blocks."""
    # the label's logit: one scalar load, 0 when another vocab shard owns it (or the row is
    # ignored), instead of a compare and select on every element of the row
    owned = (label_local >= 0) & (label_local < n_cols)
    t = tl.load(row_ptr + tl.where(owned, label_local, 0), mask=owned, other=0.0).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    m = -1e30  # finite, so the first exp(m - m_new) is 0 rather than exp(-inf + inf) = nan
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        x = tl.load(row_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # one exp per element; the running sum is rescaled once per block
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, s, t


@triton.jit
def _row_grad(row_ptr, out_ptr, n_cols, label_local, lse, scale, BLOCK: tl.constexpr):
    """out = (softmax(x) - one_hot(label_local)) * scale; out may alias the row."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        g = tl.exp(x - lse)
        g = tl.where(offs == label_local, g - 1.0, g) * scale
        tl.store(out_ptr + offs, g.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_fused_kernel(
    logits_ptr,
    grad_ptr,
    labels_ptr,
    scale_ptr,
    loss_ptr,
    lse_ptr,
    logits_stride,
    grad_stride,
    n_cols,
    IGNORE: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    ignored = label == IGNORE
    row_ptr = logits_ptr + row * logits_stride
    m, s, t = _row_stats(row_ptr, n_cols, label, BLOCK)
    lse = m + tl.log(s)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - t))
    tl.store(lse_ptr + row, lse)
    if COMPUTE_GRAD:
        scale = tl.where(ignored, 0.0, tl.load(scale_ptr + row))
        _row_grad(row_ptr, grad_ptr + row * grad_stride, n_cols, label, lse, scale, BLOCK)


@triton.jit
def _stats_kernel(
    logits_ptr,
    labels_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    logits_stride,
    n_cols,
    vocab_start,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label_local = tl.load(labels_ptr + row) - vocab_start  # outside [0, n_cols) on other shards
    m, s, t = _row_stats(logits_ptr + row * logits_stride, n_cols, label_local, BLOCK)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, t)


@triton.jit
def _grad_kernel(
    logits_ptr,
    grad_ptr,
    labels_ptr,
    lse_ptr,
    scale_ptr,
    logits_stride,
    grad_stride,
    n_cols,
    vocab_start,
    IGNORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    scale = tl.where(label == IGNORE, 0.0, tl.load(scale_ptr + row))
    _row_grad(
        logits_ptr + row * logits_stride,
        grad_ptr + row * grad_stride,
        n_cols,
        label - vocab_start,
        tl.load(lse_ptr + row),
        scale,
        BLOCK,
    )


def launch_config(n_cols: int) -> dict:
    """The per-row kernels' launch: vocabulary block per loop iteration and warps, 32 values a lane.

    4096-wide blocks on 4 warps: of a grid of blocks (2k-16k), warps (4-16) and pipeline
    stages (1-3), the fastest forward at vocabularies 50k and 128k, with the backward close to
    the best; stages made no difference (`benchmarks/ce_launch_sweep.py`; measured:
    BENCHMARKS.md, 'Kernels').
    """
    block = min(MAX_BLOCK, triton.next_power_of_2(n_cols))
    return {"BLOCK": block, "num_warps": max(1, min(4, block // 1024))}


# ---- per-chunk building blocks (single device and vocab-parallel) ----


def fused_loss_and_grad_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor | None,
    grad_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and logsumexp of a full-vocabulary chunk; optionally its scaled dlogits.

    Args:
        logits: (rows, vocab), unit stride along vocab.
        labels: (rows,) int64; -100 rows give zero loss and zero gradient.
        scale: (rows,) fp32 weight of each row's loss, or None to skip the gradient.
        grad_out: where (softmax - one_hot) * scale goes, (rows, vocab); may be `logits` itself
            (in place); defaults to `logits`.

    Returns:
        (loss_rows, lse), each (rows,) fp32; loss_rows is unweighted.
    """
    rows, n = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    grad = logits if grad_out is None else grad_out
    wrap_triton(_ce_fused_kernel)[(rows,)](
        logits,
        grad,
        labels,
        scale if scale is not None else loss,
        loss,
        lse,
        logits.stride(0),
        grad.stride(0),
        n,
        IGNORE=IGNORE_INDEX,
        COMPUTE_GRAD=scale is not None,
        **launch_config(n),
    )
    return loss, lse


def logit_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int = 0):
    """Row max, sum(exp(x - max)) and the label's logit (0 when another shard owns it).

    Args:
        logits: (rows, local_vocab), this rank's vocabulary slice [vocab_start, vocab_start +
            local_vocab).
        labels: (rows,) int64 global ids.
        vocab_start: first global id of the slice.

    Returns:
        (max, sumexp, target), each (rows,) fp32, to be all-reduced across the vocab shards.
    """
    rows, n = logits.shape
    m, s, t = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    wrap_triton(_stats_kernel)[(rows,)](
        logits, labels, m, s, t, logits.stride(0), n, vocab_start, **launch_config(n)
    )
    return m, s, t


def softmax_grad_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    vocab_start: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(exp(logits - lse) - one_hot(labels - vocab_start)) * scale, in place unless `out` is given.

    Args:
        logits: (rows, local_vocab).
        labels: (rows,) int64 global ids; -100 rows get zero gradient.
        lse: (rows,) fp32 logsumexp over the whole (all shards') vocabulary.
        scale: (rows,) fp32 loss weight of each row (times the incoming gradient).
        vocab_start: first global id of this slice.
        out: destination, (rows, local_vocab); defaults to `logits`.

    Returns:
        The gradient tensor (`out` or `logits`).
    """
    rows, n = logits.shape
    out = logits if out is None else out
    wrap_triton(_grad_kernel)[(rows,)](
        logits,
        out,
        labels,
        lse,
        scale,
        logits.stride(0),
        out.stride(0),
        n,
        vocab_start,
        IGNORE=IGNORE_INDEX,
        **launch_config(n),
    )
    return out


def _check_labels(labels: torch.Tensor, vocab_size: int) -> None:
    """Every label in [0, vocab_size) or -100, checked on the device (no host sync).

    The kernels read a label's logit only where it falls in the row, so any other label
    (a padding row's id, a negative one) would silently give loss = logsumexp and a gradient
    without its -1; the reference (F.cross_entropy) and the vocab-parallel loss refuse it.
    """
    ok = (labels >= 0) & (labels < vocab_size) | (labels == IGNORE_INDEX)
    torch._assert_async(
        ok.all(), "a label is outside the vocabulary (and not the ignore index -100)"
    )


def _check_rows(rows: int, labels: torch.Tensor, loss_mask: torch.Tensor | None, what: str) -> None:
    """One label (and one loss-mask value) per row of `what`, or a ValueError naming the shapes.

    The kernels read a label per row by index: fewer labels read past the end, more were
    silently left out while the mean still divided by their count (a wrong loss).
    """
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t is not None and t.numel() != rows:
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} ({t.numel()} values) for the {rows} rows of "
                f"{what}"
            )


def _row_weights(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's weight in the mean loss, on device (no host sync): 1/N or mask / sum(mask)."""
    n = labels.numel()
    if loss_mask is None:
        return torch.full((n,), 1.0 / max(n, 1), dtype=torch.float32, device=labels.device)
    mask = loss_mask.reshape(-1).to(torch.float32)
    return mask / mask.sum().clamp(min=1.0)


# ---- cross_entropy on given logits ----


def _ce_forward(logits, labels, loss_mask):
    """(mean loss, lse (rows,), row weights (rows,)), all fp32."""
    _check_rows(
        logits.numel() // max(1, logits.shape[-1]),
        labels,
        loss_mask,
        f"logits {tuple(logits.shape)}",
    )
    labels1 = labels.reshape(-1).contiguous()
    _check_labels(labels1, logits.shape[-1])
    weights = _row_weights(labels1, loss_mask)
    loss_rows, lse = fused_loss_and_grad_(as_rows(logits), labels1, None)
    return (loss_rows * weights).sum(), lse, weights


def _ce_backward(grad, logits, labels, weights, lse):
    x2 = as_rows(logits)
    dx = softmax_grad_(
        x2,
        labels.reshape(-1).contiguous(),
        lse,
        weights * grad,
        out=torch.empty(x2.shape, dtype=x2.dtype, device=x2.device),
    )
    return dx.view(logits.shape)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, loss_mask):
        loss, lse, weights = _ce_forward(logits, labels, loss_mask)
        ctx.save_for_backward(logits, labels, weights, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):
        return _ce_backward(grad, *ctx.saved_tensors), None, None


@kernel_op("meshtrain::cross_entropy")
def _ce_op(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ce_forward(logits, labels, loss_mask)


@_ce_op.register_fake
def _(logits, labels, loss_mask):
    rows = labels.numel()
    fp32 = {"dtype": torch.float32}
    return (
        logits.new_empty((), **fp32),
        logits.new_empty(rows, **fp32),
        logits.new_empty(rows, **fp32),
    )


@kernel_op("meshtrain::cross_entropy_backward")
def _ce_backward_op(
    grad: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    lse: torch.Tensor,
) -> torch.Tensor:
    return _ce_backward(grad, logits, labels, weights, lse)


@_ce_backward_op.register_fake
def _(grad, logits, labels, weights, lse):
    return logits.new_empty(logits.shape)


def _ce_setup(ctx, inputs, output):
    logits, labels, _ = inputs
    ctx.save_for_backward(logits, labels, output[2], output[1])


def _ce_op_backward(ctx, grad, _dlse, _dweights):
    return _ce_backward_op(grad, *ctx.saved_tensors), None, None


_ce_op.register_autograd(_ce_op_backward, setup_context=_ce_setup)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean token cross-entropy in fp32, weighted by `loss_mask` when given.

    Args:
        logits: (..., vocab), any float dtype (math in fp32).
        labels: (...) int64.
        loss_mask: (...) float, 1 where the token counts.

    Returns:
        Scalar fp32 loss.
    """
    if torch.compiler.is_compiling():
        return _ce_op(logits, labels, loss_mask)[0]
    return _CrossEntropy.apply(logits, labels, loss_mask)
