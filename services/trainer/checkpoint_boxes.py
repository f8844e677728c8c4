"""Where a rank's tensors lie in a checkpoint: the boxes of global arrays they cover.

A parameter (or an AdamW moment of one, `optim.<moment>.<name>`) is stored in global,
layout-free coordinates: per-layer tensors stacked on a leading global-layer axis when every
layer 0..n-1 holds them (else one array per layer), tensor-parallel shards at their global
offsets (SwiGLU's fc1 as two boxes, one per half), padded vocabulary rows cut off, an
expert-parallel rank's experts at their global expert ids. `pieces` turns one rank's local
tensor into those boxes, for writing (replicated tensors by tp rank 0 only) and for reading.

    stacks = layer_stacks(name for name, _ in model.named_parameters())
    for piece in pieces(name, tuple(t.shape), param, mesh, vocab, save_place(name, stacks)):
        boxes.append((piece.spec, t[piece.local]))

`whole_tensor` puts the tensor-parallel shards of one parameter back together in those global
coordinates (what a single-device model holds, vocabulary padding cut off): the weights GRPO
streams to the rollout workers.

A fully sharded (FSDP2) parameter or moment is a DTensor whose local tensor is rows of the
tensor-parallel shard: `local_pieces` cuts that shard's boxes to those rows, so each rank writes
and reads its own slice in global coordinates and none gathers the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.layout import array_key, dtype_name
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor_layers import TPSplit, tp_split_of

_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass
class Piece:
    """Part of a rank's local tensor that is one box of a global array."""

    spec: ShardSpec
    local: tuple[slice, ...]  # where the box lies in the local tensor


@dataclass(frozen=True)
class Place:
    """Where a tensor lies in a checkpoint: its array and, when stacked, its row of the layer axis.

    Attributes:
        array: the array name.
        layer: the global layer (row of the leading layer axis) for a stacked array, else None.
        layer_count: the stacked array's layer axis, else None.
    """

    array: str
    layer: int | None = None
    layer_count: int | None = None


def layer_stacks(names: Iterable[str]) -> dict[str, int]:
    """Stacked array name -> layers, for the per-layer tensors of a whole model's `names`.

    A family of per-layer tensors (`layers.<i>.<rest>`) is stacked on a leading global-layer
    axis when the layers holding it are exactly 0..n-1 (the rule of `layout.group_tensors`, so
    `ckpt convert` and HF import store the same arrays). A family only some blocks hold (the
    experts of every other block, or the dense MLPs between them) would leave holes in such an
    axis, which no committed array may have: it is stored as one array per layer, named with its
    layer number (`layers.1.mlp.experts.fc1.weight`). Each layer's box is one object either way.
    """
    layers: dict[str, set[int]] = {}
    for name in names:
        array, layer = array_key(name)
        if layer is not None:
            layers.setdefault(array, set()).add(layer)
    return {a: len(ls) for a, ls in layers.items() if ls == set(range(len(ls)))}


def save_place(name: str, stacks: dict[str, int]) -> Place:
    """Where the trainer stores tensor `name` (a parameter, or `optim.<moment>.<parameter>`),
    given the model's `layer_stacks`."""
    array, layer = array_key(name)
    if layer is None:
        return Place(name)
    pname = name.split(".", 2)[2] if name.startswith("optim.") else name
    count = stacks.get(array_key(pname)[0])
    return Place(array, layer, count) if count is not None else Place(name)


def stored_places(manifest: dict[str, Any]) -> dict[str, Place]:
    """Where each tensor of a checkpoint lies, from its manifest (whatever grouping wrote it)."""
    out: dict[str, Place] = {}
    for array, entry in manifest["arrays"].items():
        count = entry.get("layer_count")
        for i, tensor in enumerate(entry.get("tensors", [])):
            out[tensor] = Place(array, i, count) if count is not None else Place(array)
    return out


def is_expert(param: torch.Tensor) -> bool:
    """Whether `param` is an expert weight split over expert-parallel ranks (`expert_shard` set)."""
    return getattr(param, "expert_shard", None) is not None


def pieces(
    name: str,
    local_shape: tuple[int, ...],
    param: torch.Tensor,
    mesh: Mesh,
    vocab_size: int,
    place: Place,
    reading: bool = False,
    dtype: torch.dtype | None = None,
) -> list[Piece]:
    """The boxes of global arrays that this rank's `local_shape` tensor named `name` covers.

    Args:
        name: canonical tensor name (a parameter's, or `optim.<moment>.<parameter>`).
        local_shape: shape of this rank's tensor (a tensor-parallel shard, vocabulary padded,
            an expert-parallel rank's experts).
        param: the parameter it belongs to (carries its `tp_split`, and `expert_shard =
            (first expert, experts in all)` when its leading axis holds some of the experts).
        mesh: the layout; for writing, replicated tensors are covered by tp rank 0 only.
        vocab_size: rows of vocabulary tensors in the checkpoint (padding is never stored).
        place: the array holding the tensor, and its layer row when stacked.
        reading: every rank needs the replicated tensors it holds.
        dtype: the stored tensor's dtype (unset: the parameter's; a bf16 parameter's fp32
            master weights or moments are stored in fp32).
    """
    split = tp_split_of(param) if mesh.tp > 1 else None
    pname = name.split(".", 2)[2] if name.startswith("optim.") else name
    if split is None and mesh.tp_rank != 0 and not reading:
        return []
    boxes, gshape = _tp_boxes(pname, local_shape, split, mesh.tp, mesh.tp_rank, vocab_size)
    _shift_to_experts(pname, local_shape, param, boxes, gshape)
    return _stored_pieces(boxes, gshape, place, dtype_name(dtype or param.dtype))


def whole_tensor(
    name: str, shards: list[torch.Tensor], param: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Parameter `name` in global coordinates, from every tensor-parallel rank's local tensor
    (`shards[r]` is tp rank r's; one shard: an unsharded parameter), as a checkpoint stores it.

    Raises:
        CheckpointError: an expert-parallel shard (it holds only some of the experts).
    """
    shard = getattr(param, "expert_shard", None)
    if shard is not None and (shard[0] != 0 or shards[0].shape[0] != shard[1]):
        raise CheckpointError(f"parameter {name!r} holds experts {shard}: not the whole tensor")
    tp = len(shards)
    split = tp_split_of(param) if tp > 1 else None
    if split is None:
        shards = shards[:1]  # replicated: every rank holds the whole
    out: torch.Tensor | None = None
    for r, t in enumerate(shards):
        boxes, gshape = _tp_boxes(name, tuple(t.shape), split, tp, r, vocab_size)
        if out is None:
            out = t.new_empty(gshape)
        for offsets, shape, local, _ in boxes:
            out[tuple(slice(o, o + n) for o, n in zip(offsets, shape))] = t[tuple(local)]
    assert out is not None
    return out


_Box = tuple[list[int], list[int], list[slice], list[int] | None]  # offsets, shape, local, grid


def _tp_boxes(
    pname: str,
    local_shape: tuple[int, ...],
    split: TPSplit | None,
    tp: int,
    tp_rank: int,
    vocab_size: int,
) -> tuple[list[_Box], list[int]]:
    """The boxes of a tensor-parallel rank's tensor (`split` None: replicated, one box), and the
    global shape they lie in (without the layer axis)."""
    full = [slice(None)] * len(local_shape)
    boxes: list[_Box] = []
    gshape = list(local_shape)
    if split is None:
        shape = list(local_shape)
        if pname in _VOCAB:
            shape[0] = gshape[0] = vocab_size
        boxes.append(([0] * len(shape), shape, [slice(0, n) for n in shape], None))
        return boxes, gshape
    d, r, n = split.dim, tp_rank, local_shape[split.dim]
    gshape[d] = n * tp
    if split.halves:
        half = n // 2
        for k in range(2):
            offsets = [0] * len(local_shape)
            offsets[d] = k * half * tp + r * half
            local = list(full)
            local[d] = slice(k * half, (k + 1) * half)
            shape = list(local_shape)
            shape[d] = half
            boxes.append((offsets, shape, local, None))
    elif split.vocab:
        gshape[0] = vocab_size
        start, stop = r * n, min((r + 1) * n, vocab_size)
        if start < stop:
            shape = [stop - start, *local_shape[1:]]
            # a short last box says the grid; a vocabulary within one rank's rows is one box
            grid = list(local_shape) if stop - start < n <= vocab_size else None
            boxes.append(
                (
                    [start] + [0] * (len(local_shape) - 1),
                    shape,
                    [slice(0, stop - start)] + full[1:],
                    grid,
                )
            )
    else:
        offsets = [0] * len(local_shape)
        offsets[d] = r * n
        boxes.append((offsets, list(local_shape), full, None))
    return boxes, gshape


def _shift_to_experts(
    pname: str,
    local_shape: tuple[int, ...],
    param: torch.Tensor,
    boxes: list[_Box],
    gshape: list[int],
) -> None:
    """An expert-parallel rank's boxes moved (in place) to its experts' rows of the global
    expert axis; nothing for a tensor that holds no experts."""
    shard = getattr(param, "expert_shard", None)
    if shard is None:
        return
    first, total = shard  # (local experts, ...) are rows first.. of the global expert axis
    if not 0 <= first <= first + local_shape[0] <= total:
        raise CheckpointError(
            f"parameter {pname!r}: expert_shard {shard} does not fit its "
            f"{local_shape[0]} local experts"
        )
    gshape[0] = total
    for offsets, *_ in boxes:
        offsets[0] += first


def _stored_pieces(boxes: list[_Box], gshape: list[int], place: Place, dtype: str) -> list[Piece]:
    """The boxes as pieces of the array at `place` (a leading global-layer axis when stacked)."""
    out = []
    for offsets, shape, local, grid in boxes:
        if place.layer_count is not None:  # stacked: leading global-layer axis
            assert place.layer is not None  # a stacked place names its layer
            offsets, shape, gs = [place.layer, *offsets], [1, *shape], [place.layer_count, *gshape]
            grid = [1, *grid] if grid is not None else None
        else:
            gs = gshape
        out.append(
            Piece(
                ShardSpec(
                    place.array,
                    tuple(gs),
                    dtype,
                    tuple(offsets),
                    tuple(shape),
                    tuple(grid) if grid else None,
                    stacked=place.layer_count is not None,
                ),
                tuple(local),
            )
        )
    return out


def local_pieces(
    name: str,
    t: torch.Tensor,
    param: torch.Tensor,
    mesh: Mesh,
    vocab_size: int,
    place: Place,
    reading: bool = False,
) -> tuple[torch.Tensor, list[Piece]]:
    """(the tensor this rank holds of `t`, the boxes it covers): `pieces` of `t` itself, or for a
    DTensor sharded on dim 0 (FSDP2: `torch.chunk` rows of the tensor-parallel shard over the
    mesh dim it names), the boxes of the whole tensor-parallel shard cut to this rank's rows.

    Every box of one array must be a cell of the same grid: the rows are cut into cells of
    gcd(rows per rank, the tensor-parallel box height) rows, which every box boundary is a
    multiple of, except at the array's upper edge (a short last cell says its grid).
    """
    if not isinstance(t, DTensor):
        return t, pieces(name, tuple(t.shape), param, mesh, vocab_size, place, reading, t.dtype)
    shards = [(d, p) for d, p in enumerate(t.placements) if isinstance(p, Shard)]
    if len(shards) != 1 or shards[0][1].dim != 0:
        raise CheckpointError(f"tensor {name!r}: placements {t.placements} are not rows")
    dim = shards[0][0]
    n, ranks = t.shape[0], t.device_mesh.size(dim)
    rows = -(-n // ranks)  # torch.chunk's rows per rank
    lo = min(t.device_mesh.get_local_rank(dim) * rows, n)
    hi = min(lo + rows, n)
    shard = t.to_local()
    if shard.shape[0] != hi - lo:
        raise CheckpointError(
            f"tensor {name!r}: local rows {shard.shape[0]} are not rows {lo}:{hi} of {n}"
        )
    split = tp_split_of(param) if mesh.tp > 1 else None
    whole = pieces(name, tuple(t.shape), param, mesh, vocab_size, place, reading)
    return shard, _cut_rows(whole, lo, hi, n, rows, split is not None and split.halves)


def _cut_rows(whole: list[Piece], lo: int, hi: int, n: int, rows: int, halves: bool) -> list[Piece]:
    """`whole`'s pieces (of an n-row tensor split `rows` a rank; `halves`: its boxes are its two
    halves) cut to rows lo:hi, in cells of gcd(rows, box height) rows, with local slices into
    the rows' own tensor."""
    cell = math.gcd(rows, n // 2 if halves else n)
    out = []
    for pc in whole:
        d = 1 if pc.spec.stacked else 0  # the tensor's dim 0 in the array (after the layer axis)
        a, b, _ = pc.local[0].indices(n)
        for r in range(max(a, lo), min(b, hi), cell):
            e = min(r + cell, b, hi)
            offsets, shape = list(pc.spec.offsets), list(pc.spec.shape)
            offsets[d] += r - a
            shape[d] = e - r
            grid = list(pc.spec.grid_shape)
            grid[d] = cell
            spec = replace(
                pc.spec,
                offsets=tuple(offsets),
                shape=tuple(shape),
                grid=tuple(grid) if grid != shape else None,
            )
            out.append(Piece(spec, (slice(r - lo, e - lo), *pc.local[1:])))
    return out
