"""Loading checkpoints: list committed steps, read manifests, load tensors or slices, verified.

Only folders whose `manifest.json` parses are checkpoints. Every stored object is checked
against the size and crc32 in the manifest before zarr decodes it: objects are fetched once,
verified, and handed to zarr through an in-memory store, so the bytes decoded are exactly
the bytes verified. `read_tensor` fetches only the shard objects its slice touches (for a
stacked array, one layer's shard), so reading one tensor does not read the rest. `read_box`
of a box that cuts a shard (a load in another layout) fetches only that shard's index and
the inner chunks it needs, with range reads, each checked against its own crc32 in the
manifest, so a resharded load reads about the bytes it needs, not whole shards.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import numpy as np
import torch
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from services.checkpoint import layout
from services.checkpoint.sharded import (
    CHECKSUM,
    CHUNK_CHECKSUMS,
    FORMAT,
    INDEX_CHECKSUM,
    READABLE_VERSIONS,
    checksum,
)
from services.checkpoint.shards import EMPTY_CHUNK, index_nbytes
from services.checkpoint.store import (
    MANIFEST_NAME,
    Root,
    join,
    open_root,
    parse_step_dirname,
    read_bytes,
)
from services.common.errors import CheckpointError

Index = Any  # an int, slice, Ellipsis, or a tuple of them (numpy-style basic indexing)


def list_checkpoints(root: str) -> list[int]:
    """Lists the committed checkpoint steps under a root.

    Args:
        root: root URL.

    Returns:
        Steps whose folder holds a complete manifest, ascending. A missing root gives [].
    """
    store_root = open_root(root)
    try:
        entries = store_root.fs.ls(store_root.path, detail=False)
    except FileNotFoundError:
        return []
    steps = []
    for entry in entries:
        step = parse_step_dirname(entry.rstrip("/").rsplit("/", 1)[-1])
        if step is not None and _load_manifest(store_root, step) is not None:
            steps.append(step)
    return sorted(steps)


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
        The manifest as a dict (see DESIGN.md "Checkpoint"; `metadata` is the user's dict).

    Raises:
        CheckpointError: the step has no complete manifest (not committed) or it is invalid.
    """
    store_root = open_root(root)
    manifest = _load_manifest(store_root, step, strict=True)
    assert manifest is not None  # strict=True raises instead
    return manifest


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
        step = latest_step(root)
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
                direct = _read_box_direct(store_root, step, array_name, entry, offsets, shape)
                if direct is None:
                    break
                name = entry["tensors"][0 if layer is None else layer]
                tensors[name] = layout.from_stored(direct if layer is None else direct[0], entry["dtype"])
            else:
                continue
        if entry["layer_count"] is None:
            array = _open_verified(store_root, step, array_name, entry, _all_region(entry))
            tensors[entry["tensors"][0]] = layout.from_stored(array[...], entry["dtype"])
            continue
        region = [[(layer, layer) for layer in set(layers)]] + [None] * (len(entry["shape"]) - 1)
        array = _open_verified(store_root, step, array_name, entry, region)
        for layer in layers:
            # One layer at a time: each tensor owns its memory, no full stack held twice.
            tensors[entry["tensors"][layer]] = layout.from_stored(array[layer], entry["dtype"])
    return {name: tensors[name] for name in wanted}, manifest["metadata"]


def read_tensor(root: str, step: int, name: str, index: Index = None) -> torch.Tensor:
    """Reads one tensor, or a slice of it, without reading the other tensors.

    Args:
        root: root URL.
        step: the step.
        name: the tensor name (e.g. `layers.3.attention.qkv.weight`).
        index: numpy-style basic index into the tensor (ints, slices, Ellipsis); None = all.

    Returns:
        The tensor or slice, on CPU, in its logical dtype.

    Raises:
        CheckpointError: unknown name, index out of range, missing or corrupt object.
    """
    store_root = open_root(root)
    manifest = _load_manifest(store_root, step, strict=True)
    where = _tensor_locations(manifest)
    if name not in where:
        raise CheckpointError(f"checkpoint step {step} under {root!r} has no tensor {name!r}")
    array_name, layer = where[name]
    entry = manifest["arrays"][array_name]
    tensor_shape = entry["shape"][1:] if layer is not None else entry["shape"]
    if index is None and tensor_shape and 0 not in entry["shape"]:
        offsets = (0,) * len(entry["shape"]) if layer is None else (layer,) + (0,) * len(tensor_shape)
        box = tuple(entry["shape"]) if layer is None else (1, *tensor_shape)
        direct = _read_box_direct(store_root, step, array_name, entry, offsets, box)
        if direct is not None:
            return layout.from_stored(direct if layer is None else direct[0], entry["dtype"])
    index = () if index is None else index
    index = index if isinstance(index, tuple) else (index,)
    region = _index_region(index, tensor_shape, name)
    if layer is not None:
        index, region = (layer, *index), [[(layer, layer)], *region]
    array = _open_verified(store_root, step, array_name, entry, region)
    try:
        return layout.from_stored(array[index], entry["dtype"])
    except IndexError as e:
        raise CheckpointError(f"bad index {index!r} for tensor {name!r}: {e}") from e


def read_box(
    root: str, step: int, array: str, offsets: tuple[int, ...], shape: tuple[int, ...],
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
    entry = manifest["arrays"].get(array)
    if entry is None:
        raise CheckpointError(f"checkpoint step {step} under {root!r} has no array {array!r}")
    offsets, shape = tuple(int(o) for o in offsets), tuple(int(s) for s in shape)
    dims = entry["shape"]
    if len(offsets) != len(dims) or len(shape) != len(dims) or any(
        o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, shape, dims)
    ):
        raise CheckpointError(
            f"box offsets {offsets} shape {shape} is outside array {array!r} of shape {tuple(dims)}"
        )
    if 0 in shape:
        empty = np.zeros(shape, dtype=np.dtype(entry["stored_dtype"]))
        return layout.from_stored(empty, entry["dtype"])
    direct = _read_box_direct(store_root, step, array, entry, offsets, shape)
    if direct is not None:
        return layout.from_stored(direct, entry["dtype"])
    region = [[(o, o + s - 1)] for o, s in zip(offsets, shape)]
    zarray = _open_verified(store_root, step, array, entry, region)
    index = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
    return layout.from_stored(zarray[index], entry["dtype"])


def _load_manifest(root: Root, step: int, strict: bool = False) -> dict[str, Any] | None:
    """Reads and checks a manifest; None (or CheckpointError when strict) if not committed."""
    path = join(root.step_path(step), MANIFEST_NAME)

    def fail(why: str) -> None:
        if strict:
            raise CheckpointError(f"checkpoint step {step} under {root.url!r}: {why}")

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
    if manifest.get("step") != step or manifest.get("checksum") != CHECKSUM:
        return fail(f"{MANIFEST_NAME} has step {manifest.get('step')!r} / checksum "
                    f"{manifest.get('checksum')!r}, expected {step} / {CHECKSUM}")
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


def _index_region(
    index: tuple, shape: list[int], name: str
) -> list[list[tuple[int, int]] | None]:
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
        coords = set()
        for first, last in spans:
            coords.update(range(first // step, last // step + 1))
        per_dim.append(sorted(coords))
    return ["c/" + "/".join(map(str, coords)) for coords in itertools.product(*per_dim)]


def fetch_verified(root: Root, step: int, array_name: str, objects: dict[str, Any], key: str,
                   chunks: bool = False) -> bytes:
    """One stored object, checked against the size and checksum its manifest entry lists.

    Args:
        root: the opened root.
        step: the step.
        array_name: the array holding the object ("" for the checkpoint's own objects).
        objects: the manifest's object table for that array (key -> size, checksums).
        key: the object's key inside the array (e.g. `c/3/0/0`, `zarr.json`).
        chunks: also check the per-chunk and index checksums the manifest lists for a shard
            (what partial reads rely on); `ckpt verify` does.

    Raises:
        CheckpointError: naming the array and object: unlisted, missing, or corrupt.
    """
    where = _where(root, step, array_name, key)
    expected = objects.get(key)
    if expected is None:
        raise CheckpointError(f"{where} is not listed in the manifest")
    try:
        data = read_bytes(root, join(root.step_path(step), array_name, key))
    except FileNotFoundError as e:
        raise CheckpointError(f"{where} is missing") from e
    _check_object(where, data, expected)
    if chunks and CHUNK_CHECKSUMS in expected:
        index = _check_index(where, data[len(data) - index_nbytes(len(expected[CHUNK_CHECKSUMS])):],
                             expected)
        view = memoryview(data)
        for i, (off, nbytes) in enumerate(index):
            if off != EMPTY_CHUNK:
                _check_chunk(where, i, view[off:off + nbytes], expected)
    return data


def _where(root: Root, step: int, array_name: str, key: str) -> str:
    where = f"array {array_name!r} object {key!r}" if array_name else f"object {key!r}"
    return where + f" (step {step} under {root.url!r})"


def _check_object(where: str, data: bytes, expected: dict[str, Any]) -> None:
    if len(data) != expected["size"] or checksum(data) != expected[CHECKSUM]:
        raise CheckpointError(
            f"{where} is corrupt: {len(data)} bytes with {CHECKSUM} {checksum(data):#010x}, "
            f"manifest says {expected['size']} bytes with {expected[CHECKSUM]:#010x}"
        )


def _check_index(where: str, data: bytes, expected: dict[str, Any]) -> list[tuple[int, int]]:
    """The verified (offset, nbytes) of each inner chunk from a shard's index bytes."""
    n = len(expected[CHUNK_CHECKSUMS])
    if len(data) != index_nbytes(n) or checksum(data) != expected[INDEX_CHECKSUM]:
        raise CheckpointError(
            f"{where} is corrupt: its shard index has {CHECKSUM} {checksum(data):#010x}, "
            f"manifest says {expected[INDEX_CHECKSUM]:#010x}"
        )
    pairs = np.frombuffer(data, dtype="<u8", count=2 * n).reshape(n, 2).tolist()
    body = expected["size"] - index_nbytes(n)
    for i, (off, nbytes) in enumerate(pairs):
        if off != EMPTY_CHUNK and off + nbytes > body:
            raise CheckpointError(f"{where} is corrupt: chunk {i} lies outside the object")
    return pairs


def _check_chunk(where: str, i: int, data: bytes | memoryview, expected: dict[str, Any],
                 coords: tuple[int, ...] | None = None) -> None:
    want = expected[CHUNK_CHECKSUMS][i]
    if want is None or checksum(data) != want:
        name = f"chunk {i}" if coords is None else f"chunk {i} {coords}"
        raise CheckpointError(
            f"{where} {name} is corrupt: {CHECKSUM} {checksum(data):#010x}, manifest says "
            f"{'no chunk there' if want is None else f'{want:#010x}'}"
        )


# The codec pipeline meshtrain writes: uncompressed little-endian inner chunks in shards with
# the index at the end. For it, `_read_box_direct` decodes without zarr.
_PLAIN_INNER = [{"name": "bytes", "configuration": {"endian": "little"}}]
_PLAIN_INDEX = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
# Fetched bytes a box read holds at once on an object store: one batch of shards / chunk runs,
# fetched concurrently and copied into the output before the next batch. A local disk gains
# nothing from concurrency and loses to fresh allocations (a 64 MiB batch read 2.7x slower
# than one shard at a time), so there a batch is one shard.
_BATCH_BYTES = 64 * 2**20


class _NotPlain(Exception):
    """The shard is not in meshtrain's plain layout after all: let zarr decode it."""


def _read_box_direct(root: Root, step: int, array_name: str, entry: dict[str, Any],
                     offsets: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray | None:
    """Reads a box straight out of verified shard bytes (None: not meshtrain's plain layout).

    A shard the box covers whole is fetched whole and checked against the object's crc32.
    Of a shard the box cuts (a resharded load), only its index and the inner chunks the box
    touches are fetched, with range reads (adjacent chunks in one), each checked against the
    crc32 the manifest lists for it (format 2; a version 1 manifest lists none, so whole
    shards are fetched). On object stores shards are fetched in batches of about
    `_BATCH_BYTES`, all ranges of a batch in one (concurrent) `cat_ranges` call; each inner chunk is a view of the fetched bytes copied
    once into the output (zarr would hold the bytes, its chunk buffers and the output).
    """
    meta = json.loads(fetch_verified(root, step, array_name, entry["objects"], "zarr.json"))
    codecs = meta.get("codecs", [])
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed" or not shape:
        return None
    conf = codecs[0]["configuration"]
    if (conf.get("codecs") != _PLAIN_INNER or conf.get("index_codecs") != _PLAIN_INDEX
            or conf.get("index_location", "end") != "end"
            or list(meta["shape"]) != list(entry["shape"])
            or np.dtype(meta["data_type"]) != np.dtype(entry["stored_dtype"])):
        return None
    outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
    inner = conf["chunk_shape"]
    per_shard = [o // i for o, i in zip(outer, inner)]
    n_inner = math.prod(per_shard)
    dtype = np.dtype(entry["stored_dtype"])
    chunk_nbytes = math.prod(inner) * dtype.itemsize
    out = np.empty(shape, dtype=dtype)
    end = [o + s for o, s in zip(offsets, shape)]

    def place(shard: tuple[int, ...], sub: tuple[int, ...], data: memoryview | None) -> None:
        """Copies the part of inner chunk `sub` of `shard` inside the box into `out`."""
        start = [c * g + s * i for c, g, s, i in zip(shard, outer, sub, inner)]
        lo = [max(a, b) for a, b in zip(start, offsets)]
        hi = [min(a + i, b) for a, i, b in zip(start, inner, end)]
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
        if data is None:
            out[dst] = meta.get("fill_value", 0)
            return
        if data.nbytes != chunk_nbytes:
            raise _NotPlain
        chunk = np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(inner)
        out[dst] = chunk[tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))]

    # (key, shard coords, inner chunks the box touches, whether to fetch just those)
    plans: list[tuple[str, tuple[int, ...], list[tuple[int, ...]], bool]] = []
    batch_bytes = 0

    def run_batch() -> None:
        _fetch_and_place(root, step, array_name, entry, plans, per_shard, chunk_nbytes, place)
        plans.clear()

    shard_ranges = [range(o // g, (e - 1) // g + 1) for o, e, g in zip(offsets, end, outer)]
    try:
        for shard in itertools.product(*shard_ranges):
            key = "c/" + "/".join(map(str, shard))
            origin = [c * g for c, g in zip(shard, outer)]
            inner_ranges = [range(max(o, so) // i - so // i, (min(e, so + g) - 1) // i - so // i + 1)
                            for o, e, so, g, i in zip(offsets, end, origin, outer, inner)]
            needed = list(itertools.product(*inner_ranges))
            obj = entry["objects"].get(key, {})
            crcs = obj.get(CHUNK_CHECKSUMS)
            partial = (crcs is not None and len(crcs) == n_inner
                       and len(needed) < sum(c is not None for c in crcs))
            plans.append((key, shard, needed, partial))
            batch_bytes += len(needed) * chunk_nbytes if partial else obj.get("size", 0)
            if batch_bytes >= (0 if root.is_local else _BATCH_BYTES):
                run_batch()
                batch_bytes = 0
        if plans:
            run_batch()
    except _NotPlain:
        return None
    return out


def _fetch_and_place(root: Root, step: int, array_name: str, entry: dict[str, Any],
                     plans: list, per_shard: list[int], chunk_nbytes: int, place) -> None:
    """Fetches one batch of `_read_box_direct`'s shards, verifies every byte, places the chunks."""
    objects = entry["objects"]
    folder = join(root.step_path(step), array_name)
    n_inner = math.prod(per_shard)

    def fetch(keys: list[str], starts: list, ends: list) -> list[bytes]:
        for key in keys:
            if key not in objects:
                raise CheckpointError(f"{_where(root, step, array_name, key)} is not listed in the manifest")
        found = root.fs.cat_ranges([join(folder, k) for k in keys], starts, ends) if keys else []
        for key, data in zip(keys, found):
            if isinstance(data, FileNotFoundError):
                raise CheckpointError(f"{_where(root, step, array_name, key)} is missing") from data
            if isinstance(data, Exception):
                raise data
        return found

    # Round 1: the indexes of the shards read in part (where their chunks lie).
    partial = [p for p in plans if p[3]]
    sizes = [objects[key]["size"] if key in objects else 0 for key, *_ in partial]
    index_bytes = fetch([p[0] for p in partial], [s - index_nbytes(n_inner) for s in sizes], sizes)
    indexes = {key: _check_index(_where(root, step, array_name, key), data, objects[key])
               for (key, *_), data in zip(partial, index_bytes)}

    # Round 2: whole shards, and runs of adjacent needed chunks of the others.
    keys, starts, ends = [], [], []
    jobs: list[tuple[tuple[int, ...], list, list | None]] = []  # (shard, needed, run or None)

    def add(key: str, start: int | None, stop: int | None, job: tuple) -> None:
        keys.append(key), starts.append(start), ends.append(stop), jobs.append(job)

    for key, shard, needed, is_partial in plans:
        if not is_partial:
            add(key, None, None, (shard, needed, None))
            continue
        index = indexes[key]
        located = sorted((index[i][0], i, sub) for sub in needed
                         for i in [int(np.ravel_multi_index(sub, per_shard))])
        run: list = []
        for off, i, sub in located + [(None, None, None)]:
            if run and (off is None or off != run[-1][0] + index[run[-1][1]][1]):
                add(key, run[0][0], run[-1][0] + index[run[-1][1]][1], (shard, needed, run))
                run = []
            if off == EMPTY_CHUNK:
                place(shard, sub, None)
            elif off is not None:
                run.append((off, i, sub))
    found = fetch(keys, starts, ends)

    for key, data, (shard, needed, run) in zip(keys, found, jobs):
        where = _where(root, step, array_name, key)
        view = memoryview(data)
        if run is None:  # a whole shard: one checksum covers it, its index included
            _check_object(where, data, objects[key])
            body = len(data) - index_nbytes(n_inner)
            if body < 0:
                raise _NotPlain
            index = np.frombuffer(data, dtype="<u8", count=2 * n_inner, offset=body).reshape(n_inner, 2)
            for sub in needed:
                off, nbytes = (int(v) for v in index[int(np.ravel_multi_index(sub, per_shard))])
                place(shard, sub, None if off == EMPTY_CHUNK else view[off:off + nbytes])
            continue
        base = run[0][0]
        for off, i, sub in run:
            chunk = view[off - base:off - base + indexes[key][i][1]]
            _check_chunk(where, i, chunk, objects[key], sub)
            place(shard, sub, chunk)


def _open_verified(
    root: Root, step: int, array_name: str, entry: dict[str, Any], region: list
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
            fetch_verified(root, step, array_name, entry["objects"], key))

    # Metadata first: the shard keys below come from the manifest, which must agree with it.
    fetch("zarr.json")
    array = zarr.open_array(MemoryStore(dict(contents), read_only=True), path=array_name, mode="r")
    if list(array.shape) != entry["shape"] or array.dtype != np.dtype(entry["stored_dtype"]):
        raise CheckpointError(
            f"array {array_name!r} (step {step} under {root.url!r}) is stored with shape "
            f"{array.shape} dtype {array.dtype}, manifest says {entry['shape']} {entry['stored_dtype']}"
        )
    for key in _shard_keys(entry, region):
        fetch(key)
    return zarr.open_array(MemoryStore(contents, read_only=True), path=array_name, mode="r")
