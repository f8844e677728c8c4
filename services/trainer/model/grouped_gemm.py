"""Grouped expert GEMMs: rows in expert order times each expert's weight, in one kernel.

`grouped_linear` runs `torch._grouped_mm` where it can (CUDA, bf16/fp16, sm90+: one kernel for
all experts, the split sizes kept on the device) and elsewhere `grouped_mm_loop`, one matmul per
expert inside a custom op, so that torch.compile keeps a MoE block in one graph (the counts reach
the host inside the op). `grouped_linear_loop` is the plain reference both are held to.

Given a `main_grad` (train.expert_gradient_accumulation_fusion) `grouped_linear`'s backward
adds the weight's gradient into it, one fp32-output GEMM per expert
(`main_grad.accumulate_expert_weight_grads`), and returns none for the weight.
"""

from __future__ import annotations

import torch

from meshtrain.services.trainer.model.main_grad import accumulate_expert_weight_grads


def grouped_gemm_available(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs this input: CUDA, bf16/fp16, compute capability 9.0+."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    grouped: bool,
    main_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of `x` in expert order times each expert's weight transposed.

    Args:
        x: (tokens, in) rows grouped by expert, counts[e] rows for expert e.
        weight: (experts, out, in), nn.Linear's layout per expert.
        counts: (experts,) int64 rows per expert.
        grouped: use `torch._grouped_mm` (one kernel for all experts; no host sync) if it runs
            here; else `grouped_mm_loop`, one matmul per expert inside one custom op, which
            torch.compile keeps in its graph (the counts reach the host inside the op).
        main_grad: (experts, out, in) fp32, the fp32 weight's `.grad`
            (`moe.StackedWeight.main_grad`): the backward adds the weight's gradient into it
            and returns none for `weight`. None: the gradient goes to `weight` through autograd.

    Returns:
        (tokens, out).

    Under autocast both operands are cast to its dtype first, as autocast casts a matmul's: the
    grouped kernel then runs on an fp32 stream's rows too, and the loop op sees one dtype in
    forward and backward (which runs outside the autocast region).
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    w = weight.to(x.dtype)
    grouped = grouped and grouped_gemm_available(x)
    if main_grad is not None:
        return _GroupedLinearIntoMainGrad.apply(x, w, counts, grouped, main_grad)
    return _expert_mm(x, w, counts, grouped)


def _expert_mm(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool
) -> torch.Tensor:
    """x (rows, in) times weight[e]^T (weight (experts, out, in)) per expert -> (rows, out): one
    `torch._grouped_mm` where `grouped` (it runs here), else `grouped_mm_loop`."""
    if grouped:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)
    return grouped_mm_loop(x, weight, counts)


def expert_weight_grad(
    dy: torch.Tensor,
    x: torch.Tensor,
    counts: torch.Tensor,
    grouped: bool,
    main_grad: torch.Tensor | None,
) -> torch.Tensor | None:
    """The weight gradient of a grouped expert GEMM y = x · weight[e]^T: dy (rows, out) and x
    (rows, in) in expert order.

    Returns:
        (experts, out, in) dyᵀ · x per expert in dy's dtype (one `torch._grouped_mm` where
        `grouped`, else the loop op); or, given `main_grad` (experts, out, in), None after adding
        that gradient into it (`accumulate_expert_weight_grads`: the counts read on the host).
    """
    if main_grad is not None:
        accumulate_expert_weight_grads(main_grad, dy, x, counts)
        return None
    if grouped:
        # dyᵀ · x: (experts, out, in) contiguous, the weight's own layout. (xᵀ · dy transposed,
        # the same values, made autograd copy every expert's gradient into that layout before
        # accumulating it: 360 of 2,057 ms a step on the `moe` config, H100.)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(dy.t(), x, offs=offs)
    return grouped_mm_loop_weight_grad(dy, x, counts)


class _GroupedLinearIntoMainGrad(torch.autograd.Function):
    """`_expert_mm` whose backward adds the weight's gradient into `main_grad` (returning none
    for the weight) and returns the input's as usual."""

    @staticmethod
    def forward(ctx, x, weight, counts, grouped: bool, main_grad):
        ctx.save_for_backward(x, weight, counts)
        # Not saved: the gradient is added into in place between this forward and the backward.
        ctx.main_grad, ctx.grouped = main_grad, grouped
        return _expert_mm(x, weight, counts, grouped)

    @staticmethod
    def backward(ctx, dy):
        x, weight, counts = ctx.saved_tensors
        dy = dy.contiguous()
        accumulate_expert_weight_grads(ctx.main_grad, dy, x, counts)
        # dx (rows, in) = dy · weight[e] per expert: the forward's GEMM on the weight's
        # transpose (experts, in, out)
        dx = (
            _expert_mm(dy, weight.transpose(1, 2), counts, ctx.grouped)
            if ctx.needs_input_grad[0]
            else None
        )
        return dx, None, None, None, None


def grouped_linear_loop(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The reference: one matmul per expert over its rows (host sync for the counts)."""
    outs = [rows @ weight[e].t() for e, rows in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


# The per-expert loop as custom ops: torch.compile sees one op of known output shape (its fake
# implementation) where the loop's `.tolist()` and the split into data-dependent sizes would each
# break the graph; the loop runs inside, at run time. Backward is two more such ops.
@torch.library.custom_op("meshtrain::grouped_mm_loop", mutates_args=())
def grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_linear_loop` as one op: x (rows, in), weight (experts, out, in), counts
    (experts,) -> (rows, out); rows past counts.sum() come out zero."""
    used = int(counts.sum())
    out = grouped_linear_loop(x[:used], weight, counts)
    if used == x.shape[0]:
        return out
    return torch.cat([out, out.new_zeros(x.shape[0] - used, weight.shape[1])])


@grouped_mm_loop.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("meshtrain::grouped_mm_loop_weight_grad", mutates_args=())
def grouped_mm_loop_weight_grad(
    grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """d(weight) of `grouped_mm_loop`: grad (rows, out), x (rows, in) -> (experts, out, in),
    expert e's block grad_e^T x_e (zero for an expert without rows)."""
    out = grad.new_zeros(counts.shape[0], grad.shape[1], x.shape[1])
    sizes = counts.tolist()
    for e, (g, rows) in enumerate(
        zip(torch.split(grad[: sum(sizes)], sizes), torch.split(x[: sum(sizes)], sizes))
    ):
        if rows.shape[0]:
            out[e] = g.t() @ rows
    return out


@grouped_mm_loop_weight_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(counts.shape[0], grad.shape[1], x.shape[1])


def _grouped_mm_loop_setup(ctx, inputs, output) -> None:
    x, weight, counts = inputs
    ctx.save_for_backward(x, weight, counts)


def _grouped_mm_loop_backward(ctx, grad: torch.Tensor):
    x, weight, counts = ctx.saved_tensors
    dx = grouped_mm_loop(grad, weight.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_loop_weight_grad(grad, x, counts) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm_loop.register_autograd(_grouped_mm_loop_backward, setup_context=_grouped_mm_loop_setup)
