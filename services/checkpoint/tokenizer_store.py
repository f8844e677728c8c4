"""Checkpoints carry their tokenizer's files, not a path to them.

A run's tokenizer spec holds absolute paths (`common/tokenizer_files.py`); a checkpoint
copied to another machine, or kept after the tokenizer file was edited or deleted, would name
files that are not there, or not the ones the model was trained with. So a save stores each
file as a one-dimensional uint8 array (`tokenizer.file0`, ...: checksummed and committed with
the manifest like every array, on any root) and records in the metadata the spec, the files'
names, sizes and sha256. A tokenizer.json's companions (its tokenizer_config.json, with the
special tokens' roles and the chat template, and a chat_template.jinja) are carried beside it,
marked `companion` in the record. `carried_spec` unpacks them into a folder keyed by their contents
(the same files once per machine) and returns the spec naming the copies; readers use it
before the recorded path (`tokenizer_spec`), which older checkpoints only have.

    boxes, record = tokenizer_boxes(spec)          # at save: rank 0 writes the boxes
    metadata[METADATA_KEY] = record
    spec = tokenizer_spec(root, step, metadata)    # at export / generate time
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.common.cache import user_cache_dir
from meshtrain.services.common.errors import CheckpointError, DataError
from meshtrain.services.common.tokenizer_files import companion_files, rebase_spec, spec_files

log = logging.getLogger("meshtrain.checkpoint")

PREFIX = "tokenizer."  # array names of carried files: not parameters, not optimizer state
METADATA_KEY = "tokenizer_files"


def tokenizer_boxes(
    spec: str | None,
) -> tuple[list[tuple[ShardSpec, torch.Tensor]], dict[str, Any] | None]:
    """The boxes that carry the files of `spec`, and the metadata record naming them
    (([], None) for a spec with no files: the byte and null tokenizers).

    Raises:
        CheckpointError: a file the spec names is missing or empty (the run's tokenizer is
            gone: the checkpoint could not carry it).
    """
    if not spec:
        return [], None
    try:
        files = spec_files(spec)
        companions = companion_files(spec)
    except DataError as e:
        raise CheckpointError(f"cannot carry the run's tokenizer in the checkpoint: {e}") from None
    if not files:
        return [], None
    boxes, entries = [], []
    listed = [(name, path, False) for name, path in files.items()]
    listed += [(name, path, True) for name, path in companions.items()]
    for i, (name, path, companion) in enumerate(listed):
        data = path.read_bytes()
        if not data:
            raise CheckpointError(
                f"cannot carry the run's tokenizer in the checkpoint: {str(path)!r} is empty"
            )
        array = f"{PREFIX}file{i}"
        tensor = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())  # (bytes,)
        boxes.append((ShardSpec(array, (len(data),), "uint8", (0,), (len(data),)), tensor))
        entry = {
            "name": name,
            "array": array,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        if companion:  # beside the spec's files, not named by the spec
            entry["companion"] = True
        entries.append(entry)
    return boxes, {"spec": str(spec), "files": entries}


def _cache_root() -> Path:
    return Path(user_cache_dir()) / "tokenizers"


def carried_spec(
    root: str,
    step: int,
    metadata: dict[str, Any],
    folder: str | os.PathLike | None = None,
    manifest: dict[str, Any] | None = None,
) -> str | None:
    """The tokenizer spec of the files checkpoint `step` carries, unpacked into `folder`
    (default: a folder named by the files' digest under the meshtrain cache), or None when the
    checkpoint carries none.

    Raises:
        CheckpointError: a carried file is missing from the checkpoint or does not match its
            recorded size and sha256.
    """
    from meshtrain.services.checkpoint.reader import read_tensor

    record = metadata.get(METADATA_KEY)
    if not record:
        return None
    entries = record["files"]
    digest = hashlib.sha256("".join(e["sha256"] for e in entries).encode()).hexdigest()[:24]
    folder = Path(folder) if folder is not None else _cache_root() / digest
    where = f"{root} step {step}"
    for entry in entries:
        target = folder / entry["name"]
        if target.is_file() and _sha256(target) == entry["sha256"]:
            continue  # unpacked before
        try:
            data = read_tensor(root, step, entry["array"], manifest=manifest).numpy().tobytes()
        except (KeyError, CheckpointError) as e:
            raise CheckpointError(
                f"{where}: the carried tokenizer file {entry['name']!r} "
                f"({entry['array']}) cannot be read: {e}"
            ) from None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(
                f"{where}: the carried tokenizer file {entry['name']!r} does not match its "
                "recorded size and sha256"
            )
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{entry['name']}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)  # whole, or not at all: another process may unpack the same files
    named = [e["name"] for e in entries if not e.get("companion")]
    return rebase_spec(record["spec"], named, folder)


def tokenizer_spec(
    root: str, step: int, metadata: dict[str, Any], manifest: dict[str, Any] | None = None
) -> str | None:
    """The spec to read checkpoint `step`'s tokenizer with: the files it carries, else (a
    checkpoint saved before they were carried, or an import without one) the recorded spec."""
    spec = carried_spec(root, step, metadata, manifest=manifest)
    return spec if spec is not None else metadata.get("tokenizer")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
