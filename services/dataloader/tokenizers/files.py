"""The files behind a tokenizer spec, and the same spec pointed at copies of them.

A run names its tokenizer by a spec (`base.py`) that holds absolute paths: a
`tokenizer.json` or its folder, a `.tiktoken` ranks file, a SentencePiece `.model`, GPT-2's
`vocab.json` + `merges.txt`. A checkpoint that recorded only the spec stops working when those
files move or change, so checkpoints carry the files themselves (`checkpoint/tokenizer_store.py`):
`spec_files` lists what to carry, and `rebase_spec` turns the recorded spec into one that names
the copies, wherever they were unpacked.

    files = spec_files("gpt2bpe:/data/vocab.json,/data/merges.txt")  # {'vocab.json': ..., 'merges.txt': ...}
    rebase_spec("gpt2bpe:/data/vocab.json,/data/merges.txt", files, "/tmp/tok")
    # 'gpt2bpe:/tmp/tok/vocab.json,/tmp/tok/merges.txt'
"""

from __future__ import annotations

import os
from pathlib import Path

from meshtrain.services.common.errors import DataError


def _paths(spec: str) -> list[str]:
    """The path strings exactly as they appear in `spec`, in order."""
    if spec == "byte" or spec.startswith("null:"):
        return []
    if spec.startswith("gpt2bpe:"):
        return spec[len("gpt2bpe:") :].split(",")
    if spec.startswith("megatron-tiktoken:"):
        return [spec[len("megatron-tiktoken:") :].split(",")[0]]
    for prefix in ("tiktoken:", "sentencepiece:"):
        if spec.startswith(prefix):
            return [spec[len(prefix) :]]
    return [spec]


def spec_files(spec: str) -> dict[str, Path]:
    """The files the tokenizer of `spec` is read from, by the name each is carried under (its
    file name; `tokenizer.json` for a folder spec), in the order the spec names them.

    Raises:
        DataError: a file the spec names is missing, or two of its files share a name.
    """
    files: dict[str, Path] = {}
    for text in _paths(str(spec)):
        path = Path(text)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer spec {spec!r} names {str(path)!r}, which is not a file")
        if path.name in files:
            raise DataError(f"tokenizer spec {spec!r} names two files called {path.name!r}")
        files[path.name] = path
    return files


def rebase_spec(spec: str, names: list[str] | dict[str, Path], folder: str | os.PathLike) -> str:
    """`spec` naming `folder/NAME` for each of its files instead of where they were.

    Args:
        spec: the spec as recorded.
        names: the carried names, in the spec's order (`spec_files(spec)`'s keys).
        folder: where the carried files were unpacked.

    Raises:
        DataError: `names` does not match the files the spec names.
    """
    spec = str(spec)
    paths = _paths(spec)
    names = list(names)
    if len(paths) != len(names):
        raise DataError(
            f"tokenizer spec {spec!r} names {len(paths)} files, but {len(names)} were carried ({names})"
        )
    if not paths:
        return spec
    moved = [str(Path(folder) / name) for name in names]
    if spec.startswith("gpt2bpe:"):
        return "gpt2bpe:" + ",".join(moved)
    if spec.startswith("megatron-tiktoken:"):
        rest = spec[len("megatron-tiktoken:") :].split(",", 1)
        return "megatron-tiktoken:" + ",".join([moved[0], *rest[1:]])
    for prefix in ("tiktoken:", "sentencepiece:"):
        if spec.startswith(prefix):
            return prefix + moved[0]
    return moved[0]
