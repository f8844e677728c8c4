"""What a training checkpoint holds of the trainer's state, as boxes and metadata to save.

Every rank saves only its own part of the layout-independent format
(`meshtrain.services.checkpoint`): each parameter is a box of a global array (per-layer tensors
stacked on a leading global-layer axis when every layer 0..n-1 holds them, else one array per layer,
as the experts of MoE blocks between dense ones; tensor-parallel shards at their global offsets,
SwiGLU's fc1 as two boxes, one per half; padded vocabulary rows cut off; an expert-parallel rank's
experts at their global expert ids), written by the dp-rank-0 replica only (experts: by each ep
rank's replica of edp rank 0), so nothing is written twice. AdamW moments are stored per parameter
(`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`), whole even under the distributed optimizer;
frozen parameters (the router's expert bias) have none; bf16 device parameters are stored as their
fp32 masters. Scalars (iteration, consumed samples, optimizer step, config, layout, RNG of
Python/NumPy) are manifest metadata; the torch RNG states are boxes. This module also owns the
counters a checkpoint restores (`TrainState`) and the layout checkpointing sees (`Parallel`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate

from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.common.config import to_dict
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.trainer.checkpoint_boxes import (
    is_expert,
    layer_stacks,
    local_pieces,
    save_place,
)
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.optim.offload import OffloadedAdamW
from meshtrain.services.trainer.parallel.data_parallel import DataParallel
from meshtrain.services.trainer.parallel.fsdp import FullyShardedDataParallel
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.pipeline.stage import PipelineStage

FORMAT = "meshtrain-train/1"

TrainedModel = GPT | PipelineStage
"""What a checkpoint holds the parameters of: a GPT, or this rank's pipeline stage of one."""


@dataclass
class TrainState:
    """Counters a checkpoint restores besides tensors."""

    iteration: int = 0
    consumed_samples: int = 0


@dataclass
class Parallel:
    """What checkpointing needs to know about the layout: the mesh and the DP wrapper."""

    mesh: Mesh
    ddp: DataParallel | FullyShardedDataParallel | None = None

    @property
    def distributed_optimizer(self) -> DataParallel | None:
        """The DP wrapper whose distributed optimizer (ZeRO-1) holds the optimizer state as flat
        buffers, or None (fully sharded parallelism keeps it in the torch optimizer)."""
        return self.ddp if isinstance(self.ddp, DataParallel) and self.ddp.dist_opt else None


def optimizer_moments(
    model: TrainedModel, optimizer: torch.optim.Optimizer | None, par: Parallel
) -> dict[str, dict[str, torch.Tensor]]:
    zero1 = par.distributed_optimizer
    if zero1 is not None:
        return zero1.full_optimizer_state()  # collective over dp
    if optimizer is None:
        return {}
    names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
    return {
        names[p]: {k: st[k] for k in ("exp_avg", "exp_avg_sq")} for p, st in optimizer.state.items()
    }


def master_weights(
    model: TrainedModel, optimizer: torch.optim.Optimizer | None, par: Parallel
) -> dict[str, torch.Tensor]:
    """The fp32 master weights of bf16 device parameters (optim.offload_bf16_params), by name:
    what a checkpoint stores for them (collective over dp under ZeRO-1). Else nothing."""
    zero1 = par.distributed_optimizer
    if zero1 is not None and zero1.bf16_params:
        return zero1.full_master_params()
    if isinstance(optimizer, OffloadedAdamW) and optimizer.bf16_params:
        names = {p: n for n, p in model.named_parameters()}
        return {names[p]: m.detach() for p, m in optimizer.master_of.items()}
    return {}


def master_loader(
    model: TrainedModel, optimizer: torch.optim.Optimizer | None, par: Parallel
) -> Callable[[dict[str, torch.Tensor]], None] | None:
    """What writes fp32 weights into the masters of bf16 device parameters (and their
    roundings into the parameters), or None where the parameters are the weights."""
    zero1 = par.distributed_optimizer
    if zero1 is not None and zero1.bf16_params:
        return zero1.load_master_params
    if isinstance(optimizer, OffloadedAdamW) and optimizer.bf16_params:
        names = {p: n for n, p in model.named_parameters()}

        def load(weights: dict[str, torch.Tensor]) -> None:
            for p in optimizer.master_of:
                if names[p] in weights:  # a fresh head (`fresh_score`) keeps its own
                    optimizer.load_master(p, weights[names[p]])

        return load
    return None


def optimizer_step(optimizer: torch.optim.Optimizer | None, par: Parallel) -> int:
    zero1 = par.distributed_optimizer
    if zero1 is not None:
        return zero1.optimizer_step_count()
    if optimizer is None:
        return 0
    steps = {int(st["step"]) for st in optimizer.state.values()} or {0}
    if len(steps) != 1:
        raise CheckpointError(f"optimizer parameters disagree on their step count: {sorted(steps)}")
    return steps.pop()


def tensor_boxes(
    model: TrainedModel,
    par: Parallel,
    moments: dict[str, dict[str, torch.Tensor]],
    masters: dict[str, torch.Tensor] | None = None,
) -> list[tuple[ShardSpec, torch.Tensor]]:
    """(box, tensor) of every parameter and moment this rank writes; a parameter with a
    fp32 master (`master_weights`: bf16 device parameters) is written as its master."""
    masters = masters or {}
    mesh, v = par.mesh, model.vocab_size
    params = dict(model.named_parameters())
    names = params if mesh.pp == 1 else model_parameter_names(model.config)
    stacks = layer_stacks(names)
    # Moments exist for trained parameters only: a family some of whose layers are frozen (a
    # vision encoder's blocks past model.vision.select_layer) stacks its moments only where
    # every layer has them. (Frozen parameters are those this rank holds: a part frozen as a
    # whole has no moments at all, and the encoder sits on one pipeline stage.)
    moment_stacks = layer_stacks(n for n in names if n not in params or params[n].requires_grad)
    boxes: list[tuple[ShardSpec, torch.Tensor]] = []
    # dp and cp replicas hold the same values: one writes. Experts are split over the ep
    # ranks of a dp x cp group: each ep rank's replica in the first such group (edp rank 0)
    # writes its own. (The last pipeline stage's copy of a tied embedding is the first
    # stage's, written there.)
    # Fully sharded (DTensor) parameters: each rank of the first replica writes its own rows
    # (the ranks it is split over include cp's, and for experts edp's).
    first_replica = mesh.dp_rank == 0 and mesh.cp_rank == 0
    own = {
        n: p
        for n, p in params.items()
        if not getattr(p, "pipeline_copy", False)
        and (
            _first_copy(p)
            if isinstance(p, DTensor)
            else (mesh.edp_rank == 0 if is_expert(p) else first_replica)
        )
    }
    tensors = [(n, masters[n] if n in masters else p.detach(), p) for n, p in own.items()]
    tensors += [
        (f"optim.{k}.{n}", t, own[n]) for n, m in moments.items() if n in own for k, t in m.items()
    ]
    for name, t, param in tensors:
        place = save_place(name, moment_stacks if name.startswith("optim.") else stacks)
        local, pcs = local_pieces(name, t, param, mesh, v, place)
        for piece in pcs:
            boxes.append((piece.spec, local[piece.local].reshape(piece.spec.shape)))
    return boxes


def _first_copy(t: DTensor) -> bool:
    """Whether this rank holds the first copy of its rows of fully sharded `t`: index 0 along
    every dim of its device mesh that replicates it (hybrid sharding's dp_replicate)."""
    return all(
        t.device_mesh.get_local_rank(d) == 0
        for d, p in enumerate(t.placements)
        if isinstance(p, Replicate)
    )


def rng_boxes(mesh: Mesh) -> list[tuple[ShardSpec, torch.Tensor]]:
    """The RNG states this rank saves: the torch generators' on global rank 0, and with pp > 1
    each stage's own (written by the stage's first tp/dp/cp rank)."""
    boxes = []
    if mesh.rank == 0:
        rng = torch.get_rng_state()
        boxes.append(
            (ShardSpec("rng.torch_cpu", tuple(rng.shape), "uint8", (0,), tuple(rng.shape)), rng)
        )
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # This rank's own device: every rank seeds and advances its device's generator
            # alike, so one state restores them all (other visible devices are never used).
            cuda = torch.cuda.get_rng_state().unsqueeze(0)
            boxes.append(
                (
                    ShardSpec(
                        "rng.torch_cuda", tuple(cuda.shape), "uint8", (0, 0), tuple(cuda.shape)
                    ),
                    cuda,
                )
            )
    if mesh.pp > 1 and mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0:
        # Pipeline stages draw dropout from their generators in different amounts: each
        # stage's own states, one row per stage, so a resume at the same pp is exact.
        r = mesh.pp_rank
        for array, gen in rng_states().items():
            boxes.append(
                (
                    ShardSpec(
                        f"{array}_by_stage",
                        (mesh.pp, *gen.shape),
                        "uint8",
                        (r, *[0] * gen.dim()),
                        (1, *gen.shape),
                    ),
                    gen.unsqueeze(0),
                )
            )
    return boxes


def checkpoint_metadata(state: TrainState, optimizer_step: int, job: JobConfig, mesh: Mesh) -> dict:
    """A checkpoint's scalars: its step and data position, the config, the layout that wrote it
    and the Python and NumPy RNG states."""
    np_state = np.random.get_state(legacy=True)
    if not isinstance(np_state, tuple):  # the legacy tuple is MT19937's, np.random's generator
        raise CheckpointError(
            f"NumPy's global generator is {np_state.get('bit_generator')!r}, not MT19937: its "
            "state cannot be saved"
        )
    return {
        "format": FORMAT,
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "optimizer_step": optimizer_step,
        "config": to_dict(job),
        "layout": {
            "tp": mesh.tp,
            "cp": mesh.cp,
            "dp": mesh.dp,
            "pp": mesh.pp,
            "ep": mesh.ep,
            "world_size": mesh.world_size,
        },
        "rng_python": random.getstate(),
        "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def rng_states() -> dict[str, torch.Tensor]:
    """This process's torch generator states by array name (CUDA: this rank's device, once used)."""
    states = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["rng.torch_cuda"] = torch.cuda.get_rng_state()
    return states


def model_parameter_names(config) -> set[str]:
    """Every parameter name of the whole GPT of `config` (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {n for n, _ in GPT(config).named_parameters()}
