"""GPTDataset against a slow pure-Python reference; split ranges; determinism."""

import time

import numpy as np
import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.indexed import IndexedDataset, IndexedDatasetWriter
from meshtrain.services.dataloader.samples import GPTDataset, split_ranges
from meshtrain.services.dataloader.spec import DatasetSpec


def _make(tmp_path, lengths, dtype=np.uint16):
    """Documents of the given lengths; token values encode (doc, position) so mistakes show."""
    docs = [[(d * 37 + j) % 60000 for j in range(n)] for d, n in enumerate(lengths)]
    with IndexedDatasetWriter(tmp_path / "ds", dtype) as w:
        for doc in docs:
            w.add_document(doc)
    return IndexedDataset(tmp_path / "ds"), docs


def _reference_stream(ds, docs, documents):
    """The epoch-ordered token stream, in plain Python, checking each epoch is a permutation."""
    n = len(documents)
    order = ds.doc_idx.tolist()
    assert len(order) % n == 0
    stream = []
    for e in range(len(order) // n):
        epoch = order[e * n : (e + 1) * n]
        assert sorted(epoch) == sorted(documents.tolist()), (
            f"epoch {e} is not a permutation of the split"
        )
        for d in epoch:
            stream.extend(docs[d])
    return stream


@pytest.mark.parametrize("seq_length,num_samples", [(1, 50), (7, 40), (16, 100), (50, 9)])
def test_samples_match_reference(tmp_path, seq_length, num_samples):
    lengths = [5, 0, 13, 1, 30, 2, 0, 8, 21, 3]
    indexed, docs = _make(tmp_path, lengths)
    documents = np.arange(1, 9)  # a split that leaves out the first and last documents
    ds = GPTDataset(indexed, documents, seq_length, num_samples, seed=3)
    stream = _reference_stream(ds, docs, documents)
    assert len(stream) >= num_samples * seq_length + 1
    # the fewest epochs that fit every sample
    per_epoch = sum(lengths[d] for d in documents)
    assert (ds.num_epochs - 1) * per_epoch < num_samples * seq_length + 1
    assert sorted(ds.shuffle_idx.tolist()) == list(range(num_samples))
    for k in range(num_samples):
        expected = stream[k * seq_length : k * seq_length + seq_length + 1]
        assert ds.unshuffled(k).tolist() == expected, f"sample {k}"
    for i in range(num_samples):
        s = ds[i]
        assert s.dtype == np.int64 and s.shape == (seq_length + 1,)
        k = int(ds.shuffle_idx[i])
        assert s.tolist() == stream[k * seq_length : k * seq_length + seq_length + 1]


def test_shuffling_is_not_identity(tmp_path):
    indexed, _ = _make(tmp_path, [10] * 20)
    ds = GPTDataset(indexed, np.arange(20), 4, 200, seed=0)
    assert ds.shuffle_idx.tolist() != list(range(200))
    assert ds.doc_idx[:20].tolist() != list(range(20))


def test_determinism(tmp_path):
    indexed, _ = _make(tmp_path, [3, 9, 4, 17, 6, 11, 2, 8])
    a = GPTDataset(indexed, np.arange(8), 5, 60, seed=11)
    b = GPTDataset(indexed, np.arange(8), 5, 60, seed=11)
    c = GPTDataset(indexed, np.arange(8), 5, 60, seed=12)
    sa = np.stack([a[i] for i in range(60)])
    assert np.array_equal(sa, np.stack([b[i] for i in range(60)]))
    assert not np.array_equal(sa, np.stack([c[i] for i in range(60)]))


def test_errors(tmp_path):
    indexed, _ = _make(tmp_path, [0, 0, 5])
    with pytest.raises(DataError, match=r"ds \[valid\].*no tokens"):
        GPTDataset(indexed, np.arange(2), 4, 10, seed=0, name="valid")
    with pytest.raises(DataError, match="no documents"):
        GPTDataset(indexed, np.arange(0), 4, 10, seed=0)
    with pytest.raises(DataError, match="outside"):
        GPTDataset(indexed, np.array([3]), 4, 10, seed=0)
    ds = GPTDataset(indexed, np.arange(3), 4, 10, seed=0)
    with pytest.raises(IndexError):
        ds[10]


def test_split_ranges():
    assert split_ranges(1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, "1") == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges(10, "90/10") == [(0, 9), (9, 10), (10, 10)]
    for n in (7, 100, 12345):
        for split in ("969,30,1", "8,1,1", "1,1,1", "0.5,0.25,0.25"):
            r = split_ranges(n, split)
            assert r[0][0] == 0 and r[-1][1] == n
            assert all(r[i][1] == r[i + 1][0] and r[i][0] <= r[i][1] for i in range(2))
    with pytest.raises(DataError, match="train split empty"):
        split_ranges(10, "0,1,0")
    with pytest.raises(DataError, match="train split empty"):
        split_ranges(3, "1,100,0")
    with pytest.raises(DataError, match="train split empty"):
        split_ranges(1, "1,1,1")  # one document cannot give a third of itself to train
    for bad in ("a,b", "1,-1,0", "0,0,0", "1,1,1,1", "", "90,,10"):  # an empty field is not dropped
        with pytest.raises(DataError, match="split"):
            split_ranges(10, bad)
    # float() accepts these; they used to escape as a bare ValueError (UNKNOWN on a worker,
    # which clients retry as if transient) instead of a DataError naming the split string
    for bad in ("nan,1,1", "inf,1,1", "1,nan", "1,-inf", "1e308,1e308"):
        with pytest.raises(DataError, match=f"split {bad!r} must be finite"):
            split_ranges(10, bad)
        with pytest.raises(DataError, match="finite"):
            DatasetSpec(("x",), (1.0,), 16, 10, 1, split=bad).validate()


def test_ten_million_sample_index_builds_fast(tmp_path):
    """Guards the vectorized index build: a per-sample Python loop would take minutes here."""
    indexed, _ = _make(tmp_path, list(range(100, 600)))
    t = time.perf_counter()
    ds = GPTDataset(indexed, np.arange(500), 128, 10_000_000, seed=1)
    assert time.perf_counter() - t < 20
    assert len(ds) == 10_000_000 and ds[9_999_999].shape == (129,)


def test_an_empty_validation_split_names_a_split_to_pass(tmp_path):
    from meshtrain.services.dataloader.spec import open_dataset

    _make(tmp_path, [20] * 10)
    spec = DatasetSpec((str(tmp_path / "ds"),), (1.0,), 8, 4, 1, split_name="valid")
    with pytest.raises(
        DataError,
        match=r"leaves the valid split of its 10 documents empty; pass e.g. --split 90,10,0",
    ):
        open_dataset(spec, cache=False)
