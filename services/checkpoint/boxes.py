"""Boxes of global arrays: the unit a writer owns, how it is encoded, and how boxes must tile.

A `ShardSpec` names a box of one checkpoint array in global, layout-independent coordinates
(e.g. tensor-parallel rank 1 of 2 owns rows 768:1536 of the stacked
`layers.attention.qkv.weight` at layer 3: offsets (3, 768, 0), shape (1, 768, 1024)). The box
shape is the array's zarr shard shape (its "grid"), so every box is exactly one stored object
and writers never touch each other's objects. Boxes at the upper edge of an array may be
shorter than the grid; they say so with `grid`. This module is pure computation (encoding into
bytes in memory, tiling checks); `multiwriter.py` does the storage I/O.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import google_crc32c
import numpy as np
import zarr
from zarr.storage import MemoryStore

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.crc import checksum, crc32_combine
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.sanitize import loggable


@dataclass(frozen=True)
class ShardSpec:
    """One box of a global array that one writer owns.

    Attributes:
        array: the array name (e.g. `layers.attention.qkv.weight`).
        global_shape: shape of the whole array.
        dtype: logical dtype name ("bfloat16", "float32", ...).
        offsets: first global index of the box along each dim.
        shape: the box's extent along each dim.
        grid: the array's shard shape when this box is cut short at the array's upper edge;
            None means the box shape is the grid.
        stacked: whether dim 0 is the global-layer axis (tensor `layers.<i>.<rest>` is
            slice i); None infers it from the name (a `layers` component not followed by a
            layer number, as `layout.array_key` produces).
    """

    array: str
    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    grid: tuple[int, ...] | None = None
    stacked: bool | None = None

    def __post_init__(self) -> None:
        for field in ("global_shape", "offsets", "shape"):
            object.__setattr__(self, field, tuple(int(d) for d in getattr(self, field)))
        if self.grid is not None:
            object.__setattr__(self, "grid", tuple(int(d) for d in self.grid))
        validate(self)

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """The array's shard shape (the box shape unless the box is cut at an edge)."""
        return self.grid if self.grid is not None else self.shape

    @property
    def coords(self) -> tuple[int, ...]:
        """This box's position in the array's shard grid."""
        return tuple(o // max(1, g) for o, g in zip(self.offsets, self.grid_shape))

    @property
    def key(self) -> str:
        """Object key of this box relative to the array folder (zarr's default encoding)."""
        if not self.global_shape:
            return "c"
        return "c/" + "/".join(map(str, self.coords))

    @property
    def is_stacked(self) -> bool:
        """Whether dim 0 is the global-layer axis."""
        if self.stacked is not None:
            return self.stacked
        parts = self.array.split(".")
        return bool(self.global_shape) and any(
            p == "layers" and not parts[i + 1].isdigit() for i, p in enumerate(parts[:-1])
        )

    def slices(self) -> tuple[slice, ...]:
        """The box as a tuple of global slices."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))


# Dims of an array (numpy's limit), and elements of one: numpy and zarr index with int64.
MAX_NDIM = 32
MAX_ELEMENTS = 2**62


def validate(spec: ShardSpec) -> None:
    """Raises CheckpointError naming the array unless `spec` is a well-formed box: inside its
    array, aligned to a shard grid that fits the array (no shard larger than the array along a
    dim of nonzero size), every size bounded (at most `MAX_NDIM` dims, `MAX_ELEMENTS` elements).

    Args:
        spec: the box.
    """
    layout.check_name(spec.array)
    if len(spec.global_shape) > MAX_NDIM:
        raise CheckpointError(
            f"array {spec.array!r}: {len(spec.global_shape)} dims, over the limit of {MAX_NDIM}"
        )
    where = f"box {spec.offsets}+{spec.shape} of array {spec.array!r}"
    if spec.dtype not in layout._DTYPES:
        raise CheckpointError(f"{where}: dtype {loggable(spec.dtype, 40)} is not supported")
    if any(n < 0 for n in spec.global_shape) or math.prod(spec.global_shape) > MAX_ELEMENTS:
        raise CheckpointError(
            f"{where}: global shape {spec.global_shape} must be sizes >= 0 of at most "
            f"{MAX_ELEMENTS} elements in all"
        )
    ndim = len(spec.global_shape)
    if len(spec.offsets) != ndim or len(spec.shape) != ndim:
        raise CheckpointError(
            f"{where}: offsets and shape must have {ndim} dims like global shape "
            f"{spec.global_shape}"
        )
    if spec.stacked and (not ndim or "layers" not in spec.array.split(".")[:-1]):
        raise CheckpointError(
            f"{where}: stacked=True needs a `layers` component in the name (its tensors are "
            "named by putting the layer number after it) and a leading layer dim"
        )
    grid = spec.grid_shape
    if len(grid) != ndim:
        raise CheckpointError(f"{where}: grid {grid} must have {ndim} dims")
    for d, (o, s, g, n) in enumerate(zip(spec.offsets, spec.shape, grid, spec.global_shape)):
        if n < 0 or o < 0 or s < 0 or o + s > n:
            raise CheckpointError(
                f"{where} lies outside global shape {spec.global_shape} (dim {d})"
            )
        if n == 0:
            continue
        if o == n:
            # An empty box at the end lies in no cell of the grid; accepted, it would be
            # counted as one and hide a real hole from `check_tiling`.
            raise CheckpointError(
                f"{where}: offset {o} of dim {d} is at the end of the array (size {n}); a box "
                "must hold at least one element along every dim of nonzero size"
            )
        if g > n:
            raise CheckpointError(
                f"{where}: shard size {g} of dim {d} is larger than the array's {n}; a shard grid "
                "lies inside its array"
            )
        if g <= 0 or o % g:
            raise CheckpointError(
                f"{where}: offset {o} of dim {d} is not a multiple of the shard size {g}; "
                "boxes must be aligned to the array's shard grid"
            )
        if s != min(g, n - o):
            raise CheckpointError(
                f"{where}: size {s} of dim {d} should be {min(g, n - o)} "
                f"(grid {g}; only boxes at the array's upper edge may be shorter)"
            )


# Inner chunks are what a partial read fetches and verifies (the manifest lists a crc32 per
# chunk): about 1/CHUNKS_PER_SHARD of the shard, so a box of another layout over-reads at most
# a chunk at each edge, but at least MIN_CHUNK_BYTES (per-chunk checksums and index entries
# stay few) and at most TARGET_CHUNK_BYTES.
CHUNKS_PER_SHARD = 8
MIN_CHUNK_BYTES = 256 * 2**10
TARGET_CHUNK_BYTES = 4 * 2**20


def inner_chunks(
    grid: tuple[int, ...], itemsize: int, global_shape: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Chooses zarr inner-chunk sizes that divide the shard shape exactly.

    Zarr's sharding codec needs the shard to be a whole number of chunks, and the chunk shape
    is one for the whole array, so it stays a grid in global coordinates. The shard is cut
    along the dims the array is sharded along (where boxes of other layouts cut it too; with
    none, along every dim, into tiles), largest extent first, each time by that extent's
    smallest prime factor, until a chunk is about 1/CHUNKS_PER_SHARD of the shard (within
    [MIN_CHUNK_BYTES, TARGET_CHUNK_BYTES]). Cutting a leading dim keeps each chunk a
    contiguous run of the box's bytes, so encoding copies nothing. Whatever the shape, chunks
    are capped at `layout.MAX_CHUNK_BYTES` so decoding never needs a multi-GB buffer.

    Args:
        grid: the shard shape (zero sizes count as 1).
        itemsize: bytes per stored element.
        global_shape: the array's shape, to tell the sharded dims; None cuts every dim.

    Returns:
        The chunk shape.
    """
    chunk = [max(1, g) for g in grid]

    def nbytes() -> int:
        return math.prod(chunk) * itemsize

    target = min(TARGET_CHUNK_BYTES, max(MIN_CHUNK_BYTES, nbytes() // CHUNKS_PER_SHARD))
    cut = [d for d in range(len(chunk)) if global_shape and 1 < chunk[d] < global_shape[d]]
    cut = cut or [d for d in range(len(chunk)) if chunk[d] > 1]
    while nbytes() > target:
        options = [
            d
            for d in cut
            if chunk[d] > 1 and nbytes() // _smallest_factor(chunk[d]) >= MIN_CHUNK_BYTES
        ]
        if not options:
            break
        axis = max(options, key=lambda d: (chunk[d], -d))
        chunk[axis] //= _smallest_factor(chunk[axis])
    for axis in range(len(chunk)):
        while nbytes() > layout.MAX_CHUNK_BYTES and chunk[axis] > 1:
            chunk[axis] //= _smallest_factor(chunk[axis])
    return tuple(chunk)


# Trial division stops here: exact for every n below 2^32; a larger n with no factor this small
# is treated as prime (its dim is not cut), so a client's 2^61-1 costs no seconds of division.
_LARGEST_TRIAL_FACTOR = 2**16


@functools.lru_cache(maxsize=1024)
def _smallest_factor(n: int) -> int:
    for f in range(2, min(math.isqrt(n), _LARGEST_TRIAL_FACTOR) + 1):
        if n % f == 0:
            return f
    return n


@dataclass(frozen=True)
class ArrayMeta:
    """What every box of one array must agree on, and what the manifest records for it."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    grid: tuple[int, ...]
    stacked: bool

    @classmethod
    def of(cls, spec: ShardSpec) -> ArrayMeta:
        """The array-level facts a box implies."""
        return cls(spec.array, spec.global_shape, spec.dtype, spec.grid_shape, spec.is_stacked)

    @property
    def stored_dtype(self) -> np.dtype:
        return layout._DTYPES[self.dtype][1]

    @property
    def chunks(self) -> tuple[int, ...]:
        return inner_chunks(self.grid, self.stored_dtype.itemsize, self.global_shape)

    def empty_array(self, store: MemoryStore) -> zarr.Array:
        """Creates this array's zarr metadata in `store` (no data); the same bytes every time."""
        sharded = bool(self.global_shape)
        return zarr.create_array(
            store,
            name=self.name,
            shape=self.global_shape,
            chunks=self.chunks if sharded else (),
            shards=tuple(max(1, g) for g in self.grid) if sharded else None,
            dtype=self.stored_dtype,
            fill_value=0,
            # No compression: weights and optimizer state barely compress, and save time is
            # training time.
            compressors=None,
            zarr_format=3,
            attributes={
                "logical_dtype": self.dtype,
                "layer_count": self.global_shape[0] if self.stacked else None,
            },
            # Every box is stored even when all zeros: then a missing object is always
            # corruption rather than "maybe it was zeros".
            config={"write_empty_chunks": True},
        )

    def metadata_bytes(self) -> bytes:
        """The array's zarr.json, deterministic so any process may write it."""
        store = MemoryStore()
        self.empty_array(store)
        return store._store_dict[f"{self.name}/zarr.json"].to_bytes()

    def manifest_entry(self) -> dict:
        """The manifest's description of the array (objects are added by the committer)."""
        layer_count = self.global_shape[0] if self.stacked else None
        if self.stacked:
            parts = self.name.split(".")
            at = parts.index("layers") + 1  # the inverse of layout.array_key
            tensors = [
                ".".join([*parts[:at], str(i), *parts[at:]]) for i in range(self.global_shape[0])
            ]
        else:
            tensors = [self.name]
        return {
            "dtype": self.dtype,
            "stored_dtype": self.stored_dtype.name,
            "shape": list(self.global_shape),
            "layer_count": layer_count,
            "chunks": list(self.chunks) if self.global_shape else [],
            "shards": [max(1, g) for g in self.grid] if self.global_shape else None,
            "tensors": tensors,
        }


# The zarr v3 sharding index: (offset, nbytes) little-endian uint64 per inner chunk in C order of
# the shard's chunk grid, then the crc32c of those bytes; at the end of the object.
EMPTY_CHUNK = 2**64 - 1  # index entry of a chunk that was never written (reads as fill value)


def index_nbytes(num_chunks: int) -> int:
    """Size of a shard's index for `num_chunks` inner chunks."""
    return 16 * num_chunks + 4


@dataclass(frozen=True)
class EncodedBox:
    """One box encoded as its stored object, with the checksums the manifest records.

    Attributes:
        parts: the object's bytes as consecutive parts (views of the data where possible).
        size: total bytes.
        crc32: `checksum` (zlib crc32) of the whole object.
        chunk_crc32: crc32 of each inner chunk's stored bytes, C order over the shard's chunk
            grid (None for a chunk not stored); None for 0-d arrays (not sharded).
        index_crc32: crc32 of the shard index (the object's last `index_nbytes` bytes).
    """

    parts: list[bytes | memoryview]
    size: int
    crc32: int
    chunk_crc32: list[int | None] | None
    index_crc32: int | None


def encode_box(spec: ShardSpec, data: np.ndarray) -> EncodedBox | None:
    """Encodes one box into the bytes of its stored object and their checksums.

    Args:
        spec: the box.
        data: its contents in the stored dtype (`layout.to_stored`), shape `spec.shape`.

    Returns:
        The EncodedBox (the data parts are views of `data` where the chunk layout allows,
        not copies), or None for a box of zero elements (zarr stores nothing for it).

    Raises:
        CheckpointError: data has the wrong shape or dtype.
    """
    meta = ArrayMeta.of(spec)
    if tuple(data.shape) != spec.shape or data.dtype != meta.stored_dtype:
        raise CheckpointError(
            f"box {spec.offsets}+{spec.shape} of array {spec.array!r} got data of shape "
            f"{tuple(data.shape)} dtype {data.dtype}, expected {spec.shape} {meta.stored_dtype}"
        )
    if data.size == 0:
        return None
    if spec.global_shape and spec.shape == meta.grid:
        return _encode_plain_shard(data, meta.chunks)
    # Edge boxes (and 0-d arrays): encode into a scratch in-memory store holding the global
    # array's metadata; zarr writes exactly the one shard object this box covers,
    # byte-identical to writing in place (and pads chunks cut by the array's edge).
    store = MemoryStore()
    array = meta.empty_array(store)
    array[spec.slices()] = data
    obj = store._store_dict[f"{spec.array}/{spec.key}"].to_bytes()
    if not spec.global_shape:
        return EncodedBox([obj], len(obj), checksum(obj), None, None)
    n = math.prod(g // c for g, c in zip(meta.grid, meta.chunks))
    index = np.frombuffer(obj, dtype="<u8", count=2 * n, offset=len(obj) - index_nbytes(n))
    view = memoryview(obj)
    crcs = [
        None if int(off) == EMPTY_CHUNK else checksum(view[int(off) : int(off) + int(size)])
        for off, size in index.reshape(n, 2)
    ]
    return EncodedBox(
        [obj], len(obj), checksum(obj), crcs, checksum(view[len(obj) - index_nbytes(n) :])
    )


def _encode_plain_shard(data: np.ndarray, chunks: tuple[int, ...]) -> EncodedBox:
    """A full shard in the layout `ArrayMeta` configures, without zarr's per-call overhead.

    The zarr v3 sharding codec's layout with bytes codec, little-endian, no compression,
    index at the end: the inner chunks back to back (C order over the shard's chunk grid;
    zarr reads them through the index, whatever their order), then the index. Encoding
    through zarr spends its time in array set-up and copies (measured: BENCHMARKS.md,
    'Checkpoints: persist, load and stall'); here a chunk that
    is a contiguous run of `data` (chunks cut along leading dims) is a view of it, others a
    copy. Each chunk's crc32 is taken once and combined into the whole object's.
    `test_plain_shard_matches_zarr` checks the bytes against zarr's own.
    """
    body = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))
    per_shard = [g // c for g, c in zip(body.shape, chunks)]
    parts: list[bytes | memoryview] = []
    crcs: list[int | None] = []
    entries: list[int] = []
    offset = crc = 0
    for coords in itertools.product(*map(range, per_shard)):
        piece = np.ascontiguousarray(
            body[tuple(slice(i * c, (i + 1) * c) for i, c in zip(coords, chunks))]
        )
        view = piece.reshape(-1).data.cast("B")
        chunk_crc = checksum(view)
        parts.append(view)
        crcs.append(chunk_crc)
        entries += [offset, view.nbytes]
        crc = crc32_combine(crc, chunk_crc, view.nbytes)
        offset += view.nbytes
    index = np.array(entries, dtype="<u8").tobytes()
    index += struct.pack("<I", google_crc32c.value(index))
    cut = [d for d, (n, c) in enumerate(zip(body.shape, chunks)) if c < n]
    if len(cut) <= 1 and all(c == 1 for c in chunks[: cut[0] if cut else 0]):
        # Chunks are consecutive runs of `body`: one part, so one write call, not one a chunk.
        parts = [body.reshape(-1).data.cast("B")]
    parts.append(index)
    index_crc = checksum(index)
    return EncodedBox(
        parts, offset + len(index), crc32_combine(crc, index_crc, len(index)), crcs, index_crc
    )


def _cells(counts: list[int]) -> Iterator[tuple[int, ...]]:
    """Grid cells in row-major order, lazily (itertools.product would first turn every range
    into a tuple: as long as the grid is wide)."""
    index = [0] * len(counts)
    while True:
        yield tuple(index)
        for d in reversed(range(len(counts))):
            index[d] += 1
            if index[d] < counts[d]:
                break
            index[d] = 0
        else:
            return


def check_tiling(meta: ArrayMeta, boxes: Iterable[ShardSpec]) -> None:
    """Raises CheckpointError naming the array unless its boxes cover it exactly once.

    Args:
        meta: the array.
        boxes: every box any writer reported for it.
    """
    seen: dict[tuple[int, ...], ShardSpec] = {}
    empty = 0 in meta.global_shape
    counts = [-(-n // g) for n, g in zip(meta.global_shape, meta.grid)] if not empty else []
    for box in boxes:
        if ArrayMeta.of(box) != meta:
            raise CheckpointError(
                f"array {meta.name!r}: writers disagree on its shape/dtype/shard grid: "
                f"{meta.global_shape} {meta.dtype} grid {meta.grid} vs "
                f"{box.global_shape} {box.dtype} grid {box.grid_shape}"
            )
        if not empty and any(c >= k for c, k in zip(box.coords, counts)):
            # `validate` refuses such boxes; a cell outside the grid must never stand in for
            # a missing one in the count below
            raise CheckpointError(
                f"array {meta.name!r}: box {box.offsets}+{box.shape} lies outside its shard "
                f"grid of {counts} cells"
            )
        if box.coords in seen:
            raise CheckpointError(
                f"array {meta.name!r}: boxes overlap: {box.offsets}+{box.shape} written twice"
            )
        seen[box.coords] = box
    if empty:
        return  # nothing is stored; an empty array needs no box
    # Counted, not listed: a tiny box claiming a huge global shape must not cost a list of
    # every cell. (Each box lies inside the grid, so `seen` holds distinct grid cells.)
    missing = math.prod(counts) - len(seen)
    if missing:
        # among the first len(seen) + 1 cells at least one is missing
        hole = next(c for c in _cells(counts) if c not in seen)
        first = tuple(c * g for c, g in zip(hole, meta.grid))
        raise CheckpointError(
            f"array {meta.name!r} has holes: {missing} of {math.prod(counts)} boxes of "
            f"grid {meta.grid} were never written (first at offsets {first})"
        )
