"""Byte compatibility with Megatron-LM's MMIDIDX files, checked against megatron-core itself.

megatron-core is an independent implementation of the format (its IndexedDatasetBuilder and
IndexedDataset), installed from PyPI; it imports on CPU. Files it writes must read here with
identical tokens and document structure, and files written here must read there.
"""

import numpy as np
import pytest

from meshtrain.services.dataloader.indexed import IndexedDataset, IndexedDatasetWriter

mcore = pytest.importorskip(
    "megatron.core.datasets.indexed_dataset",
    reason="megatron-core not installed (pip install megatron-core)",
)


def _docs(seed, vocab):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(n)) for n in rng.integers(0, 50, size=40)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_writes_we_read(tmp_path, dtype):
    docs = _docs(1, 60000 if dtype == np.uint16 else 2**20)
    prefix = str(tmp_path / "mega")
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    import torch

    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(docs)
    assert ds.num_documents == len(docs)
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_we_write_megatron_reads(tmp_path, dtype):
    docs = _docs(2, 60000 if dtype == np.uint16 else 2**20)
    prefix = str(tmp_path / "ours")
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    ds = mcore.IndexedDataset(prefix, mmap=True)
    assert len(ds) == len(docs)
    assert np.array_equal(ds.document_indices, np.arange(len(docs) + 1))
    for i, d in enumerate(docs):
        assert np.array_equal(np.asarray(ds[i]), d)
        assert ds[i].dtype == np.dtype(dtype)
