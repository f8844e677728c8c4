"""Loading a training checkpoint into a model, its optimizer and the RNGs, in place.

Each rank reads exactly the boxes its shards cover (`BoxReader`), so any tp/dp/ep/pp layout loads
any checkpoint and a resumed run continues with identical losses: the weights (into the fp32
masters of bf16 device parameters where an offloaded optimizer holds them), AdamW's moments and
step count (into the distributed optimizer or the torch one), and the torch, Python and NumPy RNG
states. The checks of `checkpoint_checks` run first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.reader import read_box
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.trainer.checkpoint_boxes import Place, local_pieces, stored_places
from meshtrain.services.trainer.checkpoint_checks import (
    check_model,
    check_names,
    fresh_score,
    naming_the_settings,
    training_manifest,
)
from meshtrain.services.trainer.checkpoint_state import (
    Parallel,
    TrainedModel,
    TrainState,
    master_loader,
    rng_states,
)
from meshtrain.services.trainer.optim.offload import OffloadedAdamW
from meshtrain.services.trainer.parallel.mesh import Mesh


def restore(
    root: str,
    model: TrainedModel,
    optimizer: torch.optim.Optimizer | None,
    par: Parallel,
    step: int | None = None,
    rng: bool = True,
    masters: torch.optim.Optimizer | None = None,
) -> tuple[TrainState, dict]:
    """Load checkpoint `step` (latest committed if None) into `model` and `optimizer` in place.

    Each rank reads only the boxes its shards cover. `optimizer` None: the weights only (the
    RNG states are restored all the same, unless `rng` is false). The weights of bf16 device
    parameters go into the fp32 masters of the offloaded optimizer that holds them: `optimizer`,
    or `masters` where the moments are not loaded (optim.offload_bf16_params).

    Raises:
        CheckpointError: the checkpoint is missing, corrupt or does not fit the model.
    """
    step, manifest = training_manifest(root, step)
    meta = manifest.get("metadata", {})
    mesh = par.mesh
    params = dict(model.named_parameters())
    reader = BoxReader(root, step, manifest, stored_places(manifest), mesh, model.vocab_size)
    check_model(root, meta, model)
    fresh = fresh_score(root, meta, model, optimizer)
    load_masters = master_loader(model, optimizer if optimizer is not None else masters, par)
    if load_masters is None and any(hasattr(p, "main_grad") for p in params.values()):
        raise CheckpointError(
            "the model's bf16 parameters have fp32 master weights in an offloaded optimizer: "
            "pass it (as the optimizer, or as masters= to load the weights alone)"
        )
    try:
        check_names(root, model, params, set(reader.places) | fresh, mesh)
        weights: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in params.items():
                if name in fresh:
                    continue
                if load_masters is not None and p.requires_grad:  # fp32, into the masters
                    weights[name] = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    reader.read_into(name, weights[name], p)
                else:
                    reader.read_into(name, p.data, p)
            if load_masters is not None:
                load_masters(weights)
    except CheckpointError as e:
        raise naming_the_settings(e, root, meta, model) from None
    opt_step = meta["optimizer_step"]
    if opt_step > 0 and optimizer is not None:
        restore_moments(reader, params, optimizer, par, opt_step)
    if rng:
        restore_rng(root, step, manifest, mesh)
    return TrainState(meta["iteration"], meta["consumed_samples"]), meta


@dataclass
class BoxReader:
    """Reads the boxes of one checkpoint that this rank's tensors cover."""

    root: str
    step: int
    manifest: dict
    places: dict[str, Place]
    mesh: Mesh
    vocab_size: int

    def read_into(self, name: str, dst: torch.Tensor, param: torch.Tensor) -> None:
        """Fill `dst`, this rank's tensor `name` (of parameter `param`), from the checkpoint."""
        if name not in self.places:
            raise CheckpointError(
                f"{self.root}: checkpoint step {self.step} has no tensor {name!r} (optimizer_step "
                f"{self.manifest.get('metadata', {}).get('optimizer_step')}); load the weights "
                "only (no optimizer) or another step"
            )
        place, v = self.places[name], self.vocab_size
        dst, pcs = local_pieces(name, dst, param, self.mesh, v, place, reading=True)
        dst.zero_()  # padded vocabulary rows are not stored: they restart at zero
        for piece in pcs:
            spec = piece.spec
            entry = self.manifest["arrays"].get(spec.array)
            if entry is None or tuple(entry["shape"]) != spec.global_shape:
                raise self._shape_error(name, spec, entry)
            box = read_box(
                self.root, self.step, spec.array, spec.offsets, spec.shape, self.manifest
            )
            dst[piece.local].copy_(box.view(dst[piece.local].shape))

    def _shape_error(self, name: str, spec: ShardSpec, entry: dict | None) -> CheckpointError:
        have = tuple(entry["shape"]) if entry else None
        v = self.vocab_size
        hint = ""
        if (
            have
            and len(have) == len(spec.global_shape)
            and have[1:] == spec.global_shape[1:]
            and have[0] != spec.global_shape[0]
            and spec.global_shape[0] == v
        ):
            # Only the vocabulary differs: the usual cause is a resume without the run's
            # data flags (another --tokenizer, hence another vocab_size).
            hint = (
                f"; the vocabulary differs ({have[0]} saved, {v} now), most likely a resume "
                f"without the run's data flags: pass --config RUN/config.toml (or the "
                f"run's --tokenizer / --vocab-size)"
            )
        return CheckpointError(
            f"{self.root}: tensor {name!r} is stored as {spec.array!r} of shape {have}; the model "
            f"needs shape {spec.global_shape}{hint}"
        )


def restore_moments(
    reader: BoxReader,
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    par: Parallel,
    opt_step: int,
) -> None:
    """AdamW's moments and step count, into the distributed optimizer or `optimizer`."""
    # Frozen parameters (the router's expert bias, moved by its own rule) have no moments.
    trained = {n: p for n, p in params.items() if p.requires_grad}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in trained.items():
        moments[name] = {}
        for k in ("exp_avg", "exp_avg_sq"):
            t = torch.zeros_like(p.data, dtype=torch.float32)
            reader.read_into(f"optim.{k}.{name}", t, p)
            moments[name][k] = t
    zero1 = par.distributed_optimizer
    if zero1 is not None:
        zero1.load_optimizer_state(moments, opt_step)
    else:
        fused = any(g.get("fused") for g in optimizer.param_groups)
        # an offloaded optimizer keeps its moments on the host: no round trip through the device
        offloaded = isinstance(optimizer, OffloadedAdamW)
        for name, p in trained.items():
            optimizer.state[p] = {
                "step": torch.tensor(float(opt_step), device=p.device if fused else "cpu"),
                **{k: v if offloaded else v.to(p.device) for k, v in moments[name].items()},
            }


def restore_rng(root: str, step: int, manifest: dict, mesh: Mesh) -> None:
    """The torch (CPU, this rank's CUDA device, or this pipeline stage's own), Python and
    NumPy RNG states the checkpoint saved."""
    arrays, meta = manifest["arrays"], manifest.get("metadata", {})
    rng = arrays["rng.torch_cpu"]["shape"]
    torch.set_rng_state(read_box(root, step, "rng.torch_cpu", (0,), tuple(rng), manifest))
    staged = arrays.get("rng.torch_cpu_by_stage")
    if staged is not None and staged["shape"][0] == mesh.pp:  # saved at this pp: this stage's own
        for array, gen in rng_states().items():
            entry = arrays.get(f"{array}_by_stage")
            if entry is not None and tuple(entry["shape"][1:]) == tuple(gen.shape):
                row = read_box(
                    root,
                    step,
                    f"{array}_by_stage",
                    (mesh.pp_rank, *[0] * gen.dim()),
                    (1, *gen.shape),
                    manifest,
                )[0]
                (torch.set_rng_state if array == "rng.torch_cpu" else torch.cuda.set_rng_state)(row)
    elif "rng.torch_cuda" in arrays and torch.cuda.is_available():
        shape = tuple(arrays["rng.torch_cuda"]["shape"])
        # Row 0: the saving rank's device (older checkpoints stored every visible device, of
        # which rank 0 only ever advanced its own, device 0). Set on this rank's device.
        state = read_box(root, step, "rng.torch_cuda", (0, 0), (1, shape[1]), manifest)[0]
        torch.cuda.set_rng_state(state)
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in meta["rng_python"]))
    name, keys, *rest = meta["rng_numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
