"""Saving a checkpoint: tensors -> zarr v3 arrays in a step folder, then the manifest (commit).

`save_checkpoint(root, step, tensors, metadata)` groups the tensors into arrays
(`layout.group_tensors`: per-layer tensors stacked), writes each array with one shard object
per layer slice (or per tensor), reads every stored object back to record its size and crc32,
and only then writes `manifest.json`. A folder without a complete manifest is not a
checkpoint, so a crash at any point leaves the previous checkpoints valid and the partial
folder is ignored by readers and cleared by the next save of the same step. This is the
single-process version; the distributed writer will reuse the layout and manifest format.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import zarr

from services.checkpoint import layout
from services.checkpoint.store import (
    MANIFEST_NAME,
    Root,
    join,
    list_objects,
    open_root,
    read_bytes,
    remove_tree,
    write_bytes_atomic,
    zarr_store,
)
from services.common.errors import CheckpointError

FORMAT = "meshtrain-checkpoint"
FORMAT_VERSION = 1
# crc32 (zlib): the manifest guards against torn writes and bit rot, not tampering; crc32
# runs at memory speed in the stdlib and catches every burst error up to 32 bits.
CHECKSUM = "crc32"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """What one save did.

    Attributes:
        url: URL of the committed checkpoint folder.
        step: the step saved.
        num_arrays: zarr arrays written.
        num_objects: stored objects (array metadata + shards + group metadata), manifest excluded.
        bytes_written: total size of those objects plus the manifest.
        seconds: wall time of the whole save.
    """

    url: str
    step: int
    num_arrays: int
    num_objects: int
    bytes_written: int
    seconds: float


def checksum(data: bytes) -> int:
    """Returns the checksum recorded in the manifest for one stored object."""
    return zlib.crc32(data)


def save_checkpoint(
    root: str,
    step: int,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> SaveResult:
    """Writes a checkpoint of `tensors` at `ROOT/step_XXXXXXXX/` and commits it.

    Args:
        root: root URL (local path, `file://`, `memory://`, `s3://`).
        step: training step; names the folder.
        tensors: canonical tensor name -> tensor (any device; copied to CPU one at a time).
        metadata: JSON-serializable user data stored in the manifest (iteration, consumed
            samples, config, ...).
        overwrite: replace a committed checkpoint of the same step instead of refusing.

    Returns:
        A SaveResult; `.url` is the checkpoint URL.

    Raises:
        CheckpointError: the step is already committed (and not `overwrite`), a tensor name
            or dtype is not allowed, or the metadata is not JSON.
    """
    start = time.perf_counter()
    metadata = {} if metadata is None else metadata
    try:
        # Fail before any I/O: a manifest that cannot be written makes the whole save useless.
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint metadata for step {step} is not JSON: {e}") from e
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    specs = layout.group_tensors(
        (name, tuple(t.shape), layout.dtype_name(t.dtype)) for name, t in tensors.items()
    )

    store_root = open_root(root)
    step_path = store_root.step_path(step)
    _clear_step(store_root, step, step_path, overwrite)

    store = zarr_store(store_root, step_path)
    # A root group makes the folder browsable with `zarr.open_group(url)`.
    zarr.open_group(store, mode="w", zarr_format=3, attributes={"step": step})
    for spec in specs.values():
        _write_array(store, spec, tensors)

    objects = _checksum_objects(store_root, step_path)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "checksum": CHECKSUM,
        "created_unix": time.time(),
        "arrays": {},
        "objects": objects.pop("", {}),
        "metadata": metadata,
    }
    for spec in specs.values():
        chunks, shards = layout.chunk_and_shard_shape(spec)
        manifest["arrays"][spec.name] = {
            "dtype": spec.dtype,
            "stored_dtype": spec.stored_dtype.name,
            "shape": list(spec.shape),
            "layer_count": spec.layer_count,
            "chunks": list(chunks),
            "shards": None if shards is None else list(shards),
            "tensors": list(spec.tensors),
            "objects": objects.get(spec.name, {}),
        }
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    write_bytes_atomic(store_root, join(step_path, MANIFEST_NAME), data)

    num_objects = sum(len(a["objects"]) for a in manifest["arrays"].values()) + len(
        manifest["objects"]
    )
    total = len(data) + sum(
        o["size"] for a in manifest["arrays"].values() for o in a["objects"].values()
    ) + sum(o["size"] for o in manifest["objects"].values())
    result = SaveResult(
        url=store_root.step_url(step),
        step=step,
        num_arrays=len(specs),
        num_objects=num_objects,
        bytes_written=total,
        seconds=time.perf_counter() - start,
    )
    log.info(
        "saved checkpoint %s: %d arrays, %d objects, %.1f MB in %.2f s",
        result.url, result.num_arrays, result.num_objects, total / 1e6, result.seconds,
    )
    return result


def _clear_step(root: Root, step: int, step_path: str, overwrite: bool) -> None:
    """Makes the step folder empty: refuses a committed step unless `overwrite`."""
    manifest_path = join(step_path, MANIFEST_NAME)
    if root.fs.exists(manifest_path):
        if not overwrite:
            raise CheckpointError(
                f"checkpoint step {step} already exists under {root.url!r} "
                "(pass overwrite=True to replace it)"
            )
        # Uncommit first, so a crash while deleting leaves an ignored folder, not a
        # manifest pointing at missing arrays.
        root.fs.rm(manifest_path)
    # Leftovers of an uncommitted attempt would otherwise be listed as objects of this one.
    remove_tree(root, step_path)


def _write_array(store: Any, spec: layout.ArraySpec, tensors: dict[str, torch.Tensor]) -> None:
    """Creates one zarr array and writes its data, one layer slice (= one shard) at a time."""
    chunks, shards = layout.chunk_and_shard_shape(spec)
    array = zarr.create_array(
        store,
        name=spec.name,
        shape=spec.shape,
        chunks=chunks,
        shards=shards,
        dtype=spec.stored_dtype,
        fill_value=0,
        # No compression: weights and optimizer state barely compress, and save time is
        # training time.
        compressors=None,
        zarr_format=3,
        attributes={"logical_dtype": spec.dtype, "layer_count": spec.layer_count},
        # Write all-zero shards too: then every shard object exists, and a missing object is
        # always corruption rather than "maybe it was zeros".
        config={"write_empty_chunks": True},
    )
    if spec.layer_count is None:
        array[...] = layout.to_stored(tensors[spec.tensors[0]])
    else:
        for index, name in enumerate(spec.tensors):
            # Only one layer is on the CPU at a time, not the whole stack.
            array[index] = layout.to_stored(tensors[name])


def _checksum_objects(root: Root, step_path: str) -> dict[str, dict[str, dict[str, int]]]:
    """Reads back every object in the step folder; returns array -> object key -> size, crc.

    Objects at the folder's top level (the group's zarr.json) are filed under "".
    """
    objects: dict[str, dict[str, dict[str, int]]] = {}
    for rel in list_objects(root, step_path):
        data = read_bytes(root, join(step_path, rel))
        array, _, key = rel.partition("/")
        if not key:
            array, key = "", rel
        objects.setdefault(array, {})[key] = {"size": len(data), CHECKSUM: checksum(data)}
    return objects
