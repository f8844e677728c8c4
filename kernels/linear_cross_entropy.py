"""Fused output projection + cross-entropy that never holds the full (tokens, vocab) logits.

Tokens go through in chunks; each chunk computes logits = h_c @ W^T (in the compute dtype, as
the reference does), runs the fused cross-entropy kernel of `kernels/cross_entropy.py` in
place to turn them into dlogits already scaled by the loss weights, then immediately forms
grad_hidden = dlogits @ W and accumulates grad_weight += dlogits^T @ h_c in fp32. So forward
already produces both gradients (Liger-Kernel's plan) and backward only scales them by the
incoming gradient; peak extra memory is one chunk of logits plus an fp32 weight-gradient
buffer instead of several full (tokens, vocab) tensors. Weight rows past `vocab_size`
(padding) never enter the matmul and get zero gradient. Label -100 is ignored like
F.cross_entropy's default; any other label outside the vocabulary is an error, checked on the
device. Eager autograd goes through `_LinearCrossEntropy`; torch.compile through the custom op
`meshtrain::linear_cross_entropy` (an opaque node with a fake implementation for shapes).
Spec: `meshtrain.kernels.reference.linear_cross_entropy`.
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import math

import torch

from meshtrain.kernels._launch import kernel_op, tracing
from meshtrain.kernels.cross_entropy import (
    _check_labels,
    _check_rows,
    _row_weights,
    fused_loss_and_grad_,
)
from meshtrain.kernels.reference import compute_dtype

# Budget for one chunk's logits; 512 MiB is 2048 tokens at a 128k vocabulary in bf16.
CHUNK_BYTES = 512 * 2**20


def _chunk_rows(rows: int, vocab: int, itemsize: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        return max(1, min(rows, chunk_size))
    # a power of two keeps the chunk matmuls on cuBLAS's fast tile shapes
    fit = max(1, CHUNK_BYTES // max(1, vocab * itemsize))
    return max(1, min(rows, 1 << (fit.bit_length() - 1)))


_MM_FP32_OUT: bool | None = None


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc (fp32) = a @ b when `first`, else acc += a @ b, without rounding the sum to a half dtype.

    CUDA builds of torch >= 2.9 let a half-precision matmul write or accumulate straight into
    the fp32 buffer (`out_dtype`), faster than a bf16 product added in a second pass
    (measured: BENCHMARKS.md, 'Kernel design choices'). Elsewhere, and
    while torch.compile traces the op (torch 2.11's fake-tensor decomposition of addmm fails
    on `out_dtype`), the chunk's product is formed in the half dtype (fp32 inside the matmul)
    and added. Only an eager call's failure turns the fast path off for good, so a trace
    cannot disable it for eager calls. The first chunk writes instead of adding, so the
    buffer is never zero-filled nor read back.
    """
    global _MM_FP32_OUT
    if a.dtype == acc.dtype:
        torch.mm(a, b, out=acc) if first else acc.addmm_(a, b)
        return
    if _MM_FP32_OUT is not False and a.is_cuda and not tracing():
        try:
            if first:
                torch.mm(a, b, out_dtype=torch.float32, out=acc)
            else:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _MM_FP32_OUT = True
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_FP32_OUT = False
    acc.copy_(a @ b) if first else acc.add_(a @ b)


def _linear_ce(hidden, weight, labels, loss_mask, vocab_size, chunk_size, dtype, want_grads):
    """Loss and, when `want_grads`, (grad_hidden, grad_weight) for a unit incoming gradient.

    grad_hidden is (tokens, hidden) in the compute `dtype`, grad_weight fp32 in weight's shape.
    """
    h2 = hidden.reshape(-1, hidden.shape[-1]).to(dtype)  # (tokens, hidden)
    w = weight[:vocab_size].to(dtype)  # (vocab, hidden): padding rows left out
    rows = h2.shape[0]
    _check_rows(rows, labels, loss_mask, f"hidden {tuple(hidden.shape)}")
    labels1 = labels.reshape(-1).contiguous()
    _check_labels(labels1, vocab_size)
    weights = _row_weights(labels1, loss_mask)
    step = _chunk_rows(rows, vocab_size, h2.element_size(), chunk_size)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(h2) if want_grads else None
    grad_w = None
    if want_grads:
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        # padding rows get no gradient; without tokens no row does (no chunk writes it)
        grad_w[vocab_size if rows else 0 :].zero_()
    for start in range(0, rows, step):
        end = min(start + step, rows)
        h_c = h2[start:end]
        logits = h_c @ w.t()  # (chunk, vocab)
        loss_rows, _ = fused_loss_and_grad_(
            logits, labels1[start:end], weights[start:end] if want_grads else None
        )
        loss += (loss_rows * weights[start:end]).sum()
        if want_grads:
            # logits now hold dlogits = (softmax - one_hot) * row weight
            assert grad_h is not None and grad_w is not None  # allocated with want_grads
            torch.mm(logits, w, out=grad_h[start:end])
            _accumulate(grad_w[:vocab_size], logits.t(), h_c, first=start == 0)
    return loss, grad_h, grad_w


def _scale_grads(ctx, grad, grad_h, grad_w, in_place: bool):
    """(dhidden, dweight): the unit-gradient results times the incoming gradient, in the inputs'
    dtypes.

    Scaling by a device scalar, never comparing it to 1 on the host (no sync); `out=` in the
    parameter's dtype fuses the scaling with the cast into one pass. `in_place` reuses the
    fp32 weight-gradient buffer (eager); compiled graphs may not mutate a saved tensor.
    """
    shape, dtype = ctx.hidden_meta
    dh = dw = None
    if ctx.needs_input_grad[0]:
        dh = torch.mul(
            grad_h, grad, out=torch.empty(grad_h.shape, dtype=dtype, device=grad_h.device)
        )
        dh = dh.view(shape)
    if ctx.needs_input_grad[1]:
        if ctx.weight_dtype != torch.float32:
            dw = torch.mul(
                grad_w,
                grad,
                out=torch.empty(grad_w.shape, dtype=ctx.weight_dtype, device=grad_w.device),
            )
        else:
            dw = grad_w.mul_(grad) if in_place else grad_w * grad
    return dh, dw


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_mask, vocab_size, chunk_size):
        loss, grad_h, grad_w = _linear_ce(
            hidden, weight, labels, loss_mask, vocab_size, chunk_size, compute_dtype(hidden), True
        )
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_meta = (hidden.shape, hidden.dtype)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        return _scale_grads(ctx, grad, grad_h, grad_w, in_place=True) + (None,) * 4


@kernel_op("meshtrain::linear_cross_entropy")
def _lce_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    vocab_size: int,
    chunk_size: int | None,
    compute_dtype: torch.dtype,
    want_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight); without `want_grads` the gradients are empty (0,)
    tensors."""
    loss, grad_h, grad_w = _linear_ce(
        hidden, weight, labels, loss_mask, vocab_size, chunk_size, compute_dtype, want_grads
    )
    if not want_grads:
        grad_h, grad_w = hidden.new_empty(0), hidden.new_empty(0)  # outputs may not alias
    return loss, grad_h, grad_w


@_lce_op.register_fake
def _(hidden, weight, labels, loss_mask, vocab_size, chunk_size, compute_dtype, want_grads):
    loss = hidden.new_empty((), dtype=torch.float32)
    if not want_grads:
        return loss, hidden.new_empty(0), hidden.new_empty(0)
    tokens = math.prod(hidden.shape[:-1])
    return (
        loss,
        hidden.new_empty((tokens, hidden.shape[-1]), dtype=compute_dtype),
        weight.new_empty(weight.shape, dtype=torch.float32),
    )


def _lce_setup(ctx, inputs, output):
    hidden, weight = inputs[:2]
    ctx.save_for_backward(output[1], output[2])
    ctx.hidden_meta = (hidden.shape, hidden.dtype)
    ctx.weight_dtype = weight.dtype


def _lce_op_backward(ctx, grad, _dgrad_h, _dgrad_w):
    grad_h, grad_w = ctx.saved_tensors
    return _scale_grads(ctx, grad, grad_h, grad_w, in_place=False) + (None,) * 6


_lce_op.register_autograd(_lce_op_backward, setup_context=_lce_setup)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Output projection followed by cross-entropy; rows of `weight` past `vocab_size` are padding.

    Args:
        hidden: (..., hidden).
        weight: (padded_vocab, hidden).
        labels: (...) int64 in [0, vocab_size) (or -100: ignored).
        loss_mask: optional (...) float.
        vocab_size: the real vocabulary; padded rows are left out of the softmax.
        chunk_size: tokens per chunk; default fits one chunk's logits in `CHUNK_BYTES`.

    Returns:
        Scalar fp32 mean loss (weighted by loss_mask when given).
    """
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    if not 0 < vocab_size <= weight.shape[0]:
        # more than the weight's rows: labels past its last row would find no logit and give a
        # silently wrong loss (logsumexp alone), not an error
        raise ValueError(
            f"linear_cross_entropy: vocab_size {vocab_size} outside 1..{weight.shape[0]}, "
            f"the output weight's rows ({tuple(weight.shape)})"
        )
    want_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if torch.compiler.is_compiling():
        return _lce_op(
            hidden,
            weight,
            labels,
            loss_mask,
            vocab_size,
            chunk_size,
            compute_dtype(hidden),
            want_grads,
        )[0]
    if not want_grads:
        return _linear_ce(
            hidden, weight, labels, loss_mask, vocab_size, chunk_size, compute_dtype(hidden), False
        )[0]
    return _LinearCrossEntropy.apply(hidden, weight, labels, loss_mask, vocab_size, chunk_size)
