"""Verified reads of stored objects, and box reads straight out of meshtrain's shard layout.

Every byte a reader decodes is first checked against the manifest: `fetch_verified` checks a
whole object's size and crc32 (and, for `ckpt verify`, its shard index and every inner chunk);
`read_box_direct` decodes a box from shards in meshtrain's plain layout (uncompressed inner
chunks, index at the end) without zarr, fetching whole shards the box covers and, of a shard
the box only cuts, just its index and the inner chunks it needs (range reads, each chunk
checked against its own crc32), so a load in another layout reads about the bytes it needs.
`meshtrain.services.checkpoint.reader` is the public API over these.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import numpy as np

from meshtrain.services.checkpoint.boxes import EMPTY_CHUNK, index_nbytes
from meshtrain.services.checkpoint.crc import checksum
from meshtrain.services.checkpoint.multiwriter import (
    CHECKSUM,
    CHUNK_CHECKSUMS,
    INDEX_CHECKSUM,
    data_path,
)
from meshtrain.services.checkpoint.store import Root, join, read_bytes
from meshtrain.services.common.errors import CheckpointError


def fetch_verified(
    root: Root,
    step: int,
    array_name: str,
    objects: dict[str, Any],
    key: str,
    chunks: bool = False,
    base: str = "",
) -> bytes:
    """One stored object, checked against the size and checksum its manifest entry lists.

    Args:
        root: the opened root.
        step: the step.
        array_name: the array holding the object ("" for the checkpoint's own objects).
        objects: the manifest's object table for that array (key -> size, checksums).
        key: the object's key inside the array (e.g. `c/3/0/0`, `zarr.json`).
        chunks: also check the per-chunk and index checksums the manifest lists for a shard
            (what partial reads rely on); `ckpt verify` does.
        base: where the step's arrays are in its folder (`multiwriter.data_base` of the manifest).

    Raises:
        CheckpointError: naming the array and object: unlisted, missing, or corrupt.
    """
    where = _where(root, step, array_name, key)
    expected = objects.get(key)
    if expected is None:
        raise CheckpointError(f"{where} is not listed in the manifest")
    try:
        data = read_bytes(root, join(data_path(root, step, base), array_name, key))
    except FileNotFoundError as e:
        raise CheckpointError(f"{where} is missing") from e
    _check_object(where, data, expected)
    if chunks and CHUNK_CHECKSUMS in expected:
        index = _check_index(
            where, data[len(data) - index_nbytes(len(expected[CHUNK_CHECKSUMS])) :], expected
        )
        view = memoryview(data)
        for i, (off, nbytes) in enumerate(index):
            if off != EMPTY_CHUNK:
                _check_chunk(where, i, view[off : off + nbytes], expected)
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


def _check_index(where: str, data: bytes, expected: dict[str, Any]) -> list[list[int]]:
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


def _check_chunk(
    where: str,
    i: int,
    data: bytes | memoryview,
    expected: dict[str, Any],
    coords: tuple[int, ...] | None = None,
) -> None:
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
# nothing from concurrency and loses to fresh allocations (measured: BENCHMARKS.md,
# 'Checkpoints: persist, load and stall'), so there a batch is one shard.
_BATCH_BYTES = 64 * 2**20


class _NotPlain(Exception):
    """The shard is not in meshtrain's plain layout after all: let zarr decode it."""


def check_logical_dtype(
    root: Root, step: int, array_name: str, entry: dict[str, Any], attributes: dict[str, Any]
) -> None:
    """Raises CheckpointError when the manifest's dtype of an array is not the one its zarr
    metadata records: the same stored bits read as another dtype would load garbage quietly."""
    logical = attributes.get("logical_dtype")
    if logical is not None and logical != entry["dtype"]:
        raise CheckpointError(
            f"array {array_name!r} (step {step} under {root.url!r}) holds {logical} values, "
            f"manifest says {entry['dtype']}"
        )


def read_box_direct(
    root: Root,
    step: int,
    array_name: str,
    entry: dict[str, Any],
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
    base: str = "",
) -> np.ndarray | None:
    """Reads a box straight out of verified shard bytes (None: not meshtrain's plain layout).

    `base`: where the step's arrays are in its folder (`multiwriter.data_base` of the manifest).

    A shard the box covers whole is fetched whole and checked against the object's crc32. Of a shard
    the box cuts (a resharded load), only its index and the inner chunks the box touches are
    fetched, with range reads (adjacent chunks in one), each checked against the crc32 the manifest
    lists for it (format 2; a version 1 manifest lists none, so whole shards are fetched). On object
    stores shards are fetched in batches of about `_BATCH_BYTES`, all ranges of a batch in one
    (concurrent) `cat_ranges` call; each inner chunk is a view of the fetched bytes copied once into
    the output (zarr would hold the bytes, its chunk buffers and the output).
    """
    meta = json.loads(
        fetch_verified(root, step, array_name, entry["objects"], "zarr.json", base=base)
    )
    check_logical_dtype(root, step, array_name, entry, (meta.get("attributes") or {}))
    codecs = meta.get("codecs", [])
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed" or not shape:
        return None
    conf = codecs[0]["configuration"]
    if (
        conf.get("codecs") != _PLAIN_INNER
        or conf.get("index_codecs") != _PLAIN_INDEX
        or conf.get("index_location", "end") != "end"
        or list(meta["shape"]) != list(entry["shape"])
        or np.dtype(meta["data_type"]) != np.dtype(entry["stored_dtype"])
    ):
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
        _fetch_and_place(root, step, array_name, entry, plans, per_shard, chunk_nbytes, place, base)
        plans.clear()

    shard_ranges = [range(o // g, (e - 1) // g + 1) for o, e, g in zip(offsets, end, outer)]
    try:
        for shard in itertools.product(*shard_ranges):
            key = "c/" + "/".join(map(str, shard))
            origin = [c * g for c, g in zip(shard, outer)]
            inner_ranges = [
                range(max(o, so) // i - so // i, (min(e, so + g) - 1) // i - so // i + 1)
                for o, e, so, g, i in zip(offsets, end, origin, outer, inner)
            ]
            needed = list(itertools.product(*inner_ranges))
            obj = entry["objects"].get(key, {})
            crcs = obj.get(CHUNK_CHECKSUMS)
            partial = (
                crcs is not None
                and len(crcs) == n_inner
                and len(needed) < sum(c is not None for c in crcs)
            )
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


def _fetch_and_place(
    root: Root,
    step: int,
    array_name: str,
    entry: dict[str, Any],
    plans: list,
    per_shard: list[int],
    chunk_nbytes: int,
    place,
    base: str = "",
) -> None:
    """Fetches one batch of `_read_box_direct`'s shards, verifies every byte, places the chunks."""
    objects = entry["objects"]
    folder = join(data_path(root, step, base), array_name)
    n_inner = math.prod(per_shard)

    def fetch(keys: list[str], starts: list, ends: list) -> list[bytes]:
        for key in keys:
            if key not in objects:
                raise CheckpointError(
                    f"{_where(root, step, array_name, key)} is not listed in the manifest"
                )
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
    indexes = {
        key: _check_index(_where(root, step, array_name, key), data, objects[key])
        for (key, *_), data in zip(partial, index_bytes)
    }

    # Round 2: whole shards, and runs of adjacent needed chunks of the others.
    keys, starts, ends = [], [], []
    jobs: list[tuple[tuple[int, ...], list, list | None]] = []  # (shard, needed, run or None)

    def add(key: str, start: int | None, stop: int | None, job: tuple) -> None:
        keys.append(key)
        starts.append(start)
        ends.append(stop)
        jobs.append(job)

    for key, shard, needed, is_partial in plans:
        if not is_partial:
            add(key, None, None, (shard, needed, None))
            continue
        index = indexes[key]
        located = sorted(
            (index[i][0], i, sub)
            for sub in needed
            for i in [int(np.ravel_multi_index(sub, per_shard))]
        )
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

    for key, data, (shard, needed, chunks) in zip(keys, found, jobs):
        where = _where(root, step, array_name, key)
        view = memoryview(data)
        if chunks is None:  # a whole shard: one checksum covers it, its index included
            _check_object(where, data, objects[key])
            body = len(data) - index_nbytes(n_inner)
            if body < 0:
                raise _NotPlain
            whole = np.frombuffer(data, dtype="<u8", count=2 * n_inner, offset=body).reshape(
                n_inner, 2
            )  # (chunks, 2): offset, nbytes
            for sub in needed:
                off, nbytes = (int(v) for v in whole[int(np.ravel_multi_index(sub, per_shard))])
                place(shard, sub, None if off == EMPTY_CHUNK else view[off : off + nbytes])
            continue
        base = chunks[0][0]
        for off, i, sub in chunks:
            chunk = view[off - base : off - base + indexes[key][i][1]]
            _check_chunk(where, i, chunk, objects[key], sub)
            place(shard, sub, chunk)
