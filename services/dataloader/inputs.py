"""Reading input files as documents: what `data preprocess` tokenizes and `data train-tokenizer`
trains on, so both see the same text.

JSONL (and `.json`) files hold one JSON object per line with the text under a key; Parquet
files a string column; any other file is one document of UTF-8 text (errors replaced).
Compressed files are refused rather than read as binary noise.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from meshtrain.services.common.errors import DataError

log = logging.getLogger("meshtrain.data")


class _Utf8Lines:
    """A file's lines as text-mode `open(path, encoding="utf-8", errors="replace")` gives them
    (CRLF and lone CR end lines too), counting the lines where bytes that are not UTF-8 were
    replaced, so the replacement is reported instead of silent (a Latin-1 file's accented
    letters all became U+FFFD, with nothing said)."""

    def __init__(self, path: Path):
        self.path = path
        self.bad_lines = 0
        self.first_bad: int | None = None

    def __iter__(self) -> Iterator[tuple[int, str]]:
        lineno = 0
        with open(self.path, "rb") as f:
            for raw in f:  # split at b"\n" only, which no multi-byte UTF-8 sequence contains
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("utf-8", errors="replace")
                    bad = True
                else:
                    bad = False
                pieces = [text]
                if (
                    "\r" in text
                ):  # CRLF and lone CR end lines, as in text mode (not str.splitlines's
                    # other line ends, such as U+2028, which a JSON string may hold as it is)
                    *ended, tail = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
                    pieces = [piece + "\n" for piece in ended] + ([tail] if tail else [])
                for piece in pieces:
                    lineno += 1
                    if bad and "\ufffd" in piece:
                        self.bad_lines += 1
                        self.first_bad = self.first_bad or lineno
                    yield lineno, piece

    def warn(self) -> None:
        if self.bad_lines:
            log.warning(
                "%s:%d: bytes that are not UTF-8 replaced with U+FFFD (%d line%s of the file; "
                "convert it to UTF-8 first, e.g. iconv -f latin1 -t utf-8)",
                self.path,
                self.first_bad,
                self.bad_lines,
                "" if self.bad_lines == 1 else "s",
            )


def decode_text(path: Path, data: bytes) -> str:
    """`data` (the whole of `path`) as UTF-8, bytes that are not replaced with U+FFFD and a
    warning naming the file and the first one's line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        log.warning(
            "%s:%d: bytes that are not UTF-8 replaced with U+FFFD (first at byte %d; convert the "
            "file to UTF-8 first, e.g. iconv -f latin1 -t utf-8)",
            path,
            line,
            e.start,
        )
        return data.decode("utf-8", errors="replace")


def _without_lone_surrogates(text: str) -> str:
    """JSON escapes like "\\ud800" decode to lone surrogates, which no UTF-8 tokenizer takes;
    they become U+FFFD, as invalid UTF-8 bytes in the input do (errors="replace")."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


# Leading bytes of compressed files: read as text, one would be tokenized as binary noise
# (a `.jsonl.gz` made one document of garbage, silently). None is valid UTF-8 text's start
# but zip's, whose control characters no text file begins with.
_COMPRESSED_MAGIC = {
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"\xfd7zXZ\x00": "xz",
    b"PK\x03\x04": "zip",
}


def refuse_compressed(path: Path) -> None:
    """Raise DataError if `path` starts like a gzip, zstd, xz, zip or bzip2 file."""
    with open(path, "rb") as f:
        head = f.read(10)
    kind = next((k for magic, k in _COMPRESSED_MAGIC.items() if head.startswith(magic)), None)
    if kind is None and head[:3] == b"BZh" and head[4:10] == b"1AY&SY":  # bzip2 + its block magic
        kind = "bzip2"
    if kind is not None:
        raise DataError(
            f"{path}: is {kind}-compressed; decompress it first (inputs are read as "
            f"plain text, JSONL or Parquet)"
        )


def iter_documents(path: Path, json_key: str) -> Iterator[str]:
    """The documents of one input file: a `.jsonl`/`.json` line's `json_key` string, a `.parquet`
    row's `json_key` column, or any other file's whole text (line ends kept byte for byte).

    Raises:
        DataError: naming the file (and line or row): missing, compressed, not JSON per line,
            no such key or column, a value that is not a string.
    """
    if not path.is_file():
        raise DataError(f"{path}: input file is missing")
    if path.suffix != ".parquet":
        refuse_compressed(path)
    if path.suffix in (".jsonl", ".json"):
        lines = _Utf8Lines(path)
        for lineno, line in lines:
            if lineno == 1:  # a byte order mark (Windows tools write one) is no part of the JSON
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not a JSON object per line ({e.msg})") from e
            if not isinstance(obj, dict):
                raise DataError(
                    f"{path}:{lineno}: is a JSON {type(obj).__name__}, not an object with key "
                    f"{json_key!r}"
                )
            if json_key not in obj:
                raise DataError(f"{path}:{lineno}: JSON document has no key {json_key!r}")
            text = obj[json_key]
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: {json_key!r} is {type(text).__name__}, not a string"
                )
            yield _without_lone_surrogates(text)
        lines.warn()
    elif path.suffix == ".parquet":
        yield from _iter_parquet(path, json_key)
    else:
        # bytes, then decoded: a text-mode read would rewrite CRLF and lone CR to LF, so the
        # stored tokens would not be the file's
        yield decode_text(path, path.read_bytes())


def _iter_parquet(path: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow, which is not installed "
            "(pip install 'meshtrain[parquet]')"
        ) from None

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    if column not in pf.schema_arrow.names:
        raise DataError(
            f"{path}: Parquet file has no column {column!r} (columns: {pf.schema_arrow.names})"
        )
    if not pa.types.is_string(pf.schema_arrow.field(column).type) and not pa.types.is_large_string(
        pf.schema_arrow.field(column).type
    ):
        raise DataError(
            f"{path}: Parquet column {column!r} is {pf.schema_arrow.field(column).type}, not string"
        )
    # row groups are read a few thousand rows at a time, so memory stays bounded
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[column]):
        for text in batch.column(0).to_pylist():
            if (
                text is None
            ):  # dropping it would lose a document silently; JSONL's null is an error too
                raise DataError(
                    f"{path}: row {row} (counting from 0): {column!r} is null, not a string"
                )
            yield text
            row += 1
