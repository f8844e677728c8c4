"""How logical tensors map onto zarr arrays in a checkpoint: names, stacking, dtypes, chunks.

A checkpoint stores each logical tensor in global coordinates. Per-layer tensors named
`...layers.<i>.<rest>` that share shape and dtype are stacked into ONE array named
`...layers.<rest>` with a leading global-layer axis (as Megatron does), so a checkpoint is a
few hundred large objects instead of tens of thousands of small ones. This module is pure
metadata: it decides array names, shapes and the stored dtype (bfloat16 travels as raw uint16
bits); `boxes.py` decides chunk/shard shapes, `multiwriter.py` and `reader.py` do the I/O. Nothing
here touches a filesystem, so it is cheap to test: `pytest
tests/services/checkpoint/test_layout.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.sanitize import loggable

# Array-name prefixes of what a checkpoint holds besides the model's parameters: optimizer
# moments, RNG states, and the tokenizer's files (`tokenizer_store.py`).
NON_PARAMETER = ("optim.", "rng.", "tokenizer.")

# Inner zarr chunks are capped so one decode never needs a multi-GB buffer; the shard (one
# stored object) can still be far larger than this.
MAX_CHUNK_BYTES = 64 * 2**20

# Logical dtype name -> (torch dtype, numpy dtype it is stored as). bfloat16 has no numpy/zarr
# dtype, so its bits are stored as uint16 and the logical name is recorded beside them.
_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("float32")),
    "float16": (torch.float16, np.dtype("float16")),
    "bfloat16": (torch.bfloat16, np.dtype("uint16")),
    "int64": (torch.int64, np.dtype("int64")),
    "int32": (torch.int32, np.dtype("int32")),
    "uint8": (torch.uint8, np.dtype("uint8")),
    "bool": (torch.bool, np.dtype("bool")),
}
_BY_TORCH = {torch_dtype: name for name, (torch_dtype, _) in _DTYPES.items()}

# Array names become zarr node names and object-key prefixes: no "/", no leading "." or "_"
# (zarr v3 reserves "__"; "_fragments" and any other "_" folder of a step are ours: an array
# there would be deleted by the commit that lists it), and nothing that could shadow the files
# we keep beside the arrays.
_NAME_RE = re.compile(r"[A-Za-z0-9\-][A-Za-z0-9_.\-]*")  # fullmatch: "$" let a final newline in
MAX_NAME_CHARS = 255  # a folder name
_RESERVED_NAMES = {"zarr.json", "manifest.json"}


@dataclass(frozen=True)
class ArraySpec:
    """One zarr array of a checkpoint.

    Attributes:
        name: the array name (the canonical tensor name, with the layer number removed when
            stacked).
        shape: the stored shape; for a stacked array it starts with the layer axis.
        dtype: the logical dtype name (e.g. "bfloat16"); see `stored_dtype` for the zarr one.
        layer_count: size of the leading layer axis for a stacked array, else None.
        tensors: the tensor names held, in order: `tensors[i]` is layer i of a stacked array;
            an unstacked array holds exactly one tensor.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    layer_count: int | None = None
    tensors: tuple[str, ...] = ()

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """Shape of each tensor held (the stored shape without the layer axis)."""
        return self.shape[1:] if self.layer_count is not None else self.shape

    @property
    def stored_dtype(self) -> np.dtype:
        """The numpy/zarr dtype the array is stored as."""
        return _DTYPES[self.dtype][1]


def array_key(name: str) -> tuple[str, int | None]:
    """Maps a tensor name to the array that stores it and its layer index there.

    The first dot-separated component pair `layers.<int>` followed by more components is the
    layer; it is removed from the array name. `optim.exp_avg.layers.3.mlp.fc1.weight` ->
    (`optim.exp_avg.layers.mlp.fc1.weight`, 3); `embedding.weight` -> (`embedding.weight`, None).

    Args:
        name: a canonical tensor name.

    Returns:
        (array name, global layer index or None when the name has no layer component).
    """
    parts = name.split(".")
    # len(parts) - 2: a layer component must be followed by at least one more component.
    for i in range(len(parts) - 2):
        if parts[i] == "layers" and parts[i + 1].isascii() and parts[i + 1].isdigit():
            return ".".join(parts[: i + 1] + parts[i + 2 :]), int(parts[i + 1])
    return name, None


def group_tensors(tensors: Iterable[tuple[str, Sequence[int], str]]) -> dict[str, ArraySpec]:
    """Decides which arrays a set of tensors is stored in.

    Tensors that share an array key are stacked when every one has a layer index, the indices
    are exactly 0..n-1, and shapes and dtypes agree. Otherwise (a model whose layers differ,
    or a partial set of layers) each such tensor gets its own unstacked array under its full
    name, so nothing is lost, only fewer objects are saved.

    Args:
        tensors: (tensor name, shape, logical dtype name) triples.

    Returns:
        Array name -> ArraySpec, sorted by array name.

    Raises:
        CheckpointError: a name is not a valid array name, appears twice, a dtype is not
            supported, or two tensors would land in the same array name.
    """
    groups: dict[str, list[tuple[str, int | None, tuple[int, ...], str]]] = {}
    seen: set[str] = set()
    for name, shape, dtype in tensors:
        if name in seen:
            raise CheckpointError(f"tensor {name!r} is listed twice")
        seen.add(name)
        check_name(name)
        if dtype not in _DTYPES:
            raise CheckpointError(
                f"tensor {name!r} has dtype {dtype!r}; supported: {', '.join(_DTYPES)}"
            )
        key, index = array_key(name)
        groups.setdefault(key, []).append((name, index, tuple(int(d) for d in shape), dtype))

    specs: dict[str, ArraySpec] = {}

    def add(spec: ArraySpec) -> None:
        if spec.name in specs:
            others = specs[spec.name].tensors + spec.tensors
            raise CheckpointError(
                f"array name {spec.name!r} would hold unrelated tensors {sorted(others)}; rename "
                "one"
            )
        specs[spec.name] = spec

    for key, members in groups.items():
        members.sort(key=lambda m: -1 if m[1] is None else m[1])
        indices = [m[1] for m in members]
        stackable = (
            indices == list(range(len(members)))
            and len({m[2] for m in members}) == 1
            and len({m[3] for m in members}) == 1
        )
        if stackable:
            _, _, shape, dtype = members[0]
            add(
                ArraySpec(
                    name=key,
                    shape=(len(members), *shape),
                    dtype=dtype,
                    layer_count=len(members),
                    tensors=tuple(m[0] for m in members),
                )
            )
        else:
            for name, _, shape, dtype in members:
                add(ArraySpec(name=name, shape=shape, dtype=dtype, tensors=(name,)))
    return dict(sorted(specs.items()))


def check_name(name: str) -> None:
    """Raises CheckpointError unless `name` can be used as a tensor or array name.

    Args:
        name: the tensor name to check.
    """
    if (
        not isinstance(name, str)
        or len(name) > MAX_NAME_CHARS
        or not _NAME_RE.fullmatch(name)
        or name in _RESERVED_NAMES
    ):
        raise CheckpointError(
            f"tensor name {loggable(name)} is not allowed: use 1 to {MAX_NAME_CHARS} letters, "
            "digits, '_', '-' and '.', not starting with '.' or '_', and not 'zarr.json' or "
            "'manifest.json'"
        )


def dtype_name(dtype: torch.dtype) -> str:
    """Returns the logical dtype name of a torch dtype.

    Args:
        dtype: a torch dtype.

    Returns:
        Its name in the manifest, e.g. "bfloat16".

    Raises:
        CheckpointError: the dtype is not supported.
    """
    if dtype not in _BY_TORCH:
        raise CheckpointError(f"dtype {dtype} is not supported; supported: {', '.join(_DTYPES)}")
    return _BY_TORCH[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a logical dtype name (`dtype_name`'s inverse).

    Raises:
        CheckpointError: the name is not a supported dtype.
    """
    if name not in _DTYPES:
        raise CheckpointError(f"dtype {name!r} is not supported; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name][0]


def as_stored(data: torch.Tensor | np.ndarray, dtype: str, what: str) -> np.ndarray:
    """`data` for a box of logical `dtype` as the array stored for it, refusing any other dtype.

    Args:
        data: a tensor of dtype `dtype`, or a numpy array already in its stored dtype.
        dtype: the box's logical dtype name.
        what: the box, for the message ("box (0, 4) of array 'w'").

    Raises:
        CheckpointError: the data's dtype is not the box's (raw bytes of another dtype of the
            same width would otherwise be stored reinterpreted).
    """
    if isinstance(data, torch.Tensor):
        if dtype_name(data.dtype) != dtype:
            raise CheckpointError(f"{what} is {dtype} but got a {data.dtype} tensor")
        return to_stored(data)
    want = _DTYPES[dtype][1]
    if np.asarray(data).dtype != want:
        raise CheckpointError(
            f"{what} is {dtype} (stored as {want}) but got a numpy array of "
            f"{np.asarray(data).dtype}"
        )
    return np.asarray(data)


def to_stored(tensor: torch.Tensor) -> np.ndarray:
    """Converts a tensor (any device) to the numpy array that is stored for it.

    Args:
        tensor: a tensor of a supported dtype.

    Returns:
        A CPU numpy array; bfloat16 comes back as its raw bits in uint16.
    """
    dtype = dtype_name(tensor.dtype)
    cpu = tensor.detach().to("cpu").contiguous()
    if dtype == "bfloat16":
        # int16 view keeps the bits; numpy then reinterprets them as unsigned.
        return cpu.view(torch.int16).numpy().view(np.uint16)
    return cpu.numpy()


def from_stored(array: npt.ArrayLike, dtype: str) -> torch.Tensor:
    """Converts a stored numpy array back to a tensor of its logical dtype.

    Args:
        array: data as read from zarr (stored dtype).
        dtype: the logical dtype name from the manifest.

    Returns:
        A CPU tensor with its own (writable) memory.
    """
    # asarray, not ascontiguousarray: the latter turns 0-d arrays into 1-d ones.
    array = np.asarray(array)
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = array.copy(order="C")
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
