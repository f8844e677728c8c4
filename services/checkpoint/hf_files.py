"""Reading a Hugging Face model folder's files for `ckpt import` (`services/checkpoint/hf.py`):
which safetensors file holds each tensor, the files opened, JSON read; each fault a
CheckpointError naming the file (an interrupted download, a shard from another one).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.services.common.errors import CheckpointError


def safetensors_files(src: Path) -> dict[str, str]:
    """HF tensor name -> the safetensors file (relative to `src`) holding it."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map object")
        return dict(weight_map)
    single = src / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{src}: no model.safetensors or model.safetensors.index.json")
    return {name: single.name for name in open_safetensors(single).keys()}  # noqa: SIM118 (not a dict)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or CheckpointError naming it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


def open_safetensors(path: Path) -> Any:
    """`safe_open(path)`, or CheckpointError naming the file when it is not whole safetensors."""
    safe_open = _safe_open()
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError (or OSError) on a bad file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); an interrupted download? "
                              "fetch it again") from e


def _safe_open() -> Callable[..., Any]:
    """`safetensors.safe_open`; import needs the package (export writes the format itself)."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise CheckpointError("importing Hugging Face weights needs the safetensors package "
                              "(pip install 'safetensors>=0.4.3')") from e
    return safe_open
