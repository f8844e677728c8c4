"""Megatron `MMIDIDX` v1 indexed datasets: `PREFIX.bin` (tokens) + `PREFIX.idx` (index).

The format is Megatron-LM's `IndexedDataset`, byte for byte, so a dataset written by
Megatron's `preprocess_data.py` reads here and one written here trains in Megatron. `.idx`:

    9 bytes  magic b"MMIDIDX\\x00\\x00"
    <Q       version (1)
    <B       dtype code (uint8=1 int8=2 int16=3 int32=4 int64=5 float64=6 float32=7 uint16=8)
    <Q       sequence count N
    <Q       document count D (entries in the document index, i.e. documents + 1)
    int32[N] sequence lengths (tokens)
    int64[N] byte pointers of each sequence into `.bin`
    int64[D] document index: first sequence of each document, starting with 0, ending with N

`.bin` is the token arrays back to back. `IndexedDatasetWriter` streams `.bin` to disk and
writes both files under temporary names, renaming them into place only when complete.
`IndexedDataset` memory-maps both files and validates the header and sizes on open. A prefix
that is a URL (`s3://bucket/ds`, `memory://...`, any fsspec protocol but `file://`) is read
through fsspec instead: the `.idx` is fetched whole (it is small), and tokens are fetched by
byte range per read, so the `.bin` is never downloaded as a whole; a read the store fails
(a timeout, a reset connection) raises `DataUnavailableError`, worth retrying, not a bad dataset.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from array import array
from pathlib import Path
from typing import Self

import numpy as np

from meshtrain.services.common.builds import local_build_dir, remove_dead_builds
from meshtrain.services.common.errors import DataError, DataNotFoundError, DataUnavailableError

log = logging.getLogger("meshtrain.data")

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic + version + dtype code + sequence count + document count
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron uses for a vocabulary.

    Args:
        vocab_size: number of token ids (ids are 0..vocab_size-1).

    Returns:
        uint16 when the vocabulary fits (Megatron's threshold is 65500), else int32.
    """
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def local_path(prefix: str | os.PathLike) -> str:
    """A local prefix as a plain path (`file:///data/x` -> `/data/x`)."""
    s = str(prefix)
    return s.removeprefix("file://")


def _paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    prefix = local_path(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


# What object stores answer for a bucket or key that does not exist (botocore's error codes).
_MISSING_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "NotFound", "404"})


def names_missing(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, says the object or its bucket does not exist
    (FileNotFoundError, or a store's NoSuchBucket/NoSuchKey/404 that no backend translated)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, FileNotFoundError):
            return True
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            if str((response.get("Error") or {}).get("Code")) in _MISSING_CODES:
                return True
        cause = cause.__cause__ or cause.__context__
    return False


def is_remote(prefix: str | os.PathLike) -> bool:
    """True for fsspec URLs other than local files (`s3://...`, `memory://...`)."""
    s = str(prefix)
    return "://" in s and not s.startswith("file://")


class _RangeReader:
    """The token stream of a remote `.bin`, read by byte range on each slice.

    Slicing returns a fresh array, like slicing the local memory map. `cat_file` holds no
    file position, so one reader is safe to share between the data service's threads.
    """

    def __init__(self, fs, path: str, dtype: np.dtype, num_tokens: int):
        self._fs, self._path, self._dtype = fs, path, dtype
        self.size = num_tokens
        self.dtype = dtype

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self.size)
        if stop <= start:
            return np.zeros(0, dtype=self._dtype)
        item = self._dtype.itemsize
        try:
            data = self._fs.cat_file(self._path, start=start * item, end=stop * item)
        # a network or store error: another try or worker may succeed. Not only OSError:
        # backends raise their own types (botocore's EndpointConnectionError is not one)
        except Exception as e:
            raise DataUnavailableError(
                f"{self._path}: range read of tokens [{start}, {stop}) failed ({type(e).__name__}: "
                f"{e})"
            ) from e
        if len(data) != (stop - start) * item:
            raise DataError(
                f"{self._path}: range read returned {len(data)} of {(stop - start) * item} bytes"
            )
        return np.frombuffer(data, dtype=self._dtype)


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        allowed = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise DataError(f"token dtype {dtype} is not in the MMIDIDX format; allowed: {allowed}")
    return _CODE_OF_DTYPE[dtype]


def check_output_prefix(prefix: str | os.PathLike) -> None:
    """Raise DataError unless `prefix` can name a dataset the writer makes: a local path (or
    `file://`) that is not a folder. A URL was written into a local folder named after its
    scheme (`s3:/bucket/x.bin`), and a folder (`data/`) got hidden files `data/.bin`."""
    s = str(prefix)
    if is_remote(s):
        raise DataError(
            f"output prefix {s!r}: datasets are written to local files only; write it "
            f"locally, then copy PREFIX.bin and PREFIX.idx there (e.g. aws s3 cp)"
        )
    local = local_path(s)
    if not local or local.endswith(("/", os.sep)) or Path(local).is_dir():
        example = os.path.join(local or ".", "corpus")
        raise DataError(
            f"output prefix {s!r} is a folder; name the dataset inside it, e.g. {example!r} "
            f"(which writes {example}.bin and {example}.idx)"
        )


class IndexedDatasetWriter:
    """Streams documents into `PREFIX.bin` and writes `PREFIX.idx` at the end.

    Each `add_document(tokens)` appends one document made of one sequence. Tokens go
    straight to the (temporary) `.bin` file; only the per-sequence lengths stay in memory.
    Use as a context manager: leaving the block normally finalizes, leaving it with an
    exception deletes the temporary files, and so does a finalize that fails (a full disk), so
    a crash never leaves a readable half dataset or a stray temporary copy of the tokens.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        """Args:
        prefix: output path without extension; `PREFIX.bin` and `PREFIX.idx` are written.
        dtype: token dtype, one of the MMIDIDX dtypes (see `best_dtype`).
        """
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(self.dtype)
        check_output_prefix(self.prefix)
        self._bin_path, self._idx_path = _paths(self.prefix)
        # Host and pid in the name (.tmp-HOST-PID-HEX): two writers of the same prefix never share
        # a temp file, and the next writer removes those of a writer that was killed (SIGKILL,
        # out of memory), dataset-sized files that nothing else would ever remove.
        suffix = local_build_dir("")
        self._bin_tmp = Path(str(self._bin_path) + suffix)
        self._idx_tmp = Path(str(self._idx_path) + suffix)
        try:
            self._bin_path.parent.mkdir(parents=True, exist_ok=True)
            for final in (self._bin_path, self._idx_path):
                for dead in remove_dead_builds(str(final)):
                    log.warning(
                        "removed %s, left by a writer of %s that was killed", dead, self.prefix
                    )
            self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - open until finalize/abort close it
        except OSError as e:  # a parent that is a file, no permission: a traceback before
            why = (
                f"{e.filename} is a file, not a folder"
                if isinstance(e, (FileExistsError, NotADirectoryError))
                else f"{e.strerror or e}: {e.filename or self._bin_path}"
            )
            raise DataError(
                f"output prefix {self.prefix!r}: cannot write {self._bin_path} ({why})"
            ) from e
        self._lengths = array("i")  # int32, Megatron's sequence length type
        self._closed = False
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._range = None

    def add_document(self, tokens) -> None:
        """Append one document (one sequence).

        Args:
            tokens: 1-D array-like of token ids; must fit in the writer's dtype.
        """
        if self._closed:
            raise DataError(f"{self._bin_path}: add_document after finalize/abort")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"{self._bin_path}: a document must be 1-D, got shape {arr.shape}")
        if arr.size and self._range is not None:
            lo, hi = int(arr.min()), int(arr.max())
            # a silent wrap-around (e.g. id 70000 into uint16) would corrupt training data
            if lo < self._range[0] or hi > self._range[1]:
                raise DataError(
                    f"{self._bin_path}: token ids in [{lo}, {hi}] do not fit dtype {self.dtype}"
                )
        if arr.size >= 2**31:
            raise DataError(f"{self._bin_path}: document of {arr.size} tokens exceeds int32 length")
        self._bin.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self._lengths.append(arr.size)

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def finalize(self) -> str:
        """Write `.idx`, then rename both files into place (`.idx` last: it is the commit).

        If any of it fails (a full disk while writing `.idx`, a failed rename), the temporary
        files, and a `.bin` already renamed into place, are removed before the error is
        re-raised: `__exit__` only aborts when its block raised, not when finalizing did.

        Returns:
            The prefix.
        """
        if self._closed:
            return self.prefix
        bin_in_place = False
        try:
            self._write_index()
            # An older dataset's .idx goes first: killed between the two renames, a new .bin
            # beside the old .idx would look complete (and can match its size).
            self._idx_path.unlink(missing_ok=True)
            os.replace(self._bin_tmp, self._bin_path)
            bin_in_place = True
            os.replace(self._idx_tmp, self._idx_path)
        except BaseException:
            self.abort()
            if bin_in_place:  # without its .idx (or beside an older one) it is no dataset
                self._bin_path.unlink(missing_ok=True)
            raise
        self._closed = True
        return self.prefix

    def _write_index(self) -> None:
        """Close `.bin` and write the whole index to the temporary `.idx`."""
        self._bin.close()
        lengths = (
            np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        )
        n = lengths.size
        pointers = np.zeros(n, dtype=np.int64)
        if n > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        # one sequence per document, so document i starts at sequence i; the trailing N closes it
        doc_index = np.arange(n + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", self._code))
            f.write(struct.pack("<Q", n))
            f.write(struct.pack("<Q", doc_index.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_index.astype("<i8").tobytes())

    def abort(self) -> None:
        """Close and delete the temporary files; nothing is left at the prefix."""
        if self._closed:
            return
        self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of a `PREFIX.bin` / `PREFIX.idx` pair.

    `ds[i]` is sequence i as a numpy array (a view into the memory map); `len(ds)` is the
    number of sequences. Opening validates the whole index against the header and `.bin` size.
    """

    def __init__(self, prefix: str | os.PathLike):
        """Args:
        prefix: path without extension.
        """
        self.prefix = str(prefix)
        self._fingerprint: str | None = None
        self._fs = None
        if is_remote(self.prefix):
            import fsspec

            try:
                self._fs, root = fsspec.core.url_to_fs(self.prefix)
            # Not only ImportError/ValueError: constructors raise whatever their backend does
            # (zip: FileNotFoundError, tar: ReadError, github: TypeError), which escaped as a bug
            except (ConnectionError, TimeoutError) as e:  # a constructor that connects (ftp)
                raise DataUnavailableError(
                    f"{self.prefix}: connecting failed ({type(e).__name__}: {e})"
                ) from e
            except Exception as e:
                raise DataError(
                    f"{self.prefix}: cannot open this URL with fsspec ({type(e).__name__}: {e})"
                ) from e
            # the URLs as given name the files in messages; fsspec's own paths drop the protocol
            self.bin_path: str | Path = self.prefix + ".bin"
            self.idx_path: str | Path = self.prefix + ".idx"
            self._remote = (root + ".bin", root + ".idx")
            self._bin_size = 0
            for url, p in zip((self.idx_path, self.bin_path), (self._remote[1], self._remote[0])):
                # not fs.isfile: it answers False for any error, so a store that timed out was
                # reported as a missing file, a bad dataset that ends the run instead of a retry
                try:
                    info = self._fs.info(p)
                except FileNotFoundError:
                    raise DataNotFoundError(f"{url}: indexed dataset file is missing") from None
                except PermissionError as e:  # credentials: another try does not help
                    raise DataError(f"{url}: access denied ({e})") from e
                except (
                    Exception
                ) as e:  # backends raise their own types (botocore's are not OSError)
                    if names_missing(e):  # a bucket that does not exist: no retry finds it
                        raise DataNotFoundError(
                            f"{url}: indexed dataset file is missing (no such bucket or key)"
                        ) from None
                    raise DataUnavailableError(
                        f"{url}: the store failed to answer whether the file exists "
                        f"({type(e).__name__}: {e})"
                    ) from e
                if info.get("type") != "file":
                    raise DataError(
                        f"{url}: indexed dataset file is missing (a {info.get('type')} is there)"
                    )
                self._bin_size = int(info.get("size") or 0)  # the .bin's, read last
        else:
            self.bin_path, self.idx_path = _paths(self.prefix)
            for p in (self.idx_path, self.bin_path):
                try:  # is_file raises for some errors: a name too long, a folder it may not read
                    os.stat(p)
                except FileNotFoundError:
                    raise DataNotFoundError(f"{p}: indexed dataset file is missing") from None
                except OSError as e:
                    raise DataError(
                        f"{p}: cannot open the indexed dataset file ({e.strerror})"
                    ) from None
                if not Path(p).is_file():
                    raise DataError(f"{p}: indexed dataset file is missing (not a regular file)")
        self._read_index()
        self._open_bin()

    def _read_index(self) -> None:
        path = self.idx_path
        if self._fs is not None:
            try:
                blob = self._fs.cat_file(self._remote[1])  # small: 20 bytes per sequence
            except FileNotFoundError:
                raise DataNotFoundError(f"{path}: indexed dataset file is missing") from None
            except Exception as e:  # as in the open above: backends raise their own types
                if names_missing(e):
                    raise DataNotFoundError(f"{path}: indexed dataset file is missing") from None
                raise DataUnavailableError(
                    f"{path}: reading the index failed ({type(e).__name__}: {e})"
                ) from e
            size, header = len(blob), blob[:HEADER_SIZE]
        else:
            size = Path(path).stat().st_size
            with open(path, "rb") as f:
                header = f.read(HEADER_SIZE)
        if len(header) < len(MAGIC) or header[: len(MAGIC)] != MAGIC:
            raise DataError(
                f"{path}: bad magic {header[: len(MAGIC)]!r}, expected {MAGIC!r} (not an MMIDIDX "
                "index)"
            )
        if len(header) < HEADER_SIZE:
            raise DataError(f"{path}: truncated header ({len(header)} of {HEADER_SIZE} bytes)")
        (version,) = struct.unpack_from("<Q", header, 9)
        if version != VERSION:
            raise DataError(f"{path}: MMIDIDX version {version} is not supported (only {VERSION})")
        (code,) = struct.unpack_from("<B", header, 17)
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code}; known: {sorted(DTYPE_CODES)}")
        self._dtype = DTYPE_CODES[code]
        n, d = struct.unpack_from("<QQ", header, 18)
        expected = HEADER_SIZE + 4 * n + 8 * n + 8 * d
        if size != expected:
            raise DataError(
                f"{path}: index is {size} bytes but its header ({n} sequences, {d} document "
                f"entries) says {expected}; the file is truncated or has trailing data"
            )
        # one map (or buffer) for the whole index; the three arrays are views into it
        buf = (
            np.frombuffer(blob, np.uint8)
            if self._fs is not None
            else np.memmap(path, dtype=np.uint8, mode="r")
        )
        off = HEADER_SIZE
        self._lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=off)  # (N,)
        off += 4 * n
        self._pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=off)  # (N,)
        off += 8 * n
        self._doc_index = np.frombuffer(buf, dtype="<i8", count=d, offset=off)  # (D,)
        self._validate_index(n)

    def _validate_index(self, n: int) -> None:
        path = self.idx_path
        lengths, pointers = self._lengths, self._pointers
        if n:
            if lengths.min() < 0:
                raise DataError(
                    f"{path}: negative sequence length at sequence {int(np.argmin(lengths))}"
                )
            expected = np.zeros(n, dtype=np.int64)
            expected[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self._dtype.itemsize
            bad = np.nonzero(pointers != expected)[0]
            if bad.size:
                i = int(bad[0])
                raise DataError(
                    f"{path}: sequence pointer {i} is {int(pointers[i])} but the lengths before it "
                    f"place it at byte {int(expected[i])}; pointers and lengths are inconsistent"
                )
        di = self._doc_index
        if di.size == 0 or di[0] != 0 or di[-1] != n or (di.size > 1 and np.any(np.diff(di) < 0)):
            raise DataError(
                f"{path}: document index must be non-decreasing from 0 to the sequence count {n}"
            )

    def _open_bin(self) -> None:
        n = len(self._lengths)
        itemsize = self._dtype.itemsize
        expected = int(self._pointers[-1]) + int(self._lengths[-1]) * itemsize if n else 0
        size = self._bin_size if self._fs is not None else Path(self.bin_path).stat().st_size
        if size != expected:
            raise DataError(
                f"{self.bin_path}: data file is {size} bytes but {Path(str(self.idx_path)).name} "
                f"says {expected} (last pointer + last length x {itemsize})"
            )
        # (num_tokens,) flat token stream; np.memmap refuses empty files
        if self._fs is not None:
            self._tokens: _RangeReader | np.ndarray = _RangeReader(
                self._fs, self._remote[0], self._dtype, size // itemsize
            )
        elif size:
            self._tokens = np.memmap(self.bin_path, dtype=self._dtype, mode="r").view(np.ndarray)
        else:
            self._tokens = np.zeros(0, dtype=self._dtype)
        self._starts = self._pointers // itemsize  # (N,) token offset of each sequence

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence i, or a window of it.

        Args:
            i: sequence index (negative counts from the end).
            offset: first token within the sequence.
            length: number of tokens; None reads to the end of the sequence.

        Returns:
            (length,) array of the dataset dtype, a read-only view of the memory map.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.prefix}: sequence {i} out of range [0, {n})")
        i %= n
        seq_len = int(self._lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"{self.prefix}: window offset={offset} length={length} outside sequence {i} "
                f"of {seq_len} tokens"
            )
        start = int(self._starts[i]) + offset
        return self._tokens[start : start + length]

    def read_tokens(self, start: int, length: int) -> np.ndarray:
        """A window of the flat token stream (all sequences back to back, file order).

        Args:
            start: token offset from the beginning of `.bin`.
            length: number of tokens.

        Returns:
            (length,) read-only view of the memory map.
        """
        if start < 0 or length < 0 or start + length > self._tokens.size:
            raise IndexError(
                f"{self.prefix}: token window [{start}, {start + length}) outside [0, "
                f"{self._tokens.size})"
            )
        return self._tokens[start : start + length]

    @property
    def sequence_lengths(self) -> np.ndarray:
        """(N,) int32 tokens per sequence."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """(N,) int64 byte offset of each sequence in `.bin`."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """(documents + 1,) int64 first sequence of each document, ending with N."""
        return self._doc_index

    @property
    def num_documents(self) -> int:
        return len(self._doc_index) - 1

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the dtype and index arrays: identifies the content for index caches.

        The token values do not enter sample indices, only the sequence and document layout,
        so hashing `.idx` content (not the larger `.bin`) is enough and fast.
        """
        if self._fingerprint is None:
            h = hashlib.sha256(self._dtype.str.encode())
            for a in (self._lengths, self._doc_index):
                h.update(np.ascontiguousarray(a).data.cast("B"))
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def num_tokens(self) -> int:
        return int(self._tokens.size)
