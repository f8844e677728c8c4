"""Data parallelism: bucketed gradient reduction (optionally overlapped with backward) and the
distributed optimizer (ZeRO-1: Adam state sharded over dp).

Gradients live in one flat fp32 buffer per bucket (each parameter's `.grad` is a view into
it, so autograd accumulates micro-batches in place). On the last micro-batch a bucket is
reduced as soon as every gradient in it is final (`overlap_grad_reduce`), or all buckets after
backward, sending the buffer itself or (`reduce_dtype=torch.bfloat16`) a bf16 copy of it, half
the bytes, copied back after. Plain DP all-reduces the buckets; the distributed optimizer
reduce-scatters them, so each dp rank receives the sum for its 1/dp slice of every bucket,
updates only that slice (Adam moments exist only for it) and all-gathers the updated
parameters, optionally overlapped with the next forward (`overlap_param_gather`). Gradients of
sequence-parallel parameters (norms, row-parallel biases) are first summed over tp. With
`bf16_params` (optim.offload_bf16_params) the parameters, and ZeRO-1's flat parameter buffers,
are bf16, their fp32 masters offloaded to the host, and the fp32 bucket views are their
`main_grad`s (main_grads.py) rather than their `.grad`s. With context
parallelism the reduction and the ZeRO-1 shards span dp x cp (the cp ranks' gradients are shares of
one sample's, summed; the mean is over dp). Gradient clipping uses the true global norm over tp, dp
and pp, counting replicated parameters once.

Expert parallelism (`expert.parallelize_experts`): the weights of a rank's experts (marked
`expert_shard`) go into buckets of their own, reduced (and, ZeRO-1, sharded) over the "edp"
group, the dp·cp/ep ranks holding the same experts. Each rank's expert gradient already sums
the gradients of its ep group's losses (the all-to-all's backward brings them), so the sum over
edp covers every rank's loss once, and the divisor stays dp, as for every other parameter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.optim.main_grads import attach_main_grads, grad_of
from meshtrain.services.trainer.optim.offload import OffloadedAdamW
from meshtrain.services.trainer.optim.optimizer import adamw, is_decayed
from meshtrain.services.trainer.parallel import mappings as M
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor_layers import tp_split_of


@dataclass
class Bucket:
    """A run of parameters sharing one flat gradient buffer (and, for ZeRO-1, parameter buffer)."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # padded to a multiple of dp
    grad: torch.Tensor
    param_flat: torch.Tensor | None = None
    local_grad: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    # None: not launched; True: nothing to wait for (a group of one); else the collective's
    reduce_handle: dist.Work | Literal[True] | None = None
    gather_handle: dist.Work | None = None
    wire: tuple[torch.Tensor, torch.Tensor] | None = (
        None  # (sent, received) in grad_reduce_dtype while in flight
    )
    group: dist.ProcessGroup | None = None  # reduced (ZeRO-1: sharded) over these ranks
    shards: int = 1  # ranks in `group`; numel is a multiple of it
    shard_rank: int = 0  # this rank's index in `group`: its ZeRO-1 slice
    expert: bool = False  # holds expert weights (group: edp)

    @property
    def flat_params(self) -> torch.Tensor:
        """ZeRO-1: the flat parameter buffer the bucket's parameters are views into."""
        assert self.param_flat is not None  # made for the distributed optimizer
        return self.param_flat

    @property
    def slice_grad(self) -> torch.Tensor:
        """ZeRO-1: this rank's slice of the reduced gradient."""
        assert self.local_grad is not None  # made for the distributed optimizer
        return self.local_grad

    def slice_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's ZeRO-1 slice of a flat buffer of the bucket's size."""
        n = self.numel // self.shards
        return flat[self.shard_rank * n : (self.shard_rank + 1) * n]

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


def _applied_grad(p: nn.Parameter) -> torch.Tensor:
    """The gradient a step applies to `p` (`grad_of`): a view into its bucket, or its ZeRO-1
    slice, made with the bucket and zeroed in place, so never None."""
    g = grad_of(p)
    assert g is not None
    return g


def forward_units(model: GPT) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """A GPT's (module, parameters) units in forward order, for `overlap_param_gather`.

    Each unit's forward pre-hook waits for the all-gathers of the buckets holding its
    parameters: the vision encoder and projector (if any), the embedding, each block, then the
    final norm, whose forward runs just before the head multiplies by the output weight (the
    embedding's, when tied).
    """
    head = [
        q for m in (model.final_norm, model.output_layer) if m is not None for q in m.parameters()
    ]
    vision = [
        (m, list(m.parameters()))
        for m in (getattr(model, "vision", None), getattr(model, "projector", None))
        if m is not None
    ]  # a vision-language model encodes the images before it embeds the tokens
    return (
        vision
        + [(model.embedding, list(model.embedding.parameters()))]
        + [(layer, list(layer.parameters())) for layer in model.layers]
        + [(model.final_norm, head)]
    )


class DataParallel:
    """Gradient synchronization and (optionally) ZeRO-1 for a model sharded over `mesh`.

    Args:
        model: the (tensor-parallel) model; its parameters become views into flat buffers.
        mesh: groups; gradients are averaged over dp and summed over tp where needed.
        optim: AdamW settings (the distributed optimizer builds its own sharded AdamW).
        distributed_optimizer: ZeRO-1.
        overlap_grad_reduce / overlap_param_gather: launch communication asynchronously.
        bucket_size: elements per bucket.
        reduce_dtype: what the gradient reduction sends (torch.float32: the buffers themselves;
            torch.bfloat16: a copy rounded to bf16, half the bytes, copied back after).
        gather_units: for overlap_param_gather, (module, params) pairs: the module's forward
            pre-hook waits for the all-gathers of the buckets holding those params. Unset: the
            whole model waits before its forward (correct, but no overlap).
        tied: under pipeline parallelism, the word embedding of the first stage or its copy on
            the last (`PipelineStage`): in a bucket of its own, its gradient summed over the
            mesh's "pp_ends" group before the data-parallel reduction, so both stay equal.
        bf16_params: with optim.optimizer_cpu_offload, make the (fp32) parameters bf16 once the
            offloaded optimizer (ZeRO-1's, or the caller's `build_optimizer(..., True)`) has
            read their fp32 masters; the buckets' fp32 views become their `main_grad`s.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        optim: OptimConfig,
        *,
        distributed_optimizer: bool = False,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        bucket_size: int = 40_000_000,
        gather_units: list[tuple[nn.Module, list[nn.Parameter]]] | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        tied: nn.Parameter | None = None,
        bf16_params: bool = False,
    ):
        if bf16_params and not optim.optimizer_cpu_offload:
            raise ConfigError("bf16 parameters with fp32 masters need optim.optimizer_cpu_offload")
        self.bf16_params = bf16_params
        if reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"gradients are reduced in fp32 or bf16, not {reduce_dtype}")
        self.model, self.mesh, self.optim_config = model, mesh, optim
        self.reduce_dtype = reduce_dtype
        self.dist_opt = distributed_optimizer
        self.overlap_grad, self.overlap_param = (
            overlap_grad_reduce,
            overlap_param_gather and distributed_optimizer,
        )
        # Reduced (and, ZeRO-1, sharded) over dp x cp: context-parallel ranks hold the same
        # parameters and each a share of every sample's loss, so their gradients are summed;
        # the mean is over the data-parallel replicas only (`mean_over`).
        self.tp_group = mesh.group("tp")
        if mesh.cp > 1:
            self.dp_group = mesh.group("dp_cp")
            self.dp, self.dp_rank = mesh.dp * mesh.cp, mesh.ranks["dp_cp"].index(mesh.rank)
        else:  # the dp group (dp_cp has the same members), as the caller's own collectives use
            self.dp_group, self.dp, self.dp_rank = mesh.group("dp"), mesh.dp, mesh.dp_rank
        self.mean_over = mesh.dp
        # Expert weights (split over ep): reduced over the ranks holding the same experts.
        self.edp_group, self.edp, self.edp_rank = mesh.group("edp"), mesh.size("edp"), mesh.edp_rank
        self.sync_enabled = True
        self.names = {p: n for n, p in model.named_parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        odd = [
            n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32
        ]
        if odd:  # the flat buffers are fp32: a bf16 parameter would be silently upcast or refused
            raise ConfigError(
                f"data parallelism keeps fp32 parameters and gradients (bf16 comes from "
                f"autocast: train.bf16); {odd[0]} is {dict(model.named_parameters())[odd[0]].dtype}"
            )
        self.tied = tied if tied is not None and mesh.group("pp_ends") is not None else None
        ordered = [p for p in reversed(params) if p is not self.tied]  # backward order
        experts = [p for p in ordered if self._is_expert(p)]
        self.buckets = self._make_buckets(
            [p for p in ordered if not self._is_expert(p)], bucket_size
        ) + self._make_buckets(experts, bucket_size, expert=True)
        first = {id(p): i for i, p in enumerate(ordered)}
        self.buckets.sort(key=lambda b: first[id(b.params[0])])  # backward order across both kinds
        if self.tied is not None:  # alone: launched only after the sum over the pipeline ends
            self.buckets += self._make_buckets([self.tied], self.tied.numel())
        self.bucket_of = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.optimizer = self._build_optimizer() if distributed_optimizer else None
        if self.overlap_param:
            self._install_gather_waits(gather_units or [(model, list(model.parameters()))])

    # ---------------------------------------------------------------- buckets
    def _is_expert(self, p: nn.Parameter) -> bool:
        """An expert weight split over ep (at ep 1 experts are reduced as any other parameter)."""
        return self.mesh.ep > 1 and getattr(p, "expert_shard", None) is not None

    def _make_buckets(
        self, params: list[nn.Parameter], bucket_size: int, expert: bool = False
    ) -> list[Bucket]:
        runs, run, size = [], [], 0
        for p in params:
            run.append(p)
            size += p.numel()
            if size >= bucket_size:
                runs.append(run)
                run, size = [], 0
        if run:
            runs.append(run)
        buckets = []
        for run in runs:
            offsets, off = [], 0
            for p in run:
                offsets.append(off)
                off += p.numel()
            group, shards, rank = (
                (self.edp_group, self.edp, self.edp_rank)
                if expert
                else (self.dp_group, self.dp, self.dp_rank)
            )
            numel = -(-off // shards) * shards
            device = run[0].device
            b = Bucket(
                run,
                offsets,
                numel,
                torch.zeros(numel, dtype=torch.float32, device=device),
                group=group,
                shards=shards,
                shard_rank=rank,
                expert=expert,
            )
            if self.dist_opt:
                b.param_flat = torch.zeros(numel, dtype=run[0].dtype, device=device)
                b.local_grad = torch.zeros(numel // shards, dtype=torch.float32, device=device)
            for i, p in enumerate(run):
                if b.param_flat is not None:
                    b.view(b.param_flat, i).copy_(p.data)
                    p.data = b.view(b.param_flat, i)
                if not self.bf16_params:
                    p.grad = b.view(b.grad, i)
            if self.bf16_params:  # hooks registered before _on_grad_ready's: it sees the sum
                attach_main_grads(run, [b.view(b.grad, i) for i in range(len(run))])
            buckets.append(b)
        return buckets

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (all but the last micro-batch)."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        # autograd's hook fires even for a gradient a zero-bubble schedule deferred (its backward
        # returned None): that one is final only when the W action calls grad_ready itself
        if self.sync_enabled and not getattr(p, "grad_deferred", False):
            self.grad_ready(p)

    def grad_ready(self, p: nn.Parameter) -> None:
        """`p`'s gradient for this step is final: with overlap_grad_reduce, its bucket's
        reduction starts once every gradient in the bucket is. Called by autograd's hook on the
        last micro-batch, and by whoever adds into a gradient outside autograd (the deferred
        weight gradients of zero-bubble pipeline schedules)."""
        if not self.overlap_grad or p is self.tied:
            return
        bucket, i = self.bucket_of[id(p)]
        if bucket.reduce_handle is not None:  # a second backward into a bucket already sent
            raise RuntimeError(
                f"gradient of {self.names[p]} accumulated after its bucket's reduction was "
                "launched: with overlap_grad_reduce, run all but a step's last micro-batch under "
                "no_sync() (or iterate them through DistributedDataParallel.accumulate()), and "
                "call finish_grad_sync() (optimizer.step()) before the next backward"
            )
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params) and bucket.reduce_handle is None:
            self._launch_reduce(bucket)

    def _launch_reduce(self, b: Bucket) -> None:
        sp = [
            b.view(b.grad, i)
            for i, p in enumerate(b.params)
            if getattr(p, "sequence_parallel", False)
        ]
        if sp and self.mesh.tp > 1:  # norms/biases saw only their seq shard: sum over tp first
            flat = M.all_reduce(torch.cat([g.flatten() for g in sp]), self.tp_group)
            off = 0
            for g in sp:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
        if b.shards == 1:  # nothing to exchange (expert buckets with ep = dp x cp): only the mean
            if self.mean_over != 1:
                b.grad.div_(self.mean_over)
            b.reduce_handle = True
            return
        send, recv = b.grad, (b.slice_grad if self.dist_opt else b.grad)
        if (
            self.reduce_dtype != b.grad.dtype
        ):  # a copy in the wire's dtype, alive until finish_grad_sync
            send = torch.empty(b.numel, dtype=self.reduce_dtype, device=b.grad.device)
            if self.dist_opt:
                send.copy_(b.grad)
                recv = torch.empty(recv.numel(), dtype=self.reduce_dtype, device=recv.device)
            else:  # plain DP: the mean's division, in fp32, and the rounding in one pass
                torch.div(b.grad, self.mean_over, out=send)
                recv = send
            b.wire = (send, recv)
        elif not self.dist_opt:
            b.grad.div_(self.mean_over)
        if self.dist_opt:  # each rank receives the sum of its 1/dp slice (NCCL and gloo alike)
            b.reduce_handle = M.reduce_scatter_into(recv, send, b.group, async_op=True)
        else:
            b.reduce_handle = dist.all_reduce(send, group=b.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduction (launching those not yet launched)."""
        if self.tied is not None:  # first and last stage: the sum of both uses of the embedding
            M.all_reduce(_applied_grad(self.tied), self.mesh.group("pp_ends"))  # in place: a view
        for b in self.buckets:
            if b.reduce_handle is None:
                self._launch_reduce(b)
        for b in self.buckets:
            if b.reduce_handle is not True:
                assert b.reduce_handle is not None  # every bucket was launched above
                b.reduce_handle.wait()
            if b.wire is not None:  # back from the wire's dtype into the fp32 buffers
                (b.slice_grad if self.dist_opt else b.grad).copy_(b.wire[1])
                b.wire = None
            if (
                self.dist_opt and b.shards == 1
            ):  # nothing was reduce-scattered: the slice is the whole
                b.slice_grad.copy_(b.grad)
            elif (
                self.dist_opt
            ):  # the mean over dp, taken on this rank's slice only (1/(dp·cp) of the bytes)
                b.slice_grad.div_(self.mean_over)
            b.reduce_handle = None
            b.ready.clear()

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()
            if b.local_grad is not None:
                b.local_grad.zero_()

    # ---------------------------------------------------------------- ZeRO-1
    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over this rank's slices ("pieces") of every bucket, grouped by weight decay
        (with optim.optimizer_cpu_offload each rank offloads its own slices)."""
        self.pieces: list[
            tuple[nn.Parameter, nn.Parameter, int, int]
        ] = []  # (piece, param, lo, hi) flat coords
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        flat_range = []  # (bucket, lo, hi) of each piece
        for b in self.buckets:
            n = b.numel // b.shards
            lo_r, hi_r = b.shard_rank * n, (b.shard_rank + 1) * n
            for i, p in enumerate(b.params):
                lo, hi = max(lo_r, b.offsets[i]), min(hi_r, b.offsets[i] + p.numel())
                if lo >= hi:
                    continue
                piece = nn.Parameter(b.flat_params[lo:hi])  # shares storage with the parameter
                grad = b.slice_grad[lo - lo_r : hi - lo_r]
                if self.bf16_params:  # the offloaded AdamW reads the fp32 slice (main_grads.py)
                    piece.main_grad = grad  # type: ignore[attr-defined]
                else:
                    piece.grad = grad
                self.pieces.append((piece, p, lo - b.offsets[i], hi - b.offsets[i]))
                flat_range.append((b, lo, hi))
                (decay if is_decayed(self.names[p], p, self.optim_config) else no_decay).append(
                    piece
                )
        optimizer = adamw([decay, no_decay], self.optim_config, self.bf16_params)
        if self.bf16_params:  # the masters are read: the flat buffers become bf16
            with torch.no_grad():
                for b in self.buckets:
                    assert b.param_flat is not None
                    b.param_flat = b.param_flat.to(torch.bfloat16)
                    for i, p in enumerate(b.params):
                        p.data = b.view(b.param_flat, i)
                for (piece, _, _, _), (b, lo, hi) in zip(self.pieces, flat_range, strict=True):
                    piece.data = b.flat_params[lo:hi]
        return optimizer

    def gather_params(self) -> None:
        """After the optimizer step: all-gather every bucket's updated slices into full parameters.

        Issued in forward order (the buckets are in backward order): collectives on one group
        complete in the order they were issued, so the first unit of the next forward waits
        only for its own buckets while the rest are still in flight. In place: this rank's slice
        of the flat parameters is the input, at its own offset in the output (as NCCL and gloo
        allow), so no copy of it is made.
        """
        if not self.dist_opt:
            return
        for b in reversed(self.buckets):
            if b.shards == 1:
                continue
            b.gather_handle = M.gather_into(
                b.flat_params, b.slice_of(b.flat_params), b.group, async_op=self.overlap_param
            )
        if not self.overlap_param:
            for b in self.buckets:
                b.gather_handle = None

    def wait_param_gather(self, buckets: list[Bucket] | None = None) -> None:
        for b in buckets if buckets is not None else self.buckets:
            if b.gather_handle is not None:
                b.gather_handle.wait()
                b.gather_handle = None

    def _install_gather_waits(self, units: list[tuple[nn.Module, list[nn.Parameter]]]) -> None:
        """Wait for a bucket's all-gather only when a unit about to run needs its parameters."""
        for module, params in units:
            own = [p for p in params if id(p) in self.bucket_of]
            if own:
                needed = list(
                    {id(self.bucket_of[id(p)][0]): self.bucket_of[id(p)][0] for p in own}.values()
                )
                module.register_forward_pre_hook(
                    lambda _m, _a, bs=needed: self.wait_param_gather(bs)
                )

    # ---------------------------------------------------------------- norms
    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradients the optimizer will apply; clips them if max_norm > 0."""
        # (gradient the optimizer applies, its parameter): a slice of it under ZeRO-1
        grads = (
            [(_applied_grad(piece), p) for piece, p, _, _ in self.pieces]
            if self.dist_opt
            else [(_applied_grad(p), p) for b in self.buckets for p in b.params]
        )
        # the last pipeline stage's copy of a tied embedding is counted once, on the first stage
        items = [
            (g, tp_split_of(p) is not None, self._is_expert(p))
            for g, p in grads
            if not getattr(p, "pipeline_copy", False)
        ]
        device = self.buckets[0].grad.device
        # [tp-sharded, tp-replicated] x [dense, expert] sums of squares; one multi-tensor norm per
        # kind (a few kernels, not a few per parameter: the step's tail is host-bound enough).
        sq = torch.stack(
            [
                torch.stack(torch._foreach_norm(gs)).square().sum()
                if gs
                else torch.zeros((), device=device)
                for gs in (
                    [g for g, sh, ex in items if sh == sharded and ex == expert]
                    for expert in (False, True)
                    for sharded in (True, False)
                )
            ]
        )
        if (
            self.dist_opt
        ):  # ZeRO-1 slices: dense ones over dp x cp, expert ones over edp and each ep rank's
            M.all_reduce(
                sq, self.dp_group
            )  # own experts: the dp x cp group covers both exactly once
        elif self.mesh.ep > 1:  # whole gradients, replicated over edp: each ep rank's experts once
            sq[2:] = M.all_reduce(sq[2:].clone(), self.mesh.group("ep"))
        total = M.all_reduce((sq[0] + sq[2]).view(1), self.tp_group)[0] + sq[1] + sq[3]
        if self.mesh.pp > 1:  # every stage's share (the last stage's embedding copy left out above)
            total = M.all_reduce(total, self.mesh.group("pp"))
        norm = total.sqrt()
        if max_norm > 0:
            coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([g for g, _ in grads], coeff)
        return norm

    # ---------------------------------------------------------------- checkpoint support
    @property
    def _zero1_optimizer(self) -> torch.optim.Optimizer:
        assert self.optimizer is not None  # the distributed optimizer's, over this rank's slices
        return self.optimizer

    @property
    def _offloaded(self) -> OffloadedAdamW:
        """With bf16 parameters: the offloaded AdamW holding the fp32 masters."""
        assert isinstance(self.optimizer, OffloadedAdamW)  # bf16 parameters need it
        return self.optimizer

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter Adam moments, whole (gathered over dp; expert weights over edp: this
        rank's experts), keyed by parameter name."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        by_param: dict[int, list[tuple[nn.Parameter, int, int]]] = {
            id(p): [] for b in self.buckets for p in b.params
        }
        for piece, p, lo, hi in self.pieces:
            by_param[id(p)].append((piece, lo, hi))
        for b in self.buckets:
            n = b.numel // b.shards
            lo_r = b.shard_rank * n
            for key in ("exp_avg", "exp_avg_sq"):
                local = torch.zeros(n, dtype=torch.float32, device=b.grad.device)
                for i, p in enumerate(b.params):
                    for piece, lo, hi in by_param[id(p)]:
                        st = self._zero1_optimizer.state.get(piece)
                        if st:
                            start = b.offsets[i] + lo - lo_r
                            local[start : start + (hi - lo)] = st[key]
                full = M.all_gather(local, 0, b.group)
                for i, p in enumerate(b.params):
                    out.setdefault(self.names[p], {})[key] = b.view(full, i).clone()
        return out

    def full_master_params(self) -> dict[str, torch.Tensor]:
        """With bf16 parameters under ZeRO-1: the fp32 master weights, whole (gathered over dp
        as the moments are; expert weights over edp), keyed by parameter name."""
        masters = self._offloaded.master_of
        by_param: dict[int, list[tuple[nn.Parameter, int, int]]] = {
            id(p): [] for b in self.buckets for p in b.params
        }
        for piece, p, lo, hi in self.pieces:
            by_param[id(p)].append((piece, lo, hi))
        out: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            n = b.numel // b.shards
            lo_r = b.shard_rank * n
            local = torch.zeros(n, dtype=torch.float32, device=b.grad.device)
            for i, p in enumerate(b.params):
                for piece, lo, hi in by_param[id(p)]:
                    start = b.offsets[i] + lo - lo_r
                    local[start : start + (hi - lo)] = masters[piece].detach().flatten()
            full = M.all_gather(local, 0, b.group)
            for i, p in enumerate(b.params):
                out[self.names[p]] = b.view(full, i).clone()
        return out

    def load_master_params(self, weights: dict[str, torch.Tensor]) -> None:
        """With bf16 parameters under ZeRO-1: whole fp32 weights by name into this rank's
        masters, and their bf16 roundings into the parameters (the inverse of the above)."""
        with torch.no_grad():
            for b in self.buckets:
                for p in b.params:
                    if self.names[p] in weights:  # a fresh head keeps its own
                        p.copy_(weights[self.names[p]])
            for piece, p, lo, hi in self.pieces:
                if self.names[p] in weights:
                    self._offloaded.load_master(piece, weights[self.names[p]].flatten()[lo:hi])

    def load_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Fill this rank's slices from whole per-parameter moments (the inverse of the above)."""
        for piece, p, lo, hi in self.pieces:
            st = state[self.names[p]]
            self._zero1_optimizer.state[piece] = {
                "step": torch.tensor(float(step), device=piece.device if piece.is_cuda else "cpu"),
                "exp_avg": st["exp_avg"].flatten()[lo:hi].to(piece.device).clone(),
                "exp_avg_sq": st["exp_avg_sq"].flatten()[lo:hi].to(piece.device).clone(),
            }

    def optimizer_step_count(self) -> int:
        steps = (
            {int(st["step"]) for st in self.optimizer.state.values()} if self.optimizer else set()
        )
        return steps.pop() if steps else 0
