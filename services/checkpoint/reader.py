"""Loading checkpoints: list committed steps, read manifests, load tensors or slices, verified.

Only folders whose `manifest.json` parses are checkpoints. Every stored object is checked
against the size and crc32 in the manifest before zarr decodes it: objects are fetched once,
verified, and handed to zarr through an in-memory store, so the bytes decoded are exactly
the bytes verified. `read_tensor` fetches only the shard objects its slice touches (for a
stacked array, one layer's shard), so reading one tensor does not read the rest. `read_box`
of a box that cuts a shard (a load in another layout) fetches only that shard's index and
the inner chunks it needs, with range reads, each checked against its own crc32 in the
manifest (`meshtrain.services.checkpoint.verified`), so a resharded load reads about the bytes it
needs, not whole shards.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Literal, overload

import numpy as np
import torch
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.multiwriter import (
    CHECKSUM,
    DIGEST_FROM_VERSION,
    FORMAT,
    MANIFEST_DIGEST,
    READABLE_VERSIONS,
    data_base,
    manifest_digest,
)
from meshtrain.services.checkpoint.store import (
    MANIFEST_NAME,
    Root,
    join,
    open_root,
    parse_step_dirname,
    read_bytes,
)
from meshtrain.services.checkpoint.verified import (
    check_logical_dtype,
    fetch_verified,
    read_box_direct,
)
from meshtrain.services.common.errors import CheckpointError

Index = Any  # an int, slice, Ellipsis, or a tuple of them (numpy-style basic indexing)


def list_checkpoints(root: str) -> list[int]:
    """Lists the committed checkpoint steps under a root.

    Args:
        root: root URL.

    Returns:
        Steps whose folder holds a complete manifest, ascending. A missing root gives [].
    """
    return _scan(open_root(root))[0]


def _scan(store_root: Root) -> tuple[list[int], dict[int, str]]:
    """One pass over a root: the committed steps (ascending), and the step folders whose
    manifest.json is there but refused, with the reason (ascending)."""
    try:
        entries = store_root.fs.ls(store_root.path, detail=False)
    except FileNotFoundError:
        return [], {}
    steps, refused = [], {}
    for entry in entries:
        step = parse_step_dirname(entry.rstrip("/").rsplit("/", 1)[-1])
        if step is None:
            continue
        try:
            if _load_manifest(store_root, step, strict=True) is not None:
                steps.append(step)
        except CheckpointError as e:
            if _has_manifest(store_root, step):  # else an uncommitted save: not damage
                refused[step] = str(e)
    return sorted(steps), dict(sorted(refused.items()))


def latest_step(root: str) -> int | None:
    """Returns the newest committed step under a root, or None when there is none.

    Args:
        root: root URL.
    """
    steps = list_checkpoints(root)
    return steps[-1] if steps else None


def read_manifest(root: str, step: int) -> dict[str, Any]:
    """Reads the manifest of a committed checkpoint.

    Args:
        root: root URL.
        step: the step.

    Returns:
        The manifest as a dict (see docs/architecture.md, "Checkpoint"; `metadata` is the
        user's dict).

    Raises:
        CheckpointError: the step has no complete manifest (not committed) or it is invalid.
    """
    store_root = open_root(root)
    manifest = _load_manifest(store_root, step, strict=True)
    assert manifest is not None  # strict=True raises instead
    return manifest


def unreadable_manifests(root: str) -> dict[int, str]:
    """Step folders that hold a manifest.json no reader accepts, with the reason.

    A manifest is written whole or not at all (renamed into place, one PUT), so one that is
    there but does not parse, does not match its own digest, or is of a format this version
    cannot read, is damage or a newer writer's: readers pass over such a step as uncommitted,
    and only this tells them apart.

    Args:
        root: root URL.

    Returns:
        Step -> why its manifest was refused.
    """
    return _scan(open_root(root))[1]


def load_checkpoint(
    root: str, step: int | None = None, names: list[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Loads tensors of a committed checkpoint, every object checksum-verified.

    Args:
        root: root URL.
        step: the step; None loads the latest committed one.
        names: tensor names to load; None loads all. Only the shards they need are read.

    Returns:
        (tensor name -> CPU tensor in its logical dtype, the manifest's user metadata).

    Raises:
        CheckpointError: no committed checkpoint, an unknown name, a missing or corrupt object.
    """
    store_root = open_root(root)
    if step is None:
        steps, refused = _scan(store_root)
        step = steps[-1] if steps else None
        newer = {s: why for s, why in refused.items() if step is None or s > step}
        if newer:
            # Loading an older step in silence would resume from the wrong place.
            raise CheckpointError(
                f"the newest checkpoint(s) under {root!r} cannot be read: "
                + "; ".join(newer.values())
                + (f" (pass step={step} to load the newest readable one)" if step else "")
            )
        if step is None:
            raise CheckpointError(f"no committed checkpoint under {root!r}")
    manifest = _load_manifest(store_root, step, strict=True)
    where = _tensor_locations(manifest)
    if names is None:
        wanted = list(where)
    else:
        unknown = sorted(set(names) - set(where))
        if unknown:
            raise CheckpointError(
                f"checkpoint step {step} under {root!r} has no tensors named {unknown}"
            )
        wanted = list(dict.fromkeys(names))

    # array name -> layer indices (or [None]) wanted from it
    per_array: dict[str, list[int | None]] = {}
    for name in wanted:
        array_name, layer = where[name]
        per_array.setdefault(array_name, []).append(layer)

    tensors: dict[str, torch.Tensor] = {}
    for array_name, layers in per_array.items():
        entry = manifest["arrays"][array_name]
        dims = entry["shape"]
        if 0 not in dims and dims:
            # One tensor (one layer) at a time, straight from the verified shard bytes.
            for layer in layers:
                offsets = (0,) * len(dims) if layer is None else (layer,) + (0,) * (len(dims) - 1)
                shape = tuple(dims) if layer is None else (1, *dims[1:])
                direct = read_box_direct(
                    store_root, step, array_name, entry, offsets, shape, data_base(manifest)
                )
                if direct is None:
                    break
                name = entry["tensors"][0 if layer is None else layer]
                tensors[name] = layout.from_stored(
                    direct if layer is None else direct[0], entry["dtype"]
                )
            else:
                continue
        if entry["layer_count"] is None:
            array = _open_verified(
                store_root, step, array_name, entry, _all_region(entry), data_base(manifest)
            )
            tensors[entry["tensors"][0]] = layout.from_stored(array[...], entry["dtype"])
            continue
        region = [[(layer, layer) for layer in set(layers)]] + [None] * (len(entry["shape"]) - 1)
        array = _open_verified(store_root, step, array_name, entry, region, data_base(manifest))
        for layer in layers:
            assert layer is not None  # a stacked array's tensors are all layers
            # One layer at a time: each tensor owns its memory, no full stack held twice.
            tensors[entry["tensors"][layer]] = layout.from_stored(array[layer], entry["dtype"])
    return {name: tensors[name] for name in wanted}, manifest["metadata"]


def read_tensor(
    root: str, step: int, name: str, index: Index = None, manifest: dict[str, Any] | None = None
) -> torch.Tensor:
    """Reads one tensor, or a slice of it, without reading the other tensors.

    Args:
        root: root URL.
        step: the step.
        name: the tensor name (e.g. `layers.3.attention.qkv.weight`).
        index: numpy-style basic index into the tensor (ints, slices, Ellipsis); None = all.
        manifest: the step's manifest from `read_manifest`, when the caller reads many tensors
            (otherwise each call fetches and checks it again: one more request on S3).

    Returns:
        The tensor or slice, on CPU, in its logical dtype.

    Raises:
        CheckpointError: unknown name, index out of range, missing or corrupt object.
    """
    store_root = open_root(root)
    if manifest is None:
        manifest = _load_manifest(store_root, step, strict=True)
    where = _tensor_locations(manifest)
    if name not in where:
        raise CheckpointError(f"checkpoint step {step} under {root!r} has no tensor {name!r}")
    array_name, layer = where[name]
    entry = manifest["arrays"][array_name]
    tensor_shape = entry["shape"][1:] if layer is not None else entry["shape"]
    if index is None and tensor_shape and 0 not in entry["shape"]:
        offsets = (
            (0,) * len(entry["shape"]) if layer is None else (layer,) + (0,) * len(tensor_shape)
        )
        box = tuple(entry["shape"]) if layer is None else (1, *tensor_shape)
        direct = read_box_direct(
            store_root, step, array_name, entry, offsets, box, data_base(manifest)
        )
        if direct is not None:
            return layout.from_stored(direct if layer is None else direct[0], entry["dtype"])
    index = () if index is None else index
    index = index if isinstance(index, tuple) else (index,)
    region = _index_region(index, tensor_shape, name)
    if layer is not None:
        index, region = (layer, *index), [[(layer, layer)], *region]
    array = _open_verified(store_root, step, array_name, entry, region, data_base(manifest))
    try:
        return layout.from_stored(array[index], entry["dtype"])
    except IndexError as e:
        raise CheckpointError(f"bad index {index!r} for tensor {name!r}: {e}") from e


def box_entry(
    root: str,
    step: int,
    manifest: dict[str, Any],
    array: str,
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
) -> dict[str, Any]:
    """The manifest entry of `array`, once the box is known to lie inside it.

    The checks `read_box` makes before it reads: a server sizing its memory for a read calls
    this first, so a bad request gets its own error, not one about the size it claims.

    Args:
        root: root URL (for messages).
        step: the step (for messages).
        manifest: the step's manifest.
        array: the array name.
        offsets: first global index of the box along each dim.
        shape: the box's extent along each dim.

    Returns:
        The array's manifest entry.

    Raises:
        CheckpointError: unknown array, or a box outside the array.
    """
    entry = manifest["arrays"].get(array)
    if entry is None:
        raise CheckpointError(f"checkpoint step {step} under {root!r} has no array {array!r}")
    offsets, shape = tuple(int(o) for o in offsets), tuple(int(s) for s in shape)
    dims = entry["shape"]
    if (
        len(offsets) != len(dims)
        or len(shape) != len(dims)
        or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, shape, dims))
    ):
        raise CheckpointError(
            f"box offsets {offsets} shape {shape} is outside array {array!r} of shape {tuple(dims)}"
        )
    return entry


def read_box(
    root: str,
    step: int,
    array: str,
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
    manifest: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Reads any box of an array, whatever shard grid it was saved with (resharded loads).

    Args:
        root: root URL.
        step: the step.
        array: the array name (e.g. `layers.attention.qkv.weight`).
        offsets: first global index of the box along each dim.
        shape: the box's extent along each dim.
        manifest: the step's manifest from `read_manifest`, when the caller reads many boxes
            of one checkpoint (a restore): saves fetching and parsing it once per box.

    Returns:
        A CPU tensor of shape `shape` in the array's logical dtype; only the shard objects
        the box overlaps are fetched, each checksum-verified.

    Raises:
        CheckpointError: unknown array, a box outside the array, a missing or corrupt object.
    """
    store_root = open_root(root)
    if manifest is None:
        manifest = _load_manifest(store_root, step, strict=True)
    entry = box_entry(root, step, manifest, array, offsets, shape)
    offsets, shape = tuple(int(o) for o in offsets), tuple(int(s) for s in shape)
    if 0 in shape:
        empty = np.zeros(shape, dtype=np.dtype(entry["stored_dtype"]))
        return layout.from_stored(empty, entry["dtype"])
    direct = read_box_direct(store_root, step, array, entry, offsets, shape, data_base(manifest))
    if direct is not None:
        return layout.from_stored(direct, entry["dtype"])
    region = [[(o, o + s - 1)] for o, s in zip(offsets, shape)]
    zarray = _open_verified(store_root, step, array, entry, region, data_base(manifest))
    index = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
    return layout.from_stored(zarray[index], entry["dtype"])


def _has_manifest(root: Root, step: int) -> bool:
    """Whether the folder of `step` holds a manifest.json at all (readable or not)."""
    root.fs.invalidate_cache(root.step_path(step))
    return root.fs.exists(join(root.step_path(step), MANIFEST_NAME))


@overload
def _load_manifest(root: Root, step: int, strict: Literal[True]) -> dict[str, Any]: ...


@overload
def _load_manifest(root: Root, step: int, strict: bool = False) -> dict[str, Any] | None: ...


def _load_manifest(root: Root, step: int, strict: bool = False) -> dict[str, Any] | None:
    """Reads and checks a manifest; None (or CheckpointError when strict) if not committed."""
    path = join(root.step_path(step), MANIFEST_NAME)

    def fail(why: str) -> dict[str, Any] | None:
        if strict:
            raise CheckpointError(f"checkpoint step {step} under {root.url!r}: {why}")
        return None

    try:
        manifest = json.loads(read_bytes(root, path))
    except FileNotFoundError:
        return fail(f"no {MANIFEST_NAME}, so it is not a committed checkpoint")
    except (ValueError, UnicodeDecodeError) as e:
        # A torn or truncated manifest means the save never committed.
        return fail(f"{MANIFEST_NAME} is incomplete or not JSON ({e})")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return fail(f"{MANIFEST_NAME} is not a {FORMAT} manifest")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        return fail(
            f"{MANIFEST_NAME} has format_version {manifest.get('format_version')!r}; "
            f"this reader supports {', '.join(map(str, READABLE_VERSIONS))}"
        )
    if manifest["format_version"] >= DIGEST_FROM_VERSION:
        # Before any field is trusted: an edited step, iteration or dtype must not load.
        try:
            digest = manifest_digest(manifest)
        except (TypeError, ValueError) as e:
            return fail(f"{MANIFEST_NAME} holds values that are not JSON ({e})")
        if manifest.get(MANIFEST_DIGEST) != digest:
            return fail(
                f"{MANIFEST_NAME} does not match its {MANIFEST_DIGEST} (the file was edited or "
                "damaged after the commit), so none of its fields can be trusted; "
                "`meshtrain ckpt verify` names every damaged step"
            )
    try:
        data_base(manifest)
    except CheckpointError as e:
        return fail(str(e))
    if manifest.get("step") != step or manifest.get("checksum") != CHECKSUM:
        return fail(
            f"{MANIFEST_NAME} has step {manifest.get('step')!r} / checksum "
            f"{manifest.get('checksum')!r}, expected {step} / {CHECKSUM}"
        )
    return manifest


def _tensor_locations(manifest: dict[str, Any]) -> dict[str, tuple[str, int | None]]:
    """Tensor name -> (array name, layer index or None), from a manifest."""
    where: dict[str, tuple[str, int | None]] = {}
    for array_name, entry in manifest["arrays"].items():
        for i, tensor in enumerate(entry["tensors"]):
            where[tensor] = (array_name, i if entry["layer_count"] is not None else None)
    return where


def _all_region(entry: dict[str, Any]) -> list[list[tuple[int, int]] | None]:
    return [None] * len(entry["shape"])


def _index_region(index: tuple, shape: list[int], name: str) -> list[list[tuple[int, int]] | None]:
    """Per dim, the inclusive (first, last) element spans a basic index touches.

    None means all of the dim (or an index kind we do not analyse). Only used to pick which
    shard objects to fetch, so zarr still does the real indexing.
    """
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise CheckpointError(f"index {index!r} for tensor {name!r} has more than one Ellipsis")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:at] + (slice(None),) * max(fill, 0) + index[at + 1 :]
    if len(index) > len(shape):
        raise CheckpointError(
            f"index {index!r} has {len(index)} dims but tensor {name!r} has shape {tuple(shape)}"
        )
    region: list[list[tuple[int, int]] | None] = []
    for i, size in zip(index, shape):
        if isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)):
            if not -size <= i < size:
                raise CheckpointError(
                    f"index {i} out of range for dim of size {size} of tensor {name!r}"
                )
            region.append([(int(i) % size,) * 2])
        elif isinstance(i, slice):
            selected = range(*i.indices(size))
            region.append([(min(selected), max(selected))] if selected else [])
        else:
            region.append(None)
    return region + [None] * (len(shape) - len(region))


def _shard_keys(entry: dict[str, Any], region: list[list[tuple[int, int]] | None]) -> list[str]:
    """Object keys (relative to the array) of the shards that cover `region`."""
    shape = entry["shape"]
    if not shape:
        return ["c"]  # 0-d arrays are one unsharded chunk
    if 0 in shape:
        return []  # zero-size arrays store no chunk objects
    outer = entry["shards"] or entry["chunks"]
    per_dim = []
    for size, step, spans in zip(shape, outer, region):
        spans = [(0, size - 1)] if spans is None else spans
        coords: set[int] = set()
        for first, last in spans:
            coords.update(range(first // step, last // step + 1))
        per_dim.append(sorted(coords))
    return ["c/" + "/".join(map(str, coords)) for coords in itertools.product(*per_dim)]


def _open_verified(
    root: Root, step: int, array_name: str, entry: dict[str, Any], region: list, base: str = ""
) -> zarr.Array:
    """Fetches the array's metadata and the shards covering `region`, verifies, opens them.

    Returns:
        A read-only zarr array over an in-memory copy of the verified objects; shards outside
        `region` are absent from it, so only index inside `region`.
    """
    prototype = default_buffer_prototype()
    contents: dict[str, Any] = {}

    def fetch(key: str) -> None:
        contents[f"{array_name}/{key}"] = prototype.buffer.from_bytes(
            fetch_verified(root, step, array_name, entry["objects"], key, base=base)
        )

    # Metadata first: the shard keys below come from the manifest, which must agree with it.
    fetch("zarr.json")
    array = zarr.open_array(MemoryStore(dict(contents), read_only=True), path=array_name, mode="r")
    check_logical_dtype(root, step, array_name, entry, dict(array.attrs))
    if list(array.shape) != entry["shape"] or array.dtype != np.dtype(entry["stored_dtype"]):
        raise CheckpointError(
            f"array {array_name!r} (step {step} under {root.url!r}) is stored with shape "
            f"{array.shape} dtype {array.dtype}, manifest says {entry['shape']} "
            f"{entry['stored_dtype']}"
        )
    for key in _shard_keys(entry, region):
        fetch(key)
    return zarr.open_array(MemoryStore(contents, read_only=True), path=array_name, mode="r")
