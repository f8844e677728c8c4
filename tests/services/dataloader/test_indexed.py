"""MMIDIDX v1 reader/writer: round trips, the exact Megatron byte layout, and corruption."""

import errno
import io
import os
import struct

import fsspec
import numpy as np
import pytest

from meshtrain.services.common.errors import DataError, DataUnavailableError
from meshtrain.services.dataloader import indexed
from meshtrain.services.dataloader.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
)

MAGIC = b"MMIDIDX\x00\x00"


def _write(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d, dtype=dtype))
    return str(prefix)


@pytest.mark.parametrize("code,dtype", sorted(DTYPE_CODES.items()))
def test_round_trip_every_dtype(tmp_path, code, dtype):
    rng = np.random.default_rng(code)
    hi = 100 if dtype.kind in "iu" and dtype.itemsize == 1 else 1000
    docs = [rng.integers(0, hi, size=n).astype(dtype) for n in (5, 0, 1, 17, 3)]
    prefix = _write(tmp_path / "ds", docs, dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype == dtype and ds.num_documents == len(docs)
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        assert ds[i].dtype == dtype
    np.testing.assert_array_equal(ds.get(3, offset=2, length=4), docs[3][2:6])
    np.testing.assert_array_equal(ds[-1], docs[-1])
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))
    with open(prefix + ".idx", "rb") as f:
        assert f.read(18)[17] == code


def test_exact_idx_layout(tmp_path):
    """The bytes Megatron's _IndexWriter produces for two uint16 documents, built by hand."""
    _write(tmp_path / "ds", [[1, 2, 3], [400, 5]], np.uint16)
    expected_idx = (
        MAGIC
        + struct.pack("<Q", 1)  # version
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 2)  # sequences
        + struct.pack("<Q", 3)  # document index entries
        + struct.pack("<2i", 3, 2)  # lengths
        + struct.pack("<2q", 0, 6)  # byte pointers
        + struct.pack("<3q", 0, 1, 2)  # document index
    )
    assert (tmp_path / "ds.idx").read_bytes() == expected_idx
    assert (tmp_path / "ds.bin").read_bytes() == struct.pack("<5H", 1, 2, 3, 400, 5)


def test_reads_hand_built_multi_sequence_documents(tmp_path):
    """A Megatron file with 2 documents over 3 int32 sequences (sentence-split style)."""
    seqs = [[7, 8], [9], [10, 11, 12]]
    (tmp_path / "m.bin").write_bytes(b"".join(struct.pack(f"<{len(s)}i", *s) for s in seqs))
    (tmp_path / "m.idx").write_bytes(
        MAGIC
        + struct.pack("<QBQQ", 1, 4, 3, 3)
        + struct.pack("<3i", 2, 1, 3)
        + struct.pack("<3q", 0, 8, 12)
        + struct.pack("<3q", 0, 2, 3)
    )
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and ds.num_documents == 2 and len(ds) == 3
    assert [ds[i].tolist() for i in range(3)] == seqs
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])


def test_empty_dataset(tmp_path):
    prefix = _write(tmp_path / "e", [], np.uint16)
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.document_indices.tolist() == [0]


def test_best_dtype():
    assert best_dtype(257) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(200_000) == np.int32


def test_writer_abort_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        w.add_document([1, 2])
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", ["idx write", "idx rename"])
def test_writer_whose_finalize_fails_leaves_nothing(tmp_path, monkeypatch, failure):
    # finalize() runs in __exit__ after the block ended normally, so a failure there (a full
    # disk writing .idx) used to skip abort() and leave the temporary .bin, the whole token stream
    real_replace = os.replace

    class FullDisk(io.FileIO):  # the .idx temp file is created, then its first write fails
        def write(self, b):
            raise OSError(errno.ENOSPC, "simulated full disk")

    def replace_failing_on_idx(src, dst):
        if str(dst).endswith(".idx"):
            raise OSError(errno.ENOSPC, "simulated full disk")
        real_replace(src, dst)

    with (
        pytest.raises(OSError, match="simulated full disk"),
        IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w,
    ):
        w.add_document(np.arange(1000) % 250)
        if failure == "idx write":  # the .bin is already open: only the .idx opens after this
            monkeypatch.setattr(indexed, "open", FullDisk, raising=False)
        else:  # the .bin is renamed into place, then the .idx rename fails
            monkeypatch.setattr(os, "replace", replace_failing_on_idx)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with (
        IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w,
        pytest.raises(DataError, match="do not fit"),
    ):
        w.add_document([1, 70000])


def _good(tmp_path):
    return _write(tmp_path / "ds", [[1, 2, 3], [4, 5], [6]], np.uint16)


def _patch(path, offset, data):
    b = bytearray(path.read_bytes())
    b[offset : offset + len(data)] = data
    path.write_bytes(bytes(b))


def _corrupt_bad_magic(tmp_path):
    _patch(tmp_path / "ds.idx", 0, b"XXXXXXX")
    return "ds.idx", "magic"


def _corrupt_version(tmp_path):
    _patch(tmp_path / "ds.idx", 9, struct.pack("<Q", 2))
    return "ds.idx", "version"


def _corrupt_dtype(tmp_path):
    _patch(tmp_path / "ds.idx", 17, struct.pack("<B", 9))
    return "ds.idx", "dtype code"


def _corrupt_idx_short(tmp_path):
    p = tmp_path / "ds.idx"
    p.write_bytes(p.read_bytes()[:-8])
    return "ds.idx", "header"


def _corrupt_idx_long(tmp_path):
    p = tmp_path / "ds.idx"
    p.write_bytes(p.read_bytes() + b"\0" * 4)
    return "ds.idx", "header"


def _corrupt_bin_size(tmp_path):
    p = tmp_path / "ds.bin"
    p.write_bytes(p.read_bytes()[:-2])
    return "ds.bin", "bytes"


def _corrupt_pointer(tmp_path):
    # header 34 + 3 lengths x 4 -> pointers; pointer[1] should be 6
    _patch(tmp_path / "ds.idx", 34 + 12 + 8, struct.pack("<q", 4))
    return "ds.idx", "pointer"


def _corrupt_doc_index(tmp_path):
    _patch(tmp_path / "ds.idx", 34 + 12 + 24 + 8 * 3, struct.pack("<q", 2))
    return "ds.idx", "document index"


def _missing_idx(tmp_path):
    (tmp_path / "ds.idx").unlink()
    return "ds.idx", "missing"


def _missing_bin(tmp_path):
    (tmp_path / "ds.bin").unlink()
    return "ds.bin", "missing"


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_bad_magic,
        _corrupt_version,
        _corrupt_dtype,
        _corrupt_idx_short,
        _corrupt_idx_long,
        _corrupt_bin_size,
        _corrupt_pointer,
        _corrupt_doc_index,
        _missing_idx,
        _missing_bin,
    ],
)
def test_corruption_raises_data_error_naming_file(tmp_path, corrupt):
    prefix = _good(tmp_path)
    IndexedDataset(prefix)  # sanity: the uncorrupted file opens
    fname, what = corrupt(tmp_path)
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix)
    assert fname in str(e.value) and what in str(e.value)


def test_fsspec_url_reads_by_range(tmp_path):
    """A dataset on an fsspec filesystem (memory://, as s3:// would be)
    reads without a local copy."""
    import fsspec

    docs = [np.arange(n, dtype=np.uint16) * 3 for n in (5, 0, 17, 1, 40)]
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        for d in docs:
            w.add_document(d)
    fs = fsspec.filesystem("memory")
    for ext in (".bin", ".idx"):
        fs.pipe(f"/bucket/ds{ext}", (tmp_path / f"ds{ext}").read_bytes())
    ds = IndexedDataset("memory://bucket/ds")
    assert len(ds) == 5 and ds.num_tokens == 63
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)
    assert np.array_equal(ds.get(2, offset=3, length=4), docs[2][3:7])
    assert ds.fingerprint == IndexedDataset(tmp_path / "ds").fingerprint
    fs.pipe("/bucket/short.idx", (tmp_path / "ds.idx").read_bytes())
    fs.pipe("/bucket/short.bin", (tmp_path / "ds.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match=r"memory://bucket/short.bin: data file is 124 bytes"):
        IndexedDataset("memory://bucket/short")
    with pytest.raises(DataError, match=r"memory://bucket/none.idx: .*missing"):
        IndexedDataset("memory://bucket/none")


def _endpoint_connection_error():
    from botocore.exceptions import EndpointConnectionError

    return EndpointConnectionError(endpoint_url="http://127.0.0.1:1/flaky-read/ds")


@pytest.mark.parametrize(
    "error",
    [lambda: OSError(errno.ETIMEDOUT, "simulated S3 read timeout"), _endpoint_connection_error],
    ids=["OSError", "botocore"],
)
def test_a_failed_range_read_is_data_unavailable_naming_file_and_range(
    tmp_path, monkeypatch, error
):
    """A store's timeout is worth retrying (DataUnavailableError: UNAVAILABLE on a worker), not a
    bad dataset (a plain DataError: INVALID_ARGUMENT, which ended the run). s3fs lets botocore's
    connection errors through, which are not OSError: they escaped as themselves (UNKNOWN)."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    _write(tmp_path / "ds", [np.arange(50) for _ in range(4)], np.uint16)
    fs = fsspec.filesystem("memory")
    for ext in (".bin", ".idx"):
        fs.pipe(f"/flaky-read/ds{ext}", (tmp_path / f"ds{ext}").read_bytes())
    ds = IndexedDataset("memory://flaky-read/ds")

    def timeout(self, path, start=None, end=None, **kw):
        raise error()

    monkeypatch.setattr(MemoryFileSystem, "cat_file", timeout)
    with pytest.raises(
        DataUnavailableError, match=r"flaky-read/ds.bin: range read of tokens \[60, 70\) failed"
    ):
        ds.read_tokens(60, 10)
    with pytest.raises(
        DataUnavailableError, match=r"memory://flaky-read/ds.idx: reading the index failed"
    ):
        IndexedDataset("memory://flaky-read/ds")
    monkeypatch.undo()
    assert ds.read_tokens(60, 10).tolist() == list(range(10, 20))  # the next try reads


def test_a_store_that_fails_while_opening_is_data_unavailable_not_a_missing_file(
    tmp_path, monkeypatch
):
    """fsspec's `isfile` answers False for any error, so s3fs reported a timed-out HEAD as a
    missing file: a plain DataError, INVALID_ARGUMENT on a worker, which ended the run."""
    from fsspec.implementations.memory import MemoryFileSystem
    from fsspec.spec import AbstractFileSystem

    _write(tmp_path / "ds", [np.arange(50)], np.uint16)
    fs = fsspec.filesystem("memory")
    for ext in (".bin", ".idx"):
        fs.pipe(f"/flaky-open/ds{ext}", (tmp_path / f"ds{ext}").read_bytes())
    fs.mkdir("/flaky-open/dir.idx")
    # existence as s3fs (and most stores) answer it: through info(), errors swallowed
    monkeypatch.setattr(MemoryFileSystem, "isfile", AbstractFileSystem.isfile)
    with pytest.raises(
        DataError, match=r"memory://flaky-open/none.idx: indexed dataset file is missing"
    ):
        IndexedDataset("memory://flaky-open/none")
    with pytest.raises(
        DataError, match=r"memory://flaky-open/dir.idx: indexed dataset file is missing"
    ):
        IndexedDataset("memory://flaky-open/dir")

    def timeout(self, path, **kw):
        raise TimeoutError(errno.ETIMEDOUT, "simulated S3 HEAD timeout")

    monkeypatch.setattr(MemoryFileSystem, "info", timeout)
    with pytest.raises(
        DataUnavailableError, match=r"memory://flaky-open/ds.idx: the store failed .*HEAD timeout"
    ):
        IndexedDataset("memory://flaky-open/ds")
    monkeypatch.undo()
    assert IndexedDataset("memory://flaky-open/ds")[0].tolist() == list(range(50))


def test_a_file_url_prefix_is_a_local_path(tmp_path):
    prefix = _write(tmp_path / "ds", [[1, 2, 3], [4]], np.uint16)
    ds = IndexedDataset(f"file://{prefix}")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4]]


def test_a_url_fsspec_cannot_open_is_a_data_error_naming_it(tmp_path):
    """Opening the filesystem itself raised whatever the backend does (zip: FileNotFoundError,
    tar: ReadError, github: TypeError, ftp: ConnectionRefusedError), not a DataError: the
    in-process loader showed a traceback and a worker answered UNKNOWN."""
    from meshtrain.services.launcher.topology import free_port

    (tmp_path / "junk.tar").write_bytes(b"not a tar archive" * 100)
    for url in (
        f"zip://ds::file://{tmp_path}/none.zip",
        f"tar://ds::file://{tmp_path}/junk.tar",
        "github://x/y",
    ):
        with pytest.raises(DataError, match=f"{url}: cannot open this URL with fsspec") as e:
            IndexedDataset(url)
        assert not isinstance(e.value, DataUnavailableError)
    # nothing listens there: the store is unreachable, which another try may not be
    url = f"ftp://127.0.0.1:{free_port()}/ds"
    with pytest.raises(
        DataUnavailableError, match=f"{url}: connecting failed .*ConnectionRefusedError"
    ):
        IndexedDataset(url)


def test_a_local_path_the_system_refuses_is_a_data_error_naming_it(tmp_path):
    """Path.is_file raises for a name too long (ENAMETOOLONG), where it answers False for a
    missing file: the OSError escaped (a worker answered UNKNOWN, and its 20 kB message
    broke the status)."""
    long = str(tmp_path / ("x" * 300))
    with pytest.raises(
        DataError, match=r"x\.idx: cannot open the indexed dataset file \(File name too long\)"
    ):
        IndexedDataset(long)
    (tmp_path / "dir.idx").mkdir()
    (tmp_path / "dir.bin").mkdir()
    with pytest.raises(
        DataError, match=r"dir\.idx: indexed dataset file is missing \(not a regular file\)"
    ):
        IndexedDataset(tmp_path / "dir")
