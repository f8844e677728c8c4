"""TP's forward all-reduce through symmetric memory (`parallel.tp_reduce_impl = "symm_mem"`).

Without sequence parallelism each row-parallel linear ends with an all-reduce of its (batch,
seq, hidden) output, and nothing else can run until it is done: in the TP=2 profiles
(BENCHMARKS.md) these forward all-reduces are most of the communication left exposed. NCCL's
ring takes 0.155-0.159 ms for llama-1b's 32 MB (about 210 GB/s on two H200s), PyTorch's
symmetric-memory two-shot all-reduce in place 0.130 ms (copy into its buffer included), and
this op, which writes a fresh output, 0.149 ms (`benchmarks/allreduce_bench.py`; end to end no
faster than NCCL, so the option is off by default). Two-shot: every rank reduces its 1/tp
slice of the sum by reading the other ranks' buffers over NVLink (peer loads; no multicast),
then gathers the other slices the same way.

The same arithmetic as `mappings.reduce_from_region`: sum over the tp ranks in forward, the
identity in backward. The reduction is a custom op (`meshtrain::symm_all_reduce`) so that
torch.compile keeps it as one opaque call, as it keeps NCCL's. Each rank copies its input into
a symmetric buffer of that exact size, made (collectively, on first use) once per group,
dtype and size; the ranks of a group run the same shapes in the same order, so they make
their buffers together. The buffers are reused: the op's closing barrier means no peer still
reads a buffer when the next call overwrites it. CUDA with NCCL only: `check_available` says
why not elsewhere, and `parallelize` refuses the option with its answer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.services.trainer.parallel import mappings as M

# (group name, dtype, numel, device index) -> that group's symmetric buffer of that size
_BUFFERS: dict[tuple[str, torch.dtype, int, int], torch.Tensor] = {}

ALIGN_BYTES = 16  # the two-shot kernel moves 16-byte vectors


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def _buffer(group_name: str, like: torch.Tensor) -> torch.Tensor:
    key = (group_name, like.dtype, like.numel(), like.device.index)
    buf = _BUFFERS.get(key)
    if buf is None:
        symm_mem = _symm_mem()
        buf = symm_mem.empty(like.numel(), dtype=like.dtype, device=like.device)
        symm_mem.rendezvous(buf, group_name)  # collective over the group
        _BUFFERS[key] = buf
    return buf


@torch.library.custom_op("meshtrain::symm_all_reduce", mutates_args=())
def symm_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of `x` over the group's ranks (a new contiguous tensor), by the two-shot kernel."""
    buf = _buffer(group_name, x)
    buf.copy_(x.reshape(-1))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", group_name, out.view(-1))
    return out


@symm_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class _SymmReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        return symm_all_reduce(x.contiguous(), group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduces_here(x: torch.Tensor) -> bool:
    """Whether the two-shot kernel takes `x` (16-byte multiples of bf16 or fp32); else NCCL does."""
    return x.dtype in (torch.bfloat16, torch.float32) and (x.numel() * x.element_size()) % ALIGN_BYTES == 0


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`mappings.reduce_from_region` through symmetric memory: all-reduce forward, identity backward."""
    if dist.get_world_size(group) == 1 or not reduces_here(x):
        return M.reduce_from_region(x, group)
    return _SymmReduce.apply(x, group.group_name)


def check_available(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """Why the symmetric-memory all-reduce cannot run for this group and device, or None."""
    why = M.cuda_nccl_problem(group, device)
    if why:
        return why
    try:
        _symm_mem()
        torch.ops.symm_mem.two_shot_all_reduce_out  # noqa: B018  (is the op registered?)
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this torch has no symmetric-memory all-reduce ({e})"
    return None
