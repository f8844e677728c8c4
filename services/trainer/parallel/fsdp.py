"""Fully sharded data parallelism (ZeRO-2/3) on torch's FSDP2, with the `DataParallel` interface.

`FullyShardedDataParallel` applies `torch.distributed.fsdp.fully_shard` to every transformer
block and then to the GPT (the root: embedding, final norm, output layer), over the mesh's
"dp_shard" dim (hybrid sharding: "dp_replicate" x "dp_shard"). Each parameter becomes a DTensor
split along its dim 0 over dp_shard (`torch.chunk` rows: ceil(n / dp_shard) per rank, the last
ones shorter or empty), of the tensor-parallel rank's own shard: tensor parallelism stays
meshtrain's (`parallel/tensor.py`), FSDP2 sees its local shards as plain tensors. In the forward
each block's parameters are all-gathered just before it runs, the next block's gather issued at
the same time (prefetch); in the backward the previous block's gather is prefetched and each
block's gradients are reduce-scattered (averaged over dp) as soon as they are final, on FSDP2's
own streams. ZeRO-3 (`reshard_after_forward`) frees the gathered parameters after the forward
and gathers them again for the backward; ZeRO-2 keeps them until the backward is done. AdamW
runs on the shards (its moments are DTensors of the same split), so parameters, gradients and
optimizer state each take 1/dp_shard of the bytes per rank (`state_bytes` counts them).

Context parallelism: the cp ranks hold the same parameters, so the model is split over dp_shard
and cp together (`Mesh.shard_device_mesh`'s flattened "dp_shard_cp" dim, as torchtitan). A cp
rank's gradient is its share of each sample's (`ContextParallel.loss_share`), so the
reduce-scatter sums over cp and divides by dp only (FSDP2's gradient divide factor).

Mixtures of experts: with ep > 1 each MoE block's experts (this ep rank's) are a unit of their
own inside the block's, split over the ranks holding the same experts ("edp" of
`Mesh.expert_device_mesh`); their gradients are summed over edp and divided by dp, as
`DataParallel` does (an ep rank's expert gradient already sums its ep group's tokens). The
routers' expert biases, moved by their own rule after each step, stay whole (ignored by FSDP2).

Sequence-parallel parameters (norms, row-parallel biases) saw only their sequence shard: their
sharded gradients are summed over tp after the reduce-scatter (the two sums commute). The
gradient norm sums squares of the local shards over dp_shard x cp (expert shards over dp x cp:
edp x ep holds each expert's rows once) and, for tensor-parallel shards, tp. Checkpoints map
each DTensor shard to boxes of the global array (`checkpoint_boxes.py`), so no rank ever holds
the whole model.

Under pipeline parallelism the model is this rank's `PipelineStage`: its blocks and then the
stage (embedding, final norm, output layer, whichever it holds) are sharded over the dp_shard
ranks of this stage (the device mesh's dp_shard dim at this rank's pp coordinate), as
torchtitan shards each stage. The runtime's `sync_enabled` turns FSDP2's gradient sync off for
every backward but a chunk's last of the step: earlier micro-batches accumulate unsharded
gradients, reduce-scattered once. Tied embeddings: the first stage's shard and the last
stage's copy (the same rows of the same global tensor) have their gradients summed over
"pp_ends"; the gradient norm adds every stage's share over pp, the copy left out. Under
train.compile the trainer compiles each block in place (`build.compile_model`): FSDP2's hooks,
which dynamo does not trace, run between the compiled blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.model.moe import moe_layers
from meshtrain.services.trainer.optim.optimizer import build_optimizer
from meshtrain.services.trainer.parallel import mappings as M
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor_layers import tp_split_of


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


class FullyShardedDataParallel:
    """A GPT fully sharded over the mesh's dp_shard x cp ranks (replicated over dp_replicate).

    Drives the same calls as `DataParallel` (`no_sync`, `finish_grad_sync`,
    `grad_norm_and_clip`, `optimizer`, `gather_params`, `zero_grad`), so the loop does not change.

    Args:
        model: the (tensor-parallel) GPT, fp32; sharded in place.
        mesh: the layout; its device mesh's dp dims shard the model.
        optim: AdamW settings (the optimizer runs on the shards).
        reshard_after_forward: ZeRO-3 (True) or ZeRO-2 (False).
        reduce_dtype: what the reduce-scatter sends (fp32, or bf16: half the bytes).
        tied_weight: under pipeline parallelism, after sharding: the word embedding this
            rank shares with the other end of the pipeline (`Pipeline.tied_weight`), or None.

    Raises:
        ConfigError: a layout it does not compose with (deferred weight gradients, optimizer
            offload), or a parameter that is not fp32.
    """

    dist_opt = False  # the ZeRO-1 buffers' checkpoint path is DataParallel's own

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        optim: OptimConfig,
        *,
        reshard_after_forward: bool = True,
        reduce_dtype: torch.dtype = torch.float32,
        tied_weight: Callable[[], nn.Parameter | None] | None = None,
    ):
        _check_composes(model, optim)
        self.model, self.mesh = model, mesh
        self._sync = True
        # Split over dp_shard x cp: the cp ranks hold the same parameters, so they take a share
        # of the rows each (torchtitan's dp_shard_cp), and the reduce-scatter sums their shares
        # of each sample's gradient.
        shard_mesh = mesh.shard_device_mesh
        assert shard_mesh is not None  # Mesh.build makes it whenever there are ranks
        dims = ("dp_replicate", "dp_shard_cp") if mesh.dp_replicate > 1 else ("dp_shard_cp",)
        self.shard_mesh = shard_mesh[dims]
        # The gradient norm's sums: each gradient shard lives on one dp_shard x cp rank (and is
        # repeated over dp_replicate).
        self.shard_group = mesh.group("dp_shard_cp")
        marks = _parameter_marks(model)
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        self.expert_units = self._shard_experts(policy, reshard_after_forward)
        chunks = self._shard_blocks(policy, reshard_after_forward)
        _set_prefetch(chunks)
        self._set_gradient_division()
        _restore_marks(model, marks)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.experts = {
            id(p)
            for unit in self.expert_units
            for p in unit.parameters()  # type: ignore[attr-defined]
            if p.requires_grad
        }
        # the shared word embedding, when both ends of the pipeline hold it
        self.tied = (
            tied_weight() if tied_weight is not None and mesh.group("pp_ends") is not None else None
        )
        self.sequence_parallel = [
            p for p in self.params if getattr(p, "sequence_parallel", False) and mesh.tp > 1
        ]
        self.optimizer = build_optimizer(model, optim)

    def _shard_experts(
        self, policy: MixedPrecisionPolicy, reshard_after_forward: bool
    ) -> list[FSDPModule]:
        """Expert parallelism: a block's experts (this ep rank's) are a unit of their own, split
        over the ranks holding the same experts (edp), inside the block's unit (none without
        expert parallelism)."""
        if self.mesh.ep <= 1:
            return []
        expert_mesh = self.mesh.expert_device_mesh
        assert expert_mesh is not None  # Mesh.build makes it with ep > 1
        return [
            fully_shard(
                moe.experts,
                mesh=expert_mesh["edp"],
                reshard_after_forward=reshard_after_forward,
                mp_policy=policy,
            )
            for _, moe in moe_layers(self.model)
        ]

    def _shard_blocks(
        self, policy: MixedPrecisionPolicy, reshard_after_forward: bool
    ) -> list[list[FSDPModule]]:
        """Every transformer block a unit over the shard mesh, then the root; the blocks of each
        model chunk in forward order."""
        # The routers' expert biases move by their own rule after each step, the same on every
        # rank (`MoE.update_expert_bias`): left whole and out of FSDP2's hands.
        ignored = {
            m.router.expert_bias
            for _, m in moe_layers(self.model)
            if m.router.expert_bias is not None
        }
        chunks = [
            [
                fully_shard(
                    block,
                    mesh=self.shard_mesh,
                    reshard_after_forward=reshard_after_forward,
                    mp_policy=policy,
                    ignored_params=ignored,
                )
                for block in chunk
            ]
            for chunk in self._chunks(self.model)
        ]
        # The root keeps its parameters (embedding, final norm, output layer) gathered from the
        # end of the forward to the backward, which starts with them.
        fully_shard(
            self.model,
            mesh=self.shard_mesh,
            reshard_after_forward=False,
            mp_policy=policy,
            ignored_params=ignored,
        )
        return chunks

    def _set_gradient_division(self) -> None:
        """FSDP2 divides by every rank it reduces over: dp_shard x cp x dp_replicate for the
        dense units, edp = dp x cp / ep for the experts'. The mean is over dp only (as
        `DataParallel.mean_over`): cp ranks' gradients are shares of one sample's, and an ep
        rank's expert gradient already sums its ep group's tokens (the all-to-all's backward)."""
        mesh = self.mesh
        # Sums on the wire and one division after (gloo has no pre-multiplied sum), except over
        # a group of one (ep = dp x cp), which FSDP2 does not reduce but divides itself; the
        # forced sum would divide a second time.
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in units if mesh.cp > 1 else self.expert_units:
            m.set_gradient_divide_factor(float(mesh.dp))
            alone = m in self.expert_units and mesh.size("edp") == 1
            m.set_force_sum_reduction_for_comms(not alone)

    @staticmethod
    def _chunks(model: nn.Module) -> list[list[nn.Module]]:
        """The transformer blocks of each model chunk, in forward order: one chunk of a GPT, or
        a pipeline stage's (its blocks kept by global number, its chunks' ranges in
        `chunk_layers`)."""
        layers = model.layers
        if isinstance(layers, nn.ModuleDict):
            ranges: list[range] = model.chunk_layers  # type: ignore[assignment]
            return [[layers[str(i)] for i in r] for r in ranges]
        assert isinstance(layers, nn.ModuleList)
        return [list(layers)]

    @property
    def root(self) -> FSDPModule:
        return self.model  # type: ignore[return-value]

    @property
    def sync_enabled(self) -> bool:
        """Whether the next backward reduce-scatters the gradients (the pipeline runtime sets it
        per backward action: on for a chunk's last of the step)."""
        return self._sync

    @sync_enabled.setter
    def sync_enabled(self, value: bool) -> None:
        self._sync = value
        self.root.set_requires_gradient_sync(value)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reduce-scattering them (all but the last micro-batch)."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True

    def finish_grad_sync(self) -> None:
        """After the last backward: FSDP2 has reduce-scattered every gradient; the shards of the
        sequence-parallel parameters are summed over tp, those of a tied embedding over the
        pipeline's ends."""
        if self.tied is not None and self.tied.grad is not None:
            g = local(self.tied.grad)
            g.copy_(M.all_reduce(g, self.mesh.group("pp_ends")))
        grads = [local(p.grad) for p in self.sequence_parallel if p.grad is not None]
        if grads:
            flat = M.all_reduce(torch.cat([g.flatten() for g in grads]), self.mesh.group("tp"))
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()

    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the gradients (shards summed over dp_shard x cp, expert shards over
        dp x cp (edp x ep: each expert's rows once), tensor-parallel shards over tp, replicated
        tensors counted once); clips them if max_norm > 0."""
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        # the last stage's copy of a tied embedding is counted once, on the first stage
        items = [
            (local(p.grad), tp_split_of(p) is not None, id(p) in self.experts)
            for p in self.params
            if p.grad is not None and not getattr(p, "pipeline_copy", False)
        ]
        device = grads[0].device
        # [tp-sharded, tp-replicated] x [dense, expert] sums of squares
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
        dense = M.all_reduce(sq[:2].clone(), self.shard_group)
        experts = M.all_reduce(sq[2:].clone(), self.mesh.group("dp_cp")) if self.experts else sq[2:]
        tp_sharded = M.all_reduce((dense[0] + experts[0]).view(1), self.mesh.group("tp"))[0]
        total = tp_sharded + dense[1] + experts[1]
        if self.mesh.pp > 1:  # every stage's share
            total = M.all_reduce(total, self.mesh.group("pp"))
        norm = total.sqrt()
        if max_norm > 0:
            coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coeff)
        return norm

    def gather_params(self) -> None:
        """Nothing to do after the step: the next forward gathers each block as it needs it."""

    def wait_param_gather(self) -> None:
        """Before a save or the run's end: every parameter back to its shard. (A forward without
        backward, as evaluation's, leaves the root's parameters gathered, and the model would
        name the gathered tensors as its parameters instead of the optimizer's shards.)"""
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of parameters, gradients and optimizer state (`state_bytes`)."""
        return state_bytes(self.model, self.optimizer)


def _check_composes(model: nn.Module, optim: OptimConfig) -> None:
    """Refuse what fully sharded data parallelism does not compose with (optimizer offload,
    deferred weight gradients) and parameters that are not fp32."""
    if optim.optimizer_cpu_offload:
        raise ConfigError(
            "fully sharded data parallelism does not compose with optim.optimizer_cpu_offload "
            "yet; use parallel.use_distributed_optimizer (ZeRO-1), whose slices are offloaded"
        )
    deferred = [n for n, p in model.named_parameters() if getattr(p, "grad_deferred", False)]
    if deferred:
        # FSDP2 reduce-scatters a block's gradients at the end of its backward; a W action
        # would add the deferred weight gradients after that, to gathered tensors then freed
        raise ConfigError(
            "fully sharded data parallelism does not compose with "
            "parallel.pipeline_schedule='zb-h1' (deferred weight gradients, e.g. "
            f"{deferred[0]}); use '1f1b', 'gpipe' or 'interleaved'"
        )
    odd = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if odd:
        raise ConfigError(
            "fully sharded data parallelism keeps fp32 parameters (bf16 comes from autocast: "
            f"train.bf16); {odd[0]} is not fp32"
        )


def _parameter_marks(model: nn.Module) -> dict[str, dict[str, object]]:
    """Each parameter's public attributes (tp_split, sequence_parallel, ...), by name: the
    DTensor parameters `fully_shard` puts in their place take them over (`_restore_marks`)."""
    return {
        n: {k: v for k, v in vars(p).items() if not k.startswith("_")}
        for n, p in model.named_parameters()
    }


def _restore_marks(model: nn.Module, marks: dict[str, dict[str, object]]) -> None:
    for n, p in model.named_parameters():
        for key, value in marks[n].items():
            setattr(p, key, value)


def _set_prefetch(chunks: list[list[FSDPModule]]) -> None:
    """Explicit prefetch: the next block in each direction, within a model chunk (what runs
    after a chunk's last block is up to the pipeline schedule)."""
    for blocks in chunks:
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the parameters, gradients and optimizer state of `model` (its
    local shards when fully sharded), each storage counted once (FSDP2's shard of a parameter is
    a view into a buffer padded to whole rows per rank; the padding counts)."""
    seen: set[int] = set()

    def size(ts) -> int:
        n = 0
        for t in ts:
            if not isinstance(t, torch.Tensor):
                continue
            s = local(t).untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                n += s.nbytes()
        return n

    return {
        "parameters": size(model.parameters()),
        "gradients": size(p.grad for p in model.parameters()),
        "optimizer": size(
            t for st in optimizer.state.values() for k, t in st.items() if k != "step"
        ),
    }
