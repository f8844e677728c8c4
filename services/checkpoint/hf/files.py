"""Reading a Hugging Face model folder's files for `ckpt import` (`convert.py`):
where the folder is (a local path, or a repo id found in the Hugging Face cache without the
network), which safetensors file holds each tensor, the files opened, JSON read; each fault a
CheckpointError naming the file (an interrupted download, a shard from another one).

The cache is the hub's layout, under HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub: `models--<org>--<name>/refs/<branch>` holds the commit a branch points
at, `models--<org>--<name>/snapshots/<commit>/` the files (links into `blobs/`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.services.common.errors import CheckpointError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def model_folder(src: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The local folder of an import source, resolved without the network.

    Args:
        src: a folder holding `config.json` (a `file://` URL too; a snapshot folder of the cache
            is one), a cache folder `models--org--name`, or a repo id `org/name` looked up in the
            Hugging Face cache (a local folder of that name wins).
        revision: for a repo id or a cache folder: a branch or tag (its ref in the cache) or a
            commit; None: main.
        cache_dir: the hub cache; None: HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub.

    Raises:
        CheckpointError: a URL other than file://, or nothing found; says where it looked.
    """
    if "://" in src and not src.startswith("file://"):
        # safetensors maps local files; Path() would also turn s3://b/x into s3:/b/x and say it
        # holds no config.json
        raise CheckpointError(
            f"{src!r}: import reads a local folder, not a URL; copy the folder "
            "here first (e.g. `aws s3 sync URL DIR`) and import DIR"
        )
    path = Path(src.removeprefix("file://")).expanduser()
    if path.is_dir():
        if (path / "snapshots").is_dir() and path.name.startswith("models--"):
            return _snapshot(path, revision)
        if revision is not None:
            raise CheckpointError(
                f"{src}: a revision ({revision!r}) picks a snapshot of a repo id or of a cache "
                "folder models--org--name, not of a plain folder"
            )
        return path
    if path.exists() or not _REPO_ID.fullmatch(src):
        raise CheckpointError(f"{src}: no such folder, and not a Hugging Face repo id (org/name)")
    cache = Path(cache_dir).expanduser() if cache_dir else hub_cache()
    repo = cache / ("models--" + src.replace("/", "--"))
    if not repo.is_dir():
        raise CheckpointError(
            f"{src}: no such folder, and the Hugging Face cache {cache} holds no {repo.name} "
            "(import reads the cache offline: download it first, e.g. "
            f"`hf download {src}`, or pass the folder)"
        )
    return _snapshot(repo, revision)


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, from the environment as the hub library reads it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _snapshot(repo: Path, revision: str | None) -> Path:
    """The snapshot folder of a cached repo at `revision` (a ref name or a commit; None: main)."""
    revision = revision or "main"
    commit = revision
    if not _COMMIT.fullmatch(revision):
        ref = repo / "refs" / revision
        if not ref.is_file():
            refs = (
                sorted(
                    str(p.relative_to(repo / "refs"))
                    for p in (repo / "refs").rglob("*")
                    if p.is_file()
                )
                if (repo / "refs").is_dir()
                else []
            )
            raise CheckpointError(
                f"{repo}: no ref {revision!r} in the cache (refs there: {refs or 'none'}); "
                "name a cached branch, tag or commit"
            )
        commit = ref.read_text().strip()
    folder = repo / "snapshots" / commit
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{repo}: the snapshot of {revision!r} ({folder}) holds no config.json: "
            "a partial download? fetch it again"
        )
    return folder


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
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({e}); an interrupted download? "
            "fetch it again"
        ) from e


def _safe_open() -> Callable[..., Any]:
    """`safetensors.safe_open`; import needs the package (export writes the format itself)."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise CheckpointError(
            "importing Hugging Face weights needs the safetensors package "
            "(pip install 'safetensors>=0.4.3')"
        ) from e
    return safe_open
