"""Weight gradients added into an fp32 main gradient inside their GEMMs (Megatron-LM's
gradient-accumulation fusion).

`accumulate_weight_grad` is the dense layers' (`weight_copies.MainGradLinear`, FP8 linears);
`accumulate_expert_weight_grads` the MoE experts' stacked weights, one such GEMM per expert with
rows, as Transformer Engine's grouped linear does with host-side split sizes (`m_splits`): the
per-expert counts are read on the host once per call (a device synchronization). Both are custom
ops that mutate `main_grad`, so that torch.compile keeps them in its graph as in-place calls on
the gradient (no graph break for the counts, no copy of the gradient).
"""

from __future__ import annotations

import torch


def fused_main_grad(weight: torch.Tensor, main: torch.Tensor) -> torch.Tensor | None:
    """The fp32 `.grad` a fused GEMM on `weight` adds its weight gradient into, or None where
    the GEMM runs unfused (its gradient through autograd).

    `main` is the fp32 parameter. On a narrower copy of it (the bf16 weight copies) that is
    `main.grad`, which must exist. On `main` itself it is `main.grad` too under autocast with
    gradients on: activation recompute's second forward, which runs after the copies have been
    swapped back out and must save what the first one saved; otherwise (evaluation, no `.grad`
    yet) None.

    Raises:
        RuntimeError: a copy whose fp32 parameter has no `.grad` to add into.
    """
    if weight.dtype == main.dtype:
        training = torch.is_grad_enabled() and torch.is_autocast_enabled(main.device.type)
        return main.grad if training else None
    if main.grad is None:
        raise RuntimeError(
            f"{tuple(main.shape)} weight: its fused gradient needs an fp32 .grad to add into; "
            "WeightCopies.refresh() allocates it (call it after zero_grad(set_to_none=True))"
        )
    return main.grad


def _addmm_into(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad (out, in) += dy (rows, out)^T @ x (rows, in), in main_grad's dtype: on CUDA
    with bf16/fp16 operands and fp32 `main_grad` one cuBLAS GEMM with an fp32 output and
    beta = 1; elsewhere on operands widened to `main_grad`'s dtype (the same sums, no speed)."""
    if (
        main_grad.is_cuda
        and main_grad.dtype == torch.float32
        and dy.dtype == x.dtype
        and dy.dtype in (torch.bfloat16, torch.float16)
    ):
        torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
    else:  # .to is a no-op where the dtypes already match
        main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))


@torch.library.custom_op("meshtrain::accumulate_weight_grad", mutates_args=("main_grad",))
def accumulate_weight_grad(
    main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor
) -> None:
    """main_grad += grad_output^T @ inputs, summed over every leading dimension, in main_grad's
    dtype.

    On CUDA with bf16/fp16 operands and an fp32 `main_grad` it is one cuBLAS GEMM that reads
    and writes `main_grad` in its epilogue (fp32 output, beta = 1): no low-precision gradient is
    written. Elsewhere the operands are widened to `main_grad`'s dtype first (the same sums, no
    speed). An op of its own so that a compiled backward keeps it as one in-place call on the
    gradient, not a copy of it.
    """
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    x = inputs.reshape(-1, inputs.shape[-1])
    _addmm_into(main_grad, dy, x)


@torch.library.custom_op("meshtrain::accumulate_expert_weight_grads", mutates_args=("main_grad",))
def accumulate_expert_weight_grads(
    main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor, counts: torch.Tensor
) -> None:
    """main_grad[e] += grad_e^T @ x_e for each expert e with rows, in main_grad's dtype.

    Args:
        main_grad: (experts, out, in), the fp32 `.grad` of a stacked expert weight.
        grad_output: (rows, out) the GEMM's output gradient, rows in expert order.
        inputs: (rows, in) the GEMM's input, the same rows.
        counts: (experts,) int64 rows per expert; read on the host (one synchronization). Rows
            past counts.sum() (dropped choices) are ignored; an expert without rows is untouched.
    """
    sizes = counts.tolist()
    used = sum(sizes)
    parts = zip(torch.split(grad_output[:used], sizes), torch.split(inputs[:used], sizes))
    for e, (dy, x) in enumerate(parts):
        if dy.shape[0]:
            _addmm_into(main_grad[e], dy, x)
