"""Sequence-parallel linears with their collectives overlapped with the matmuls
(`parallel.tp_comm_overlap`).

With sequence parallelism every column-parallel linear starts with an all-gather along the
sequence and every row-parallel one ends with a reduce-scatter; done as separate NCCL calls,
the matmul waits for the whole gather and the reduce-scatter waits for the whole matmul. Here
both are PyTorch's symmetric-memory fused ops (`torch.ops.symm_mem.fused_all_gather_matmul`,
`fused_matmul_reduce_scatter`), which cut the work into one piece per rank and multiply the
pieces already received while the rest are copied over NVLink (the decomposition Megatron's
TE "userbuffers" overlap and torch's async-TP pass use). The math is the same as the
`mappings` path; only the schedule differs:

    column:  y = AG_seq(x) W^T          dx = RS_seq(dy W)       dW = dy^T AG_seq(x)
    row:     y = RS_seq(x W^T)          dx = AG_seq(dy) W       dW = AG_seq(dy)^T x

Each backward is again one fused op plus a weight-gradient GEMM. The gathered input is kept
for dW, as the unfused path's `F.linear` keeps it. CUDA and NCCL only (peer-to-peer memory
between the tp ranks); `parallelize` refuses the option elsewhere, and the GPU tests compare
it with the unfused path on two GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.services.trainer.parallel import mappings as M

SEQ_DIM = 1  # activations are (batch, seq, hidden)


def _ops():
    import torch.distributed._symmetric_memory  # registers torch.ops.symm_mem

    return torch.ops.symm_mem


class _GatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_name):
        gathered, (y,) = _ops().fused_all_gather_matmul(x, [w.t()], SEQ_DIM, group_name)
        ctx.save_for_backward(gathered, w)
        ctx.group_name = group_name
        return y

    @staticmethod
    def backward(ctx, dy):
        gathered, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _ops().fused_matmul_reduce_scatter(dy, w, "sum", SEQ_DIM, ctx.group_name)
        dw = dy.flatten(0, -2).t() @ gathered.flatten(0, -2)
        return dx, dw, None


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_name):
        y = _ops().fused_matmul_reduce_scatter(x, w.t(), "sum", SEQ_DIM, group_name)
        ctx.save_for_backward(x, w)
        ctx.group_name = group_name
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        gathered, (dx,) = _ops().fused_all_gather_matmul(
            dy.contiguous(), [w], SEQ_DIM, ctx.group_name
        )
        dw = gathered.flatten(0, -2).t() @ x.flatten(0, -2)
        return dx, dw, None


def cast_for_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    dtype = M.compute_dtype(x)
    # The casts sit outside the Functions, so autograd returns fp32 gradients to fp32 weights,
    # exactly as autocast's own cast in F.linear does.
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


def gather_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """Column-parallel linear under sequence parallelism: (b, s/tp, in) -> (b, s, out/tp)."""
    x, w, b = cast_for_linear(x, weight, bias)
    with torch.autocast(x.device.type, enabled=False):
        y = _GatherLinear.apply(x, w, group.group_name)
        return y + b if b is not None else y


def linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Row-parallel linear under sequence parallelism: (b, s, in/tp) -> (b, s/tp, out)."""
    x, w, _ = cast_for_linear(x, weight, None)
    with torch.autocast(x.device.type, enabled=False):
        return _LinearReduceScatter.apply(x, w, group.group_name)


def check_available(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """Why the fused ops cannot run for this group and device, or None when they can."""
    why = M.cuda_nccl_problem(group, device)
    if why:
        return why
    try:
        _ops().fused_all_gather_matmul  # noqa: B018  (attribute lookup: is the op registered?)
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this torch has no symmetric-memory fused ops ({e})"
    return None
