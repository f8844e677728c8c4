"""Partial reads: a box of another layout fetches only the inner chunks it needs, verified.

Shards are cut into inner chunks whose crc32s the manifest lists; a resharded `read_box`
range-reads the shard index and the chunks it touches. Bytes fetched are counted by wrapping
the real filesystem's `cat_file` (every read, `cat_ranges` included, goes through it on
memory:// and file://), so nothing about storage is faked. The chunk-size floor is lowered
so that small arrays get the eight chunks per shard a real one would.
"""

import json
import math
import threading
import zlib

import numpy as np
import pytest
import torch
import zarr

from meshtrain.services.checkpoint import boxes
from meshtrain.services.checkpoint.boxes import ArrayMeta, ShardSpec, encode_box, inner_chunks
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.maintenance import verify_checkpoint
from meshtrain.services.checkpoint.multiwriter import (
    MANIFEST_DIGEST,
    ShardWriter,
    begin_save,
    manifest_digest,
)
from meshtrain.services.checkpoint.reader import read_box
from meshtrain.services.checkpoint.store import MANIFEST_NAME, open_root
from meshtrain.services.common.errors import CheckpointError

ARRAY = "layers.mlp.fc1.weight"
LAYERS, ROWS, COLS = 2, 64, 32  # float32: a tp2 shard is (1, 32, 32) = 4 KiB, 8 chunks of 512 B


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(boxes, "MIN_CHUNK_BYTES", 256)


def full_array(seed=0):
    return torch.randn(LAYERS, ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def save(root, step, full, tp, dim=1):
    """Saves `full` as `tp` writers would, each owning a block along `dim` of every layer."""
    save_id = begin_save(root, step)
    size = full.shape[dim] // tp

    def run(rank):
        writer = ShardWriter(root, step, save_id, rank, tp)
        for layer in range(LAYERS):
            offsets = [layer, 0, 0]
            offsets[dim] = rank * size
            shape = [1, ROWS, COLS]
            shape[dim] = size
            box = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
            writer.write(
                ShardSpec(ARRAY, tuple(full.shape), "float32", tuple(offsets), tuple(shape)), box
            )
        writer.finish()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    commit(root, step, save_id, tp, timeout=30)
    for t in threads:
        t.join()


class CountingReads:
    """Counts the bytes the checkpoint filesystem returns for shard objects."""

    def __init__(self, monkeypatch, url):
        fs = open_root(url).fs  # fsspec caches instances: the reader gets this one
        self.bytes = 0
        inner = fs.cat_file

        def cat_file(path, start=None, end=None, **kwargs):
            data = inner(path, start=start, end=end, **kwargs)
            if "/c/" in str(path):
                self.bytes += len(data)
            return data

        monkeypatch.setattr(fs, "cat_file", cat_file)


def shard_path(url, step, key):
    r = open_root(url)
    return f"{r.step_path(step)}/{ARRAY}/{key}", r.fs


def test_inner_chunks_cut_the_sharded_dim(monkeypatch):
    monkeypatch.undo()  # the real chunk sizes
    glob = (32, 4096, 1024)
    assert inner_chunks((1, 2048, 1024), 2, glob) == (1, 256, 1024)  # rows split: 512 KiB slabs
    assert inner_chunks((1, 4096, 512), 2, glob) == (1, 4096, 64)  # columns split
    assert inner_chunks((1, 4096, 1024), 2, glob) == (1, 512, 1024)  # unsplit: 1/8 of the shard
    assert inner_chunks((1, 4096, 4096), 2, (32, 4096, 4096)) == (1, 1024, 2048)
    assert inner_chunks((1, 64, 8), 2, (4, 128, 8)) == (1, 64, 8)  # tiny shards: one chunk
    big = inner_chunks((50304, 4096), 2, (100608, 4096))  # an embedding shard, 393 MiB
    assert math.prod(big) * 2 <= boxes.TARGET_CHUNK_BYTES and big[1] == 4096


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool"])
@pytest.mark.parametrize(
    "box", [((1, 32, 0), (1, 32, 32)), ((1, 0, 16), (1, 64, 16)), ((0, 0), (64, 32))]
)
def test_plain_shard_matches_zarr(dtype, box):
    """Hand-built multi-chunk shards decode in zarr to the data and list true chunk crc32s.

    Row slabs are byte-identical to zarr's own; tiles are written in C order where zarr uses
    Morton order, which its index makes equivalent.
    """
    offsets, shape = box
    glob = (3, 64, 32) if len(shape) == 3 else (64, 32)
    name = "layers.w" if len(shape) == 3 else "w"
    spec = ShardSpec(name, glob, dtype, offsets, shape)
    meta = ArrayMeta.of(spec)
    data = (torch.randn(shape) * 50).to(boxes.layout._DTYPES[dtype][0])
    if dtype == "bool":
        data = torch.rand(shape) > 0.5
    stored = boxes.layout.to_stored(data)
    encoded = encode_box(spec, stored)
    obj = b"".join(encoded.parts)
    n = len(encoded.chunk_crc32)
    assert n >= 4 and encoded.size == len(obj)  # chunks of >= 256 B
    assert encoded.crc32 == zlib.crc32(obj)
    assert encoded.index_crc32 == zlib.crc32(obj[-boxes.index_nbytes(n) :])
    store = zarr.storage.MemoryStore()
    meta.empty_array(store)[spec.slices()] = stored
    theirs = store._store_dict[f"{name}/{spec.key}"].to_bytes()
    if len(shape) == 3:
        assert obj == theirs
    store._store_dict[f"{name}/{spec.key}"] = (
        zarr.core.buffer.default_buffer_prototype().buffer.from_bytes(obj)
    )
    np.testing.assert_array_equal(
        zarr.open_array(store, path=name, mode="r")[spec.slices()], stored
    )


@pytest.mark.parametrize("dim", [1, 2])
def test_resharded_read_fetches_only_needed_chunks(root, monkeypatch, dim):
    """tp2 -> tp3: each box cuts a shard; fetched bytes stay near the box, not whole shards."""
    full = full_array()
    save(root, 1, full, tp=2, dim=dim)
    counter = CountingReads(monkeypatch, root)
    extent = full.shape[dim]
    step = -(-extent // 3)
    fetched_needed = 0
    for r in range(3):
        offsets, shape = [0, 0, 0], list(full.shape)
        offsets[dim], shape[dim] = r * step, min(step, extent - r * step)
        box = read_box(root, 1, ARRAY, tuple(offsets), tuple(shape))
        torch.testing.assert_close(
            box, full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))], rtol=0, atol=0
        )
        fetched_needed += box.numel() * 4
    whole_shards = 4 * LAYERS * (full.numel() * 4 // (2 * LAYERS))  # each box touches 2 of 2 / 1
    assert fetched_needed == full.numel() * 4
    # Whole shards would be 4/2 = 2x the array; chunks of 1/8 shard cost ~1.25x.
    assert counter.bytes < 1.4 * fetched_needed, (counter.bytes, fetched_needed, whole_shards)


def test_same_layout_read_fetches_whole_shards_once(root, monkeypatch):
    full = full_array()
    save(root, 1, full, tp=2)
    counter = CountingReads(monkeypatch, root)
    box = read_box(root, 1, ARRAY, (0, 32, 0), (LAYERS, 32, COLS))
    torch.testing.assert_close(box, full[:, 32:], rtol=0, atol=0)
    manifest = json.loads(
        open_root(root).fs.cat_file(f"{open_root(root).step_path(1)}/{MANIFEST_NAME}")
    )
    objects = manifest["arrays"][ARRAY]["objects"]
    assert counter.bytes == sum(objects[f"c/{layer}/1/0"]["size"] for layer in range(LAYERS))


def _chunk_offset(url, step, key, chunk):
    path, fs = shard_path(url, step, key)
    data = fs.cat_file(path)
    index = np.frombuffer(data[-boxes.index_nbytes(8) : -4], dtype="<u8").reshape(8, 2)
    return path, fs, int(index[chunk][0])


def _flip(fs, path, offset):
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0x01
    fs.pipe_file(path, bytes(data))


def test_flipped_byte_in_a_chunk_is_caught_on_a_partial_read(root_fs):
    url, _, _ = root_fs
    full = full_array()
    save(url, 2, full, tp=2)
    path, fs, offset = _chunk_offset(url, 2, "c/1/0/0", 5)  # rows 20:24 of layer 1
    _flip(fs, path, offset + 7)
    # A box that skips the damaged chunk still reads (each chunk is verified on its own) ...
    torch.testing.assert_close(
        read_box(url, 2, ARRAY, (1, 0, 0), (1, 20, COLS)), full[1:2, :20], rtol=0, atol=0
    )
    # ... one that needs it names the array, the shard and the chunk.
    with pytest.raises(
        CheckpointError, match=rf"array '{ARRAY}' object 'c/1/0/0'.* chunk 5 \(0, 5, 0\) is corrupt"
    ):
        read_box(url, 2, ARRAY, (1, 16, 0), (1, 30, COLS))
    with pytest.raises(CheckpointError, match=rf"array '{ARRAY}' object 'c/1/0/0'.* is corrupt"):
        read_box(url, 2, ARRAY, (0, 0, 0), (LAYERS, ROWS, COLS))  # whole shards: object crc32
    with pytest.raises(CheckpointError, match=rf"array '{ARRAY}' object 'c/1/0/0'"):
        verify_checkpoint(url, 2)


def test_flipped_byte_in_the_shard_index_is_caught(root_fs):
    url, _, _ = root_fs
    save(url, 3, full_array(), tp=2)
    path, fs = shard_path(url, 3, "c/0/1/0")
    _flip(fs, path, len(fs.cat_file(path)) - 30)
    with pytest.raises(CheckpointError, match=r"object 'c/0/1/0'.* shard index"):
        read_box(url, 3, ARRAY, (0, 40, 0), (1, 4, COLS))


def test_verify_checks_chunk_checksums(root_fs):
    """A manifest whose chunk crc32 disagrees with the data fails `ckpt verify`, which
    otherwise would pass it on the whole-object crc32 while partial reads fail."""
    url, fs, path = root_fs
    save(url, 4, full_array(), tp=2)
    assert verify_checkpoint(url, 4) == 2 + 2 * LAYERS
    manifest_path = f"{path}/step_00000004/{MANIFEST_NAME}"
    manifest = json.loads(fs.cat_file(manifest_path))
    manifest["arrays"][ARRAY]["objects"]["c/0/0/0"]["chunk_crc32"][3] ^= 1
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)  # consistent, yet wrong about the data
    fs.pipe_file(manifest_path, json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match=r"object 'c/0/0/0'.* chunk 3 is corrupt"):
        verify_checkpoint(url, 4)


def test_version_1_manifests_still_load(root, monkeypatch):
    """Without chunk checksums (format 1) partial reads fall back to verified whole shards."""
    full = full_array()
    save(root, 5, full, tp=2)
    r = open_root(root)
    manifest_path = f"{r.step_path(5)}/{MANIFEST_NAME}"
    manifest = json.loads(r.fs.cat_file(manifest_path))
    manifest["format_version"] = 1
    for obj in manifest["arrays"][ARRAY]["objects"].values():
        obj.pop("chunk_crc32", None), obj.pop("index_crc32", None)
    r.fs.pipe_file(manifest_path, json.dumps(manifest).encode())
    counter = CountingReads(monkeypatch, root)
    box = read_box(root, 5, ARRAY, (0, 16, 0), (LAYERS, 32, COLS))
    torch.testing.assert_close(box, full[:, 16:48], rtol=0, atol=0)
    assert counter.bytes > 2 * box.numel() * 4  # both shards of each layer, whole


def test_multi_chunk_checkpoint_opens_with_plain_zarr(tmp_path):
    url = str(tmp_path / "ckpt")
    full = full_array()
    save(url, 6, full, tp=2, dim=2)
    group = zarr.open_group(f"{url}/step_00000006", mode="r")
    array = group[ARRAY]
    assert array.chunks == (1, ROWS, 2) and array.shards == (1, ROWS, COLS // 2)
    np.testing.assert_array_equal(array[...], full.numpy())
