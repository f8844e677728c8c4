"""Turn raw text into an indexed dataset, and build the cached default dataset.

`preprocess_files` streams `.jsonl`/`.json` files (one JSON document per line), Parquet files
(one row per document) or plain text files (one document per file) through a tokenizer into
`PREFIX.bin/.idx`. Documents are cut into batches in input order by the main process and
tokenized by `workers` processes, with at most two batches per worker in flight; results are
written in batch order, so memory is bounded and the output is the same for any number of
workers. `prepare_default_dataset` builds a small dataset every
machine can make offline — the Python standard library's own sources — training a BPE on it
first, and caches the result under a key of everything that determines it:

    ds = prepare_default_dataset(".cache/data")          # ~seconds cold, instant warm
    IndexedDataset(ds.prefix), build_tokenizer(ds.tokenizer_spec)
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.indexed import (
    IndexedDatasetWriter,
    best_dtype,
    check_output_prefix,
    local_path,
)
from meshtrain.services.dataloader.inputs import iter_documents
from meshtrain.services.dataloader.tokenizers.base import (
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    train_bpe,
)

_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "__pycache__",
}
# Documents per encode_batch call, and the text bytes at which a batch is flushed early:
# large enough to keep the Rust tokenizer's threads busy, small enough to bound memory.
_BATCH_DOCS = 256
_BATCH_CHARS = 8 << 20
_DATA_NAME = "data"
_META_NAME = "meta.json"


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files(max_bytes: int) -> list[Path]:
    """The standard library's `.py` files, in relative-path order, up to `max_bytes` in total.

    Skips `site-packages`, test suites, `idlelib` and `lib2to3`. Files are taken in order and
    the list stops before the first file that would exceed `max_bytes`.

    Args:
        max_bytes: budget of source bytes.

    Returns:
        Absolute paths.
    """
    root = _stdlib_root()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                found.append((p.relative_to(root).as_posix(), p))
    found.sort()
    out: list[Path] = []
    total = 0
    for _, p in found:
        size = p.stat().st_size
        if total + size > max_bytes:
            break
        out.append(p)
        total += size
    if not out:
        raise DataError(f"{root}: no standard-library .py sources fit in max_bytes={max_bytes}")
    return out


def _iter_batches(inputs: Sequence[str | os.PathLike], json_key: str) -> Iterator[list[str]]:
    """Documents grouped into batches; the grouping depends only on the input, never on workers."""
    batch: list[str] = []
    chars = 0
    for path in inputs:
        for text in iter_documents(Path(path), json_key):
            batch.append(text)
            chars += len(text)
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str, parent: int) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(spec)
    threading.Thread(
        target=_exit_with_parent, args=(parent,), name="parent-watch", daemon=True
    ).start()


def _exit_with_parent(parent: int) -> None:
    """A worker whose preprocess was SIGKILLed (the OOM killer) waited for work forever: nothing
    tells a pool's workers that its process is gone. Once the parent changes, exit."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    assert _worker_tokenizer is not None, "worker initializer did not run"
    return _worker_tokenizer.encode_batch(texts)


def preprocess_files(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    json_key: str = "text",
    append_eod: bool = True,
    workers: int = 1,
    progress: bool = False,
) -> str:
    """Tokenize text files into `OUTPUT_PREFIX.bin/.idx`.

    Args:
        inputs: at least one file: `.jsonl`/`.json` files (one JSON object per line, text under
            `json_key`), `.parquet` files (text in column `json_key`; a null is an error, as in
            JSONL), or any other file, read as UTF-8 text (errors replaced, line ends kept byte for
            byte), one document per file. A gzip, bzip2, xz, zstd or zip file is an error.
        output_prefix: dataset path without extension.
        tokenizer: tokenizer; its vocabulary picks the token dtype (`best_dtype`).
        json_key: field (or Parquet column) holding the text.
        append_eod: append `tokenizer.eod_id` after each document (Megatron's `--append-eod`).
        workers: tokenizing processes; 1 tokenizes in this process. The output is identical
            for any value.
        progress: show a progress bar (documents) on stderr.

    Returns:
        The output prefix as a string. Documents that tokenize to nothing are skipped.
    """
    if workers < 1:
        raise DataError(f"workers={workers} must be >= 1")
    if not inputs:  # an empty dataset is never what was meant
        raise DataError(f"no input files to preprocess into {output_prefix}")
    prefix = str(output_prefix)
    check_output_prefix(prefix)
    outputs = {
        p.resolve(): p
        for p in (Path(local_path(prefix) + ".bin"), Path(local_path(prefix) + ".idx"))
    }
    for path in inputs:
        # `--input 'corpus/*' --output-prefix corpus/all` run twice read the first run's
        # all.bin and all.idx as two text documents of binary noise
        if Path(path).resolve() in outputs:
            raise DataError(
                f"input {str(path)!r} is a file of the output dataset {prefix!r} (from an earlier "
                "run?); leave it out of --input, or write the dataset elsewhere"
            )
    from tqdm import tqdm

    bar = tqdm(unit=" docs", disable=not progress, desc=Path(prefix).name)
    with IndexedDatasetWriter(prefix, best_dtype(tokenizer.vocab_size)) as writer:

        def write(encoded: list[list[int]]) -> None:
            for ids in encoded:
                if append_eod:
                    ids = list(ids) + [tokenizer.eod_id]
                if ids:
                    writer.add_document(ids)
            bar.update(len(encoded))

        if workers == 1:
            for batch in _iter_batches(inputs, json_key):
                write(tokenizer.encode_batch(batch))
        else:
            # spawn, not fork: the Rust tokenizers' thread pools do not survive a fork
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(
                workers,
                mp_context=ctx,
                initializer=_init_worker,
                initargs=(tokenizer.spec, os.getpid()),
            ) as pool:
                pending: list[Future] = []
                for batch in _iter_batches(inputs, json_key):
                    pending.append(pool.submit(_encode_in_worker, batch))
                    if len(pending) >= 2 * workers:
                        write(pending.pop(0).result())
                for fut in pending:
                    write(fut.result())
        if writer.num_documents == 0:  # raised inside: the writer removes what it wrote
            names = ", ".join(map(str, inputs[:3])) + (
                f" and {len(inputs) - 3} more" if len(inputs) > 3 else ""
            )
            raise DataError(
                f"no documents in {names}: every input is empty"
                f"{'' if append_eod else ' or holds only empty documents'}; nothing written to "
                f"{prefix}"
            )
    bar.close()
    return prefix


@dataclass(frozen=True)
class DefaultDataset:
    """Where the default dataset lives and how to decode it."""

    prefix: str  # IndexedDataset prefix
    tokenizer_spec: str  # "byte" or the path of the tokenizer.json
    vocab_size: int
    eod_id: int


def _cache_key(files: list[Path], tokenizer: str, vocab_size: int, max_bytes: int) -> str:
    root = _stdlib_root()
    desc = {
        "python": sys.version,
        "files": [[p.relative_to(root).as_posix(), p.stat().st_size] for p in files],
        "tokenizer": tokenizer,
        "vocab_size": vocab_size if tokenizer == "bpe" else 257,
        "max_bytes": max_bytes,
        # bump when the build recipe changes (2: text read without newline translation)
        "format": 2,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _load_cached(folder: Path) -> DefaultDataset:
    meta = json.loads((folder / _META_NAME).read_text())
    spec = meta["tokenizer_spec"]
    if spec != "byte":
        spec = str(folder / spec)  # stored relative, so the folder can move
    return DefaultDataset(
        str(folder / _DATA_NAME), spec, int(meta["vocab_size"]), int(meta["eod_id"])
    )


def prepare_default_dataset(
    cache_dir: str | os.PathLike,
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    max_bytes: int = 8_000_000,
) -> DefaultDataset:
    """Build (or find cached) the standard-library corpus dataset.

    The dataset is built in a temporary folder under `cache_dir` and renamed to
    `cache_dir/<key>` only when complete, so a killed or concurrent build never leaves a
    half-written cache; the loser of a concurrent race discards its copy.

    Args:
        cache_dir: cache root (created if missing).
        tokenizer: `"bpe"` (train a byte-level BPE on the corpus) or `"byte"`.
        vocab_size: BPE vocabulary size (ignored for `"byte"`).
        max_bytes: corpus size budget in bytes of source.

    Returns:
        A DefaultDataset pointing into `cache_dir/<key>/`.
    """
    if tokenizer not in ("bpe", "byte"):
        raise DataError(f"default dataset tokenizer {tokenizer!r} is not one of 'bpe', 'byte'")
    cache = Path(cache_dir)
    files = default_corpus_files(max_bytes)
    key = _cache_key(files, tokenizer, vocab_size, max_bytes)
    final = cache / key
    if (final / _META_NAME).is_file():
        return _load_cached(final)

    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=cache))
    try:
        if tokenizer == "bpe":
            tok: Tokenizer = train_bpe(list(files), vocab_size, tmp / "tokenizer.json")
            spec = "tokenizer.json"
        else:
            tok, spec = ByteTokenizer(), "byte"
        preprocess_files(files, tmp / _DATA_NAME, tok)
        meta = {
            "tokenizer_spec": spec,
            "vocab_size": tok.vocab_size,
            "eod_id": tok.eod_id,
            "num_files": len(files),
            "key": key,
        }
        (tmp / _META_NAME).write_text(json.dumps(meta, indent=1))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            os.rename(tmp, final)
        except OSError:
            # another process finished first; its copy is equivalent, keep it
            if not (final / _META_NAME).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _load_cached(final)
