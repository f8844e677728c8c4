"""Single-process saves: a dict of tensors -> one committed checkpoint, in one call.

`save_checkpoint(root, step, tensors, metadata)` groups the tensors into arrays
(`layout.group_tensors`: per-layer tensors stacked), then runs the multi-writer protocol of
`multiwriter.py` with one writer that owns every box (one box per layer slice, or per tensor) and
commits it. A folder without a complete manifest is not a checkpoint, so a crash at any point
leaves the previous checkpoints valid and the partial folder is ignored by readers and cleared
by the next save of the same step.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.crc import checksum  # noqa: F401  (re-exported)
from meshtrain.services.checkpoint.multiwriter import (  # noqa: F401  (re-exported: the format constants)
    CHECKSUM,
    FORMAT,
    FORMAT_VERSION,
    SaveResult,
    ShardWriter,
    begin_save,
)
from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.common.errors import CheckpointError


def single_writer_boxes(spec: layout.ArraySpec) -> list[tuple[ShardSpec, str, int | None]]:
    """The boxes one writer uses for a whole array: one per layer slice, or the whole array.

    Args:
        spec: the array (from `layout.group_tensors`).

    Returns:
        (box, tensor name, layer index or None) for each box.
    """
    stacked = spec.layer_count is not None
    if not stacked:
        box = ShardSpec(
            spec.name, spec.shape, spec.dtype, (0,) * len(spec.shape), spec.shape, stacked=False
        )
        return [(box, spec.tensors[0], None)]
    slice_shape = (1, *spec.tensor_shape)
    return [
        (
            ShardSpec(
                spec.name,
                spec.shape,
                spec.dtype,
                (i, *(0,) * len(spec.tensor_shape)),
                slice_shape,
                stacked=True,
            ),
            name,
            i,
        )
        for i, name in enumerate(spec.tensors)
    ]


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
            raise CheckpointError(
                f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor"
            )
    specs = layout.group_tensors(
        (name, tuple(t.shape), layout.dtype_name(t.dtype)) for name, t in tensors.items()
    )
    store_root = open_root(root)
    save_id = begin_save(store_root, step, overwrite=overwrite)
    writer = ShardWriter(store_root, step, save_id, writer_id=0, num_writers=1)
    for spec in specs.values():
        for box, name, layer in single_writer_boxes(spec):
            tensor = tensors[name]
            # Only one layer is on the CPU at a time, not the whole stack.
            writer.write(box, tensor if layer is None else tensor.unsqueeze(0))
    writer.finish()
    result = commit(store_root, step, save_id, num_writers=1, metadata=metadata, timeout=0)
    return SaveResult(**{**result.__dict__, "seconds": time.perf_counter() - start})
