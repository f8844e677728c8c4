"""Every differentiable collective of the trainer: the paired communication regions of tensor
and sequence parallelism, and the all-to-all that experts and context parallelism move rows with.

Each region's backward is the adjoint of its forward, so the pairs below compose into exact
gradients:

    copy_to_region        fwd: identity              bwd: all-reduce
    reduce_from_region    fwd: all-reduce            bwd: identity
    scatter_to_region     fwd: keep own chunk (last) bwd: all-gather (last dim)
    gather_from_region    fwd: all-gather (last dim) bwd: keep own chunk
    scatter_to_sequence   fwd: keep own seq chunk    bwd: all-gather (seq)
    gather_from_sequence  fwd: all-gather (seq)      bwd: reduce-scatter (seq)
    reduce_scatter_to_sequence  fwd: reduce-scatter (seq)  bwd: all-gather (seq)
    all_to_all            fwd: exchange rows (dim 0) bwd: the reverse exchange

`launch_sum` / `wait_sum` split the sum over tp into a launch and a wait, so that the
column-parallel linears' backward computes the weight gradient while its input gradient is
reduced (`parallel.tp_async_grad_reduce`).

Activations are batch-first, so the sequence dim is 1: (batch, seq/tp, hidden). With a group
of size 1 (or None) every region is the identity. The CPU tests run the same collective calls
on gloo as the GPUs on NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from meshtrain.kernels.reference import compute_dtype

Group = dist.ProcessGroup | None


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def all_reduce_max(x: torch.Tensor, group: Group) -> torch.Tensor:
    """In-place elementwise max over ranks (x must be contiguous)."""
    if _size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (dim must divide evenly)."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split evenly over {n} ranks")
    return x.chunk(n, dim=dim)[_rank(group)].contiguous()


def gather_into(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """Every rank's `inp`, back to back along dim 0, into `out` (one-tensor all-gather).

    torch 2.13 names it `all_gather_single` and warns on `all_gather_into_tensor`; earlier
    releases (meshtrain supports torch >= 2.5) have only the older name. Looked up per call.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """The sum over ranks of `inp`, this rank's slice along dim 0 into `out` (one-tensor
    reduce-scatter; named as `gather_into` says)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    n = _size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()  # gather along dim 0: one contiguous buffer
    out = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    gather_into(out, front, group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum `x` over ranks and keep this rank's chunk along `dim`."""
    n = _size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, front, group)
    return out.movedim(0, dim)


def cuda_nccl_problem(group: Group, device: torch.device) -> str | None:
    """Why peer-to-peer GPU memory cannot serve this group and device (not CUDA, not NCCL), or
    None."""
    if device.type != "cuda":
        return f"it needs CUDA devices (this run is on {device.type})"
    if group is None or dist.get_backend(group) != "nccl":
        return "it needs the NCCL backend"
    return None


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` cast to `compute_dtype(x)`.

    Called before a collective on a matmul's input, so the all-gather (and the reduce-scatter
    or all-reduce of its gradient in backward) moves bf16 rather than the fp32 residual stream:
    half the bytes, and the same numbers reach the matmul.
    """
    return x.to(compute_dtype(x))


def _region(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function applying `forward(x, dim, group)` and `backward(grad, dim, group)`."""

    def fwd(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return forward(x, dim, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.dim, ctx.group), None, None

    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(fwd), "backward": staticmethod(bwd)},
    )


def _identity(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return x


def _sum(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-reduce out of place, as a functional collective.

    Not `dist.all_reduce` on a clone: in a graph compiled for CUDA, the in-place all-reduce in
    copy_to_region's backward did not reach the gradient (tp=2 without sequence parallelism on
    two H200s: first losses equal to one GPU's, then training stalled). A functional
    collective is one traced op whose result is the reduced tensor.
    """
    if group is None or _size(group) == 1:
        return x
    y = funcol.all_reduce(x.contiguous(), "sum", group)
    return y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else y


_Copy = _region("_Copy", _identity, _sum)
_Reduce = _region("_Reduce", _sum, _identity)
_Scatter = _region("_Scatter", split, all_gather)
_Gather = _region("_Gather", all_gather, split)
_GatherReduceScatter = _region("_GatherReduceScatter", all_gather, reduce_scatter)
_ReduceScatter = _region("_ReduceScatter", reduce_scatter, all_gather)


SEQ_DIM = 1  # activations are (batch, seq, hidden)


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _Copy.apply(x, 0, group) if _size(group) > 1 else x


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _Reduce.apply(x, 0, group) if _size(group) > 1 else x


def scatter_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _Scatter.apply(x, x.dim() - 1, group) if _size(group) > 1 else x


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _Gather.apply(x, x.dim() - 1, group) if _size(group) > 1 else x


def scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _Scatter.apply(x, SEQ_DIM, group) if _size(group) > 1 else x


def gather_from_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _GatherReduceScatter.apply(x, SEQ_DIM, group) if _size(group) > 1 else x


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceScatter.apply(x, SEQ_DIM, group) if _size(group) > 1 else x


def _exchange_rows(
    x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: Group
) -> torch.Tensor:
    """Rows of `x` (in_splits[r] for rank r, in rank order) exchanged; out_splits[r] arrive from
    rank r. Splits None: an even exchange, x.shape[0] / group size rows to and from each rank."""
    x = x.contiguous()
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 (splits uneven or None); backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange_rows(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange_rows(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor,
    group: Group,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
) -> torch.Tensor:
    """Differentiable all-to-all of rows: send in_splits[r] rows of `x` to rank r, receive
    out_splits[r] rows from it (splits None: equal shares of dim 0, which must divide evenly).

    Experts send each token row to the rank holding its expert (uneven splits); context
    parallelism swaps sequence chunks for heads (even splits, one block per rank).
    """
    return _AllToAll.apply(x, out_splits, in_splits, group)


def launch_sum(x: torch.Tensor, group: dist.ProcessGroup, sp: bool) -> torch.Tensor:
    """Launch the sum of `x` (batch, seq, ...) over tp: all-reduce, or with `sp` reduce-scatter
    along the sequence (done along dim 0 of a sequence-first copy). Returns the in-flight
    result, garbage until `wait_sum`. Functional collectives, so the launch and the wait are
    separate ops in a compiled graph too, and work issued between them overlaps the transfer.
    """
    ops = torch.ops._c10d_functional
    if sp:
        front = x.movedim(SEQ_DIM, 0).contiguous()
        return ops.reduce_scatter_tensor(front, "sum", _size(group), group.group_name)
    return ops.all_reduce(x.contiguous(), "sum", group.group_name)


def wait_sum(pending: torch.Tensor, sp: bool) -> torch.Tensor:
    """The finished sum of a `launch_sum`, batch-first again."""
    done = torch.ops._c10d_functional.wait_tensor(pending)
    return done.movedim(0, SEQ_DIM) if sp else done
