"""Rewriting checkpoints: dtype conversion, dropping optimizer state, target-layout shard plans.

`convert(src, dst)` copies a committed checkpoint into a new root tensor by tensor, so peak
memory stays near a small multiple of the largest tensor whatever the model size:
`save_streaming` loads one tensor, writes its shard boxes through the checkpoint library's
multi-writer protocol (`multiwriter.ShardWriter`, one writer) and drops it before the next, then
commits the manifest last. Source and destination are any fsspec URLs (local, `file://`,
`memory://`, `s3://`). For a target tensor/pipeline/expert-parallel layout,
`target_shard_shapes` picks each array's shard shape so every rank reads whole shards
(Megatron's split rules). HF import/export lives in `hf/convert.py` and reuses these helpers.

    convert("runs/a/checkpoints", "s3://bucket/a-bf16", dtype="bf16", drop_optimizer=True)
    pytest tests/services/checkpoint/test_convert.py
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.multiwriter import ShardWriter, begin_save, is_committed
from meshtrain.services.checkpoint.reader import latest_step, read_manifest, read_tensor
from meshtrain.services.checkpoint.store import open_root, same_root
from meshtrain.services.common.config import build
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig

log = logging.getLogger(__name__)

# User-facing dtype spellings -> logical dtype names of the checkpoint format.
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
}
_FLOAT_DTYPES = {"bfloat16", "float32", "float16"}
# Logical dtype name -> torch dtype (the inverse of `layout.dtype_name`).
TORCH_DTYPES = {
    name: dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
    for name in [layout.dtype_name(dtype)]
}

TensorSpec = tuple[tuple[int, ...], str]  # (tensor shape, logical dtype name)


@dataclass(frozen=True)
class ConvertResult:
    """What one conversion did.

    Attributes:
        url: URL of the committed destination checkpoint.
        step: the step converted (the destination keeps it).
        tensors: tensors written.
        bytes_read: logical bytes of the source tensors read.
        bytes_written: logical bytes of the tensors written (after any dtype change).
        seconds: wall time.
    """

    url: str
    step: int
    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float


def numpy_rng_state(seed: int) -> list[Any]:
    """NumPy's legacy generator state seeded with `seed`, as a checkpoint's metadata stores it
    (an imported checkpoint's fresh `rng_numpy`)."""
    state = np.random.RandomState(seed).get_state(legacy=True)
    assert isinstance(state, tuple)  # a RandomState's MT19937 gives the legacy tuple
    return [state[0], state[1].tolist(), *state[2:]]


def resolve_step(root: str, step: int | None) -> int:
    """Returns `step`, or the latest committed step under `root` when it is None.

    Raises:
        CheckpointError: there is no committed checkpoint under `root`.
    """
    if step is not None:
        return step
    found = latest_step(root)
    if found is None:
        raise CheckpointError(f"no committed checkpoint under {root!r}")
    return found


def tensor_specs(manifest: dict[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor of a checkpoint with its shape and logical dtype, from its manifest.

    Args:
        manifest: as returned by `read_manifest`.

    Returns:
        Tensor name -> (shape, logical dtype name), in manifest order.
    """
    specs: dict[str, TensorSpec] = {}
    for entry in manifest["arrays"].values():
        # A stacked array's first axis is the layer; each tensor is one slice of it.
        shape = tuple(entry["shape"][1:] if entry["layer_count"] is not None else entry["shape"])
        for name in entry["tensors"]:
            specs[name] = (shape, entry["dtype"])
    return specs


def model_config(metadata: dict[str, Any], specs: dict[str, TensorSpec], where: str) -> ModelConfig:
    """Rebuilds the ModelConfig a training checkpoint was saved with.

    Args:
        metadata: the manifest's user metadata (a training checkpoint holds `config.model`).
        specs: the checkpoint's tensors; the vocabulary comes from the word embedding's rows
            when the saved config left `vocab_size` unset (it is resolved from the tokenizer).
        where: the checkpoint, for error messages.

    Raises:
        CheckpointError: the metadata has no model config or it is not valid.
    """
    table = (metadata.get("config") or {}).get("model")
    if not isinstance(table, dict):
        raise CheckpointError(
            f"{where}: metadata has no config.model, so the architecture is unknown "
            "(is this a meshtrain training checkpoint?)"
        )
    table = dict(table)
    if "vocab_size" not in table and "embedding.word_embeddings.weight" in specs:
        table["vocab_size"] = specs["embedding.word_embeddings.weight"][0][0]
    try:
        return build(ModelConfig, table, "model.")
    except ValueError as e:
        raise CheckpointError(f"{where}: config.model is not valid: {e}") from e


@dataclass
class Source:
    """A committed training checkpoint opened for export: its step, manifest, tensors, metadata
    and model, and how error messages name it."""

    step: int
    where: str
    manifest: dict[str, Any]
    specs: dict[str, TensorSpec]
    metadata: dict[str, Any]
    model: ModelConfig


def open_source(root: str, step: int | None) -> Source:
    """Step `step` (default: the latest) of `root`, with its model rebuilt from the metadata.

    Raises:
        CheckpointError: no committed checkpoint there, or its metadata holds no valid model.
    """
    step = resolve_step(root, step)
    where = f"checkpoint step {step} under {root!r}"
    manifest = read_manifest(root, step)
    specs, metadata = tensor_specs(manifest), manifest["metadata"]
    return Source(step, where, manifest, specs, metadata, model_config(metadata, specs, where))


def save_streaming(
    dst: str,
    step: int,
    specs: dict[str, TensorSpec],
    load: Callable[[str], torch.Tensor],
    metadata: dict[str, Any],
    grids: dict[str, tuple[int, ...]] | None = None,
    progress: bool = False,
    desc: str = "save",
) -> tuple[str, int]:
    """Saves a checkpoint reading one tensor at a time, with chosen shard shapes, and checks it.

    Uses the checkpoint library's multi-writer protocol with a single writer: each tensor is
    loaded, cut into boxes of its shard shape (one stored object each), written, and dropped
    before the next is loaded; the manifest is committed last by `commit`.

    Args:
        dst: destination root URL.
        step: step to save as.
        specs: every tensor to write, with the shape and dtype `load` must give it.
        load: produces one CPU tensor by name.
        metadata: the manifest metadata.
        grids: tensor name -> shard shape (without the layer axis); None or a missing name
            means one shard per tensor, as `save_checkpoint` writes.
        progress: show a tqdm bar (bytes) on stderr.
        desc: the bar's label.

    Returns:
        (URL of the committed checkpoint, logical bytes written).

    Raises:
        CheckpointError: a tensor came out with another shape or dtype, or the committed
            manifest does not list exactly `specs`. Nothing is committed on error.
    """
    grids = grids or {}
    arrays = layout.group_tensors((n, shape, dtype) for n, (shape, dtype) in specs.items())
    total = sum(_nbytes(shape, dtype) for shape, dtype in specs.values())
    root = open_root(dst)
    if is_committed(root, step):  # begin_save's own message points at the trainer's switch
        raise CheckpointError(
            f"checkpoint step {step} already exists under {dst!r}: write to another root, or "
            f"delete it first (meshtrain ckpt delete {dst} --step {step})"
        )
    save_id = begin_save(root, step)
    writer = ShardWriter(root, step, save_id, writer_id=0, num_writers=1)
    written = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        for array in arrays.values():
            stacked = array.layer_count is not None
            grid = grids.get(array.tensors[0], array.tensor_shape)
            for layer, name in enumerate(array.tensors):
                tensor = load(name)
                want_shape, want_dtype = specs[name]
                if (
                    tuple(tensor.shape) != tuple(want_shape)
                    or tensor.dtype != TORCH_DTYPES[want_dtype]
                ):
                    raise CheckpointError(
                        f"tensor {name!r} came out as {tuple(tensor.shape)} {tensor.dtype}, "
                        f"expected {tuple(want_shape)} {want_dtype}"
                    )
                for offsets, shape in _boxes(tuple(want_shape), tuple(grid)):
                    part = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
                    if stacked:  # (1, *box): this layer's slice of the stacked array
                        box = ShardSpec(
                            array.name,
                            array.shape,
                            want_dtype,
                            (layer, *offsets),
                            (1, *shape),
                            (1, *grid),
                            stacked=True,
                        )
                        part = part.unsqueeze(0)
                    else:
                        box = ShardSpec(
                            array.name,
                            array.shape,
                            want_dtype,
                            offsets,
                            shape,
                            tuple(grid),
                            stacked=False,
                        )
                    writer.write(box, part)
                nbytes = tensor.numel() * tensor.element_size()
                written += nbytes
                bar.update(nbytes)
                del tensor, part  # the next tensor must not overlap this one in memory
    writer.finish()
    result = commit(root, step, save_id, num_writers=1, metadata=metadata, timeout=0)
    stored = tensor_specs(read_manifest(dst, step))
    planned = {n: (tuple(s), d) for n, (s, d) in specs.items()}
    if stored != planned:
        wrong = sorted(set(stored.items()) ^ set(planned.items()))[:5]
        raise CheckpointError(
            f"{result.url}: the committed manifest does not match the plan: {wrong}"
        )
    return result.url, written


def _boxes(
    shape: tuple[int, ...], grid: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, shape) of every box of a tensor cut on `grid`; one box when it is empty."""
    if 0 in shape or not shape:
        return [((0,) * len(shape), shape)]
    counts = [-(-n // g) for n, g in zip(shape, grid)]
    return [
        (
            tuple(c * g for c, g in zip(coords, grid)),
            tuple(min(g, n - c * g) for c, g, n in zip(coords, grid, shape)),
        )
        for coords in itertools.product(*map(range, counts))
    ]


def convert(
    src: str,
    dst: str,
    dtype: str | None = None,
    drop_optimizer: bool = False,
    target_tp: int = 1,
    target_pp: int = 1,
    target_ep: int = 1,
    step: int | None = None,
    progress: bool = True,
) -> ConvertResult:
    """Copies a checkpoint into another root, streaming, optionally changing dtype and contents.

    Only model parameters change dtype: optimizer moments stay as they are (Adam's second
    moment in bf16 loses the small values that set the step size), integer and RNG tensors
    are never touched. Dropping the optimizer also sets `optimizer_step` to 0, so a resumed
    run starts Adam afresh instead of looking for the missing moments.

    Args:
        src: source root URL.
        dst: destination root URL, not the source's; the step must not be committed there yet.
        dtype: 'bf16' / 'fp32' / 'fp16' for the parameters, None keeps each tensor's dtype.
        drop_optimizer: leave out `optim.*` tensors.
        target_tp: tensor-parallel degree the destination is laid out for.
        target_pp: pipeline-parallel degree.
        target_ep: expert-parallel degree.
        step: source step; None converts the latest committed one.
        progress: show a progress bar.

    Returns:
        A ConvertResult.

    Raises:
        CheckpointError: no such checkpoint, `dst` is `src`, the step already exists at `dst`, a bad
            dtype, a parameter holding a value the target dtype cannot (fp16 past 65504: it would be
            stored as inf). A target degree that does not divide what it splits (see
            `target_shard_shapes`).
    """
    start = time.perf_counter()
    step = resolve_step(src, step)
    if same_root(src, dst):
        # The step is kept, so it would land on itself; `save_streaming`'s hint (delete the
        # step at the destination first) would delete the source.
        raise CheckpointError(
            f"convert destination {dst!r} is the source root {src!r}: the converted step {step} "
            "would replace the checkpoint it is read from; write to another root"
        )
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    target = DTYPES.get(dtype) if dtype else None
    manifest = read_manifest(src, step)
    metadata = dict(manifest["metadata"])
    specs = tensor_specs(manifest)
    where = f"checkpoint step {step} under {src!r}"

    grids = None
    if (target_tp, target_pp, target_ep) != (1, 1, 1):
        grids = target_shard_shapes(
            specs, model_config(metadata, specs, where), target_tp, target_pp, target_ep
        )

    out: dict[str, TensorSpec] = {}
    for name, (shape, dt) in specs.items():
        if drop_optimizer and name.startswith("optim."):
            continue
        is_param = not name.startswith(layout.NON_PARAMETER)
        out[name] = (shape, target if target and is_param and dt in _FLOAT_DTYPES else dt)
    if drop_optimizer and "optimizer_step" in metadata:
        metadata["optimizer_step"] = 0
    metadata["converted_from"] = {
        "url": src,
        "step": step,
        "dtype": target,
        "drop_optimizer": drop_optimizer,
        "target_tp": target_tp,
        "target_pp": target_pp,
        "target_ep": target_ep,
    }

    def load(name: str) -> torch.Tensor:
        tensor = read_tensor(src, step, name, manifest=manifest)
        want = TORCH_DTYPES[out[name][1]]
        return tensor if tensor.dtype == want else _narrowed(name, tensor, want)

    url, written = save_streaming(
        dst, step, out, load, metadata, grids, progress, f"convert step {step}"
    )
    read = sum(_nbytes(*specs[n]) for n in out)
    return ConvertResult(url, step, len(out), read, written, time.perf_counter() - start)


def _narrowed(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` cast to `dtype`, refusing a finite value the cast would turn into inf.

    fp16's range ends at 65504, where fp32's and bf16's reach 3.4e38: a cast rounds anything
    past it to inf, a value the checkpoint never held. Infs already there stay as they are.

    Raises:
        CheckpointError: names the tensor, its largest magnitude and the dtype.
    """
    out = tensor.to(dtype)
    if not out.is_floating_point() or not tensor.numel():
        return out
    limit = torch.finfo(dtype).max
    low, high = torch.aminmax(tensor)  # reductions only: no tensor-sized temporaries
    if high <= limit and low >= -limit:
        return out
    overflowed = tensor[torch.isinf(out) & torch.isfinite(tensor)]  # rare: values past the limit
    if not overflowed.numel():
        return out  # they only round to the largest value, or were inf already
    worst = overflowed[overflowed.abs().argmax()].item()
    hint = (
        "; convert to bfloat16 instead, which has float32's range" if dtype == torch.float16 else ""
    )
    raise CheckpointError(
        f"tensor {name!r} holds {worst:.4g}, beyond {layout.dtype_name(dtype)}'s largest value "
        f"{limit:.6g}: the conversion would store inf{hint}"
    )


def inspect_checkpoint(root: str, step: int | None = None) -> dict[str, Any]:
    """What `ckpt inspect` shows: tensors, shapes, dtypes, bytes, step, config and provenance.

    Args:
        root: checkpoint root URL.
        step: the step; None inspects the latest committed one.

    Returns:
        {"step", "created_unix", "tensors": {name: {"shape", "dtype", "bytes"}}, "bytes" (logical
        total), "stored_bytes" (objects on storage), "config" (or None), "provenance" (where
        the checkpoint came from: `converted_from` / `imported_from` metadata, else "training"),
        "metadata" (the rest of the scalars)}.
    """
    step = resolve_step(root, step)
    manifest = read_manifest(root, step)
    meta = dict(manifest["metadata"])
    tensors = {
        name: {"shape": list(shape), "dtype": dtype, "bytes": _nbytes(shape, dtype)}
        for name, (shape, dtype) in tensor_specs(manifest).items()
    }
    stored = sum(o["size"] for a in manifest["arrays"].values() for o in a["objects"].values())
    provenance = {
        k: meta.pop(k) for k in ("converted_from", "imported_from") if k in meta
    } or "training"
    config = meta.pop("config", None)
    for bulky in ("rng_python", "rng_numpy"):
        meta.pop(bulky, None)
    return {
        "step": step,
        "created_unix": manifest.get("created_unix"),
        "tensors": tensors,
        "bytes": sum(t["bytes"] for t in tensors.values()),
        "stored_bytes": stored,
        "config": config,
        "provenance": provenance,
        "metadata": meta,
    }


def target_shard_shapes(
    specs: dict[str, TensorSpec], model: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1
) -> dict[str, tuple[int, ...]]:
    """Per tensor, the shard shape under which each rank of a target layout reads whole shards.

    Megatron's tensor-parallel splits, in the checkpoint's canonical order: `attention.qkv`
    rows by query groups (groups/tp groups per rank, each [its query heads; k; v]);
    `attention.proj` and `mlp.fc2` weights by columns; `mlp.fc1` rows in ffn/tp chunks (the
    gate and up halves are each split in tp, so 2*tp chunks); the word embedding and output
    layer by vocabulary rows, ceil(vocab / (divisor*tp)) * divisor per rank as Megatron pads
    the vocabulary; experts (`mlp.experts.fc1/fc2`, experts on the leading axis) in
    num_experts/ep experts per shard, and within each expert split in tp as a dense MLP (the
    shared expert is one); everything else (norms, position embeddings, row-parallel biases,
    routers and their expert bias, RNG) is replicated, so one shard. Optimizer moments follow
    their parameter. Pipeline stages own whole layers, and stacked arrays already hold one layer
    per shard, so pp only has to fit.

    Args:
        specs: tensor name -> (shape, dtype), as from `tensor_specs`.
        model: the architecture.
        tp: target tensor-parallel degree.
        pp: target pipeline-parallel degree.
        ep: target expert-parallel degree.

    Returns:
        Tensor name -> shard shape (the tensor's own shape when it is not split); a stacked
        array's shard shape is (1, *this).

    Raises:
        CheckpointError: a degree is not positive or does not divide what it splits (ep: the
            experts; a model without experts refuses ep > 1).
    """
    for key, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"target {key} must be a positive int, got {value!r}")
    if pp > model.num_layers:
        raise CheckpointError(f"target pp={pp} exceeds model.num_layers={model.num_layers}")
    experts = model.num_experts
    if ep > 1 and experts is None:
        raise CheckpointError(f"target ep={ep}: this model has no experts to split")
    if experts is not None and experts % ep:
        raise CheckpointError(f"target ep={ep} does not divide model.num_experts={experts}")
    sizes = [
        ("model.num_query_groups", model.groups),
        ("ffn size", model.ffn_size),
        ("model.hidden_size", model.hidden_size),
    ]
    if experts is not None:
        sizes.append(("expert ffn size (model.moe_ffn_hidden_size)", model.moe_ffn_size))
        if model.moe_shared_expert_intermediate_size:
            sizes.append(
                (
                    "model.moe_shared_expert_intermediate_size",
                    model.moe_shared_expert_intermediate_size,
                )
            )
    for what, size in sizes:
        if size % tp:
            raise CheckpointError(f"target tp={tp} does not divide {what}={size}")
    if model.vocab_size is None:
        raise CheckpointError("the checkpoint's model config records no vocab_size")
    per_group_rows = (model.num_attention_heads // model.groups + 2) * model.head_dim
    vocab_rows = (
        -(-model.vocab_size // (model.make_vocab_size_divisible_by * tp))
        * model.make_vocab_size_divisible_by
    )
    shared_ffn = model.moe_shared_expert_intermediate_size or 0  # its arrays exist where it is set

    plan: dict[str, tuple[int, ...]] = {}
    for name, (shape, _) in specs.items():
        param = (
            name.split(".", 2)[2]
            if name.startswith(("optim.exp_avg.", "optim.exp_avg_sq."))
            else name
        )
        _, layer = layout.array_key(param)
        rest = param.split(".", 2)[2] if layer is not None else param
        shard = list(shape)
        if rest in ("attention.qkv.weight", "attention.qkv.bias"):
            shard[0] = model.groups // tp * per_group_rows
        elif rest in ("mlp.fc1.weight", "mlp.fc1.bias"):
            shard[0] = model.ffn_size // tp
        elif rest in ("mlp.shared_expert.fc1.weight", "mlp.shared_expert.fc1.bias"):
            shard[0] = shared_ffn // tp
        elif rest in ("attention.proj.weight", "mlp.fc2.weight", "mlp.shared_expert.fc2.weight"):
            shard[1] = shape[1] // tp
        elif rest == "mlp.experts.fc1.weight":  # (experts, [gate; up] or ffn, hidden)
            shard[0], shard[1] = shape[0] // ep, model.moe_ffn_size // tp
        elif rest == "mlp.experts.fc2.weight":  # (experts, hidden, ffn)
            shard[0], shard[2] = shape[0] // ep, shape[2] // tp
        elif rest in ("embedding.word_embeddings.weight", "output_layer.weight"):
            shard[0] = min(vocab_rows, shape[0])
        plan[name] = tuple(shard)
    return plan


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * TORCH_DTYPES[dtype].itemsize
