"""The trainer's state <-> checkpoint tensors: model, optimizer, RNG and data position.

Everything goes into the layout-independent format (`services.checkpoint`): parameters by
canonical name with padded vocabulary rows cut off, AdamW moments per parameter
(`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`), RNG states as byte tensors, and the
scalars (iteration, consumed samples, optimizer step, config) as manifest metadata. Restoring
puts back exactly what was saved, so a resumed run continues with identical losses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.checkpoint.reader import load_checkpoint
from services.checkpoint.writer import save_checkpoint
from services.common.config import to_dict
from services.common.errors import CheckpointError
from services.trainer.config import JobConfig
from services.trainer.model.gpt import GPT

FORMAT = "meshtrain-train/1"
_PADDED = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass
class TrainState:
    """Counters a checkpoint restores besides tensors."""

    iteration: int = 0
    consumed_samples: int = 0


def _unpad(name: str, t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return t[:vocab_size] if name in _PADDED else t


def state_tensors(model: GPT, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the training state, by canonical name, padding removed."""
    v = model.vocab_size
    tensors: dict[str, torch.Tensor] = {}
    index = {p: n for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        tensors[name] = _unpad(name, p.detach(), v)
    for p, st in optimizer.state.items():
        name = index[p]
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"optim.{key}.{name}"] = _unpad(name, st[key], v)
    tensors["rng.torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return tensors


def save(root: str, model: GPT, optimizer: torch.optim.Optimizer, state: TrainState,
         job: JobConfig, extra: dict[str, Any]) -> str:
    """Save the whole training state as checkpoint `state.iteration` under `root`; returns its URL."""
    steps = {int(st["step"]) for st in optimizer.state.values()} or {0}
    if len(steps) != 1:
        raise CheckpointError(f"optimizer parameters disagree on their step count: {sorted(steps)}")
    np_state = np.random.get_state()
    metadata = {
        "format": FORMAT,
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "optimizer_step": steps.pop(),
        "config": to_dict(job),
        "rng_python": random.getstate(),
        "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        **extra,
    }
    result = save_checkpoint(root, state.iteration, state_tensors(model, optimizer), metadata)
    return getattr(result, "url", result)


def restore(root: str, model: GPT, optimizer: torch.optim.Optimizer, step: int | None = None) -> tuple[TrainState, dict]:
    """Load checkpoint `step` (latest committed if None) into `model` and `optimizer` in place.

    Raises:
        CheckpointError: the checkpoint is missing, corrupt or does not fit the model.
    """
    tensors, meta = load_checkpoint(root, step)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{root}: not a meshtrain training checkpoint (format {meta.get('format')!r})")
    v = model.vocab_size
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in tensors]
    if missing:
        raise CheckpointError(f"{root}: checkpoint lacks parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = [n for n in tensors if not n.startswith(("optim.", "rng.")) and n not in params]
    if extra:
        raise CheckpointError(f"{root}: checkpoint has tensors the model does not: {extra[:5]}")

    def load_into(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        want = tuple(_unpad(name, dst, v).shape)
        if tuple(src.shape) != want:
            raise CheckpointError(f"{root}: tensor {name!r} has shape {tuple(src.shape)}, the model needs {want}")
        with torch.no_grad():
            dst.zero_()  # padded vocabulary rows are not stored: they restart at zero
            _unpad(name, dst, v).copy_(src.to(dst.dtype))

    for name, p in params.items():
        load_into(name, p.data, tensors[name])
    opt_step = meta["optimizer_step"]
    if opt_step > 0:
        sd = optimizer.state_dict()
        order = [p for g in optimizer.param_groups for p in g["params"]]
        names = {p: n for n, p in params.items()}
        state = {}
        for i, p in enumerate(order):
            name = names[p]
            entry = {"step": torch.tensor(float(opt_step))}
            for key in ("exp_avg", "exp_avg_sq"):
                t = torch.zeros_like(p.data)
                load_into(name, t, tensors[f"optim.{key}.{name}"])
                entry[key] = t
            state[i] = entry
        optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.torch_cuda" in tensors and torch.cuda.is_available():
        states = list(tensors["rng.torch_cuda"])
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in meta["rng_python"]))
    name, keys, *rest = meta["rng_numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    return TrainState(meta["iteration"], meta["consumed_samples"]), meta
