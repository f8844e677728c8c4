"""The trainer's state <-> checkpoint tensors: model, optimizer, RNG and data position.

Everything goes into the layout-independent format (`services.checkpoint`): parameters by
canonical name in global coordinates (tensor-parallel shards gathered, padded vocabulary rows
cut off), AdamW moments per parameter (`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`,
whole even under the distributed optimizer), RNG states as byte tensors, and the scalars
(iteration, consumed samples, optimizer step, config) as manifest metadata. Loading slices
each rank's part out of the global tensors, so any tp/dp layout loads any checkpoint, and a
resumed run continues with identical losses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from services.checkpoint.reader import load_checkpoint
from services.checkpoint.writer import save_checkpoint
from services.common.config import to_dict
from services.common.errors import CheckpointError
from services.trainer.config import JobConfig
from services.trainer.model.gpt import GPT
from services.trainer.parallel import mappings as M
from services.trainer.parallel.data import DataParallel
from services.trainer.parallel.mesh import Mesh
from services.trainer.parallel.tensor import tp_split_of

FORMAT = "meshtrain-train/1"
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass
class TrainState:
    """Counters a checkpoint restores besides tensors."""

    iteration: int = 0
    consumed_samples: int = 0


@dataclass
class Parallel:
    """What checkpointing needs to know about the layout: the mesh and the DP wrapper."""

    mesh: Mesh
    ddp: DataParallel | None = None


def _global(name: str, local: torch.Tensor, param: torch.Tensor, mesh: Mesh, vocab_size: int) -> torch.Tensor:
    """The global tensor from this rank's shard: gathered over tp, vocabulary padding cut off."""
    split = tp_split_of(param)
    full = local
    if split is not None and mesh.tp > 1:
        parts = M.all_gather(local.contiguous(), 0, mesh.group("tp")).chunk(mesh.tp, 0)  # each rank's shard
        full = split.unshard(list(parts))
    return full[:vocab_size] if name in _VOCAB else full


def _local(name: str, full: torch.Tensor, param: torch.Tensor, mesh: Mesh, root: str) -> torch.Tensor:
    """This rank's shard of a global tensor, shaped like `param` (vocabulary padded with zeros)."""
    split = tp_split_of(param)
    if name in _VOCAB:
        rows = param.shape[0] * (mesh.tp if split is not None else 1)
        if full.shape[0] > rows:
            raise CheckpointError(f"{root}: tensor {name!r} has {full.shape[0]} vocabulary rows, the model only {rows}")
        full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    local = split.shard(full, mesh.tp_rank, mesh.tp) if split is not None and mesh.tp > 1 else full
    if tuple(local.shape) != tuple(param.shape):
        raise CheckpointError(
            f"{root}: tensor {name!r} has shape {tuple(full.shape)}, which does not fit the model "
            f"(this rank needs {tuple(param.shape)} of it)")
    return local


def _moments(model: GPT, optimizer: torch.optim.Optimizer, par: Parallel) -> dict[str, dict[str, torch.Tensor]]:
    if par.ddp is not None and par.ddp.dist_opt:
        return par.ddp.full_optimizer_state()
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: {k: st[k] for k in ("exp_avg", "exp_avg_sq")} for p, st in optimizer.state.items()}


def _optimizer_step(optimizer: torch.optim.Optimizer, par: Parallel) -> int:
    if par.ddp is not None and par.ddp.dist_opt:
        return par.ddp.optimizer_step_count()
    steps = {int(st["step"]) for st in optimizer.state.values()} or {0}
    if len(steps) != 1:
        raise CheckpointError(f"optimizer parameters disagree on their step count: {sorted(steps)}")
    return steps.pop()


def state_tensors(model: GPT, optimizer: torch.optim.Optimizer, par: Parallel) -> dict[str, torch.Tensor]:
    """Every tensor of the training state in global coordinates (collective over the mesh)."""
    v = model.vocab_size
    tensors: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        tensors[name] = _global(name, p.detach(), p, par.mesh, v)
    for name, moments in _moments(model, optimizer, par).items():
        for key, value in moments.items():
            tensors[f"optim.{key}.{name}"] = _global(name, value, params[name], par.mesh, v)
    tensors["rng.torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return tensors


def save(root: str, model: GPT, optimizer: torch.optim.Optimizer, state: TrainState,
         job: JobConfig, extra: dict[str, Any], par: Parallel) -> str:
    """Save the whole training state as checkpoint `state.iteration` under `root` (collective).

    Returns:
        The checkpoint's URL (on every rank).
    """
    tensors = state_tensors(model, optimizer, par)
    np_state = np.random.get_state()
    metadata = {
        "format": FORMAT,
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "optimizer_step": _optimizer_step(optimizer, par),
        "config": to_dict(job),
        "rng_python": random.getstate(),
        "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        **extra,
    }
    url = [None]
    if par.mesh.rank == 0:
        url[0] = save_checkpoint(root, state.iteration, tensors, metadata).url
    if par.mesh.distributed:
        dist.broadcast_object_list(url, src=0)  # also a barrier: nobody proceeds before the commit
    return url[0]


def restore(root: str, model: GPT, optimizer: torch.optim.Optimizer, par: Parallel,
            step: int | None = None) -> tuple[TrainState, dict]:
    """Load checkpoint `step` (latest committed if None) into `model` and `optimizer` in place.

    Raises:
        CheckpointError: the checkpoint is missing, corrupt or does not fit the model.
    """
    tensors, meta = load_checkpoint(root, step)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{root}: not a meshtrain training checkpoint (format {meta.get('format')!r})")
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in tensors]
    if missing:
        raise CheckpointError(f"{root}: checkpoint lacks parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = [n for n in tensors if not n.startswith(("optim.", "rng.")) and n not in params]
    if extra:
        raise CheckpointError(f"{root}: checkpoint has tensors the model does not: {extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_local(name, tensors[name], p, par.mesh, root).to(p.dtype))
    opt_step = meta["optimizer_step"]
    if opt_step > 0:
        moments = {name: {k: _local(name, tensors[f"optim.{k}.{name}"], p, par.mesh, root)
                          for k in ("exp_avg", "exp_avg_sq")} for name, p in params.items()}
        if par.ddp is not None and par.ddp.dist_opt:
            par.ddp.load_optimizer_state(moments, opt_step)
        else:
            fused = any(g.get("fused") for g in optimizer.param_groups)
            for name, p in params.items():
                optimizer.state[p] = {
                    "step": torch.tensor(float(opt_step), device=p.device if fused else "cpu"),
                    **{k: v.to(p.device, torch.float32).clone() for k, v in moments[name].items()},
                }
    torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.torch_cuda" in tensors and torch.cuda.is_available():
        states = list(tensors["rng.torch_cuda"])
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in meta["rng_python"]))
    name, keys, *rest = meta["rng_numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    return TrainState(meta["iteration"], meta["consumed_samples"]), meta
