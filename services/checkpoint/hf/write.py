"""Writing a Hugging Face export's weights as safetensors shards, for `convert.py`.

The tensors are assigned to shards in file order, each shard holding at most `max_shard_size`
bytes of tensor data (a tensor larger than the limit alone in its own), as transformers'
`save_pretrained` does: one shard is `model.safetensors`; several are
`model-00001-of-0000N.safetensors` ... with `model.safetensors.index.json`
(`metadata.total_size`, `weight_map`: tensor -> file), which `from_pretrained` reads. Each
shard is streamed: its header computed from the plan, then each tensor as the conversion
produces it, so no shard is ever held in memory.

    shards = plan_shards(tensors, "bfloat16", parse_size("5GB"))
    write_shards(fs, folder, shards, produce)      # produce() yields (name, tensor) in order
"""

from __future__ import annotations

import json
import posixpath
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshtrain.services.checkpoint.convert import TORCH_DTYPES
from meshtrain.services.common.errors import CheckpointError

ST_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
    "bool": "BOOL",
}
"""meshtrain dtype name -> safetensors dtype code."""
LOGICAL = {st: name for name, st in ST_DTYPES.items()}
"""safetensors dtype code -> meshtrain dtype name."""
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
"""transformers' default shard limit, "5GB" (decimal)."""
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes of a shard limit: an int, or a string such as "5GB", "500MB", "2GiB" (GB = 10^9,
    GiB = 2^30, as transformers reads them).

    Raises:
        CheckpointError: not a positive size; names the value.
    """
    if isinstance(size, bool):
        raise CheckpointError(f"max shard size {size!r} is not a size")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
        if match is None:
            raise CheckpointError(
                f"max shard size {size!r} is not a size (e.g. 5GB, 500MB, 2GiB or a byte count)"
            )
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise CheckpointError(f"max shard size must be positive, got {size!r}")
    return value


@dataclass(frozen=True)
class Shard:
    """One safetensors file: its name and its tensors (name, shape) in file order."""

    file: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]


def plan_shards(
    tensors: Iterable[tuple[str, tuple[int, ...]]], dtype: str, max_shard_size: int
) -> list[Shard]:
    """The shards of an export: tensors in order, each shard at most `max_shard_size` bytes of
    data unless a single tensor is larger.

    Args:
        tensors: (HF name, shape) in file order.
        dtype: the weights' dtype (meshtrain name).
        max_shard_size: bytes.
    """
    itemsize = TORCH_DTYPES[dtype].itemsize
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append((name, tuple(shape)))
        size += nbytes
    if len(groups) == 1:
        return [Shard("model.safetensors", tuple(groups[0]))]
    n = len(groups)
    return [
        Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)
    ]


def index(shards: list[Shard], dtype: str) -> dict[str, Any]:
    """The `model.safetensors.index.json` of several shards."""
    itemsize = TORCH_DTYPES[dtype].itemsize
    total = sum(
        int(np.prod(shape, dtype=np.int64)) * itemsize for s in shards for _, shape in s.tensors
    )
    return {
        "metadata": {"total_size": total},
        "weight_map": {name: s.file for s in shards for name, _ in s.tensors},
    }


def write_shards(
    fs: Any,
    folder: str,
    shards: list[Shard],
    dtype: str,
    produced: Iterable[tuple[str, torch.Tensor]],
) -> list[str]:
    """Streams every shard into `folder`, then the index when there are several.

    Args:
        fs: the fsspec filesystem.
        folder: the export's folder on it.
        shards: from `plan_shards`.
        dtype: the weights' dtype (meshtrain name).
        produced: (HF name, tensor) in the plan's order.

    Returns:
        The files written, in order.

    Raises:
        CheckpointError: a tensor came out under another name, shape or dtype than planned, or
            too few or too many came.
    """
    stream = iter(produced)
    files = []
    for shard in shards:
        with fs.open(posixpath.join(folder, shard.file), "wb") as f:
            _write_one(f, shard, dtype, stream)
        files.append(shard.file)
    extra = next(stream, None)
    if extra is not None:
        raise CheckpointError(f"HF tensor {extra[0]!r} was produced but not planned")
    if len(shards) > 1:
        fs.pipe_file(
            posixpath.join(folder, INDEX), json.dumps(index(shards, dtype), indent=2).encode()
        )
        files.append(INDEX)
    return files


def _write_one(f: Any, shard: Shard, dtype: str, stream) -> None:
    """One safetensors file: an 8-byte little-endian header length, a JSON header of
    name -> {dtype, shape, data_offsets}, then the raw little-endian bytes back to back."""
    torch_dtype, itemsize = TORCH_DTYPES[dtype], TORCH_DTYPES[dtype].itemsize
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard.tensors:
        size = int(np.prod(shape, dtype=np.int64)) * itemsize
        header[name] = {
            "dtype": ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    written = 0
    for name, shape in shard.tensors:
        got = next(stream, None)
        if got is None:
            raise CheckpointError(f"HF tensor {name!r} was planned but not produced")
        got_name, tensor = got
        if got_name != name or tuple(tensor.shape) != shape or tensor.dtype != torch_dtype:
            raise CheckpointError(
                f"HF tensor {got_name!r} came out {tuple(tensor.shape)} {tensor.dtype}, "
                f"planned {name!r} {shape} {dtype}"
            )
        if tensor.numel():
            # A view of the tensor's own memory: no bytes copy of the largest tensor.
            data = tensor.contiguous().view(torch.uint8).numpy()
            f.write(data.data)
            written += data.nbytes
    if written != offset:
        raise CheckpointError(
            f"{shard.file}: data is {written} bytes, the header promises {offset}"
        )
