"""LocalBatchSource: Megatron sampler order, data-parallel partition, purity, bounds."""

import random

import numpy as np
import pytest
import torch

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.indexed import IndexedDataset, IndexedDatasetWriter
from meshtrain.services.dataloader.loader import LocalBatchSource
from meshtrain.services.dataloader.samples import GPTDataset

SEQ = 8
GBS = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "ds"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(path, np.uint16) as w:
        for n in rng.integers(1, 40, size=30):
            w.add_document(rng.integers(0, 50000, size=n))
    indexed = IndexedDataset(path)
    return GPTDataset(indexed, np.arange(indexed.num_documents), SEQ, 4 * GBS + 3, seed=5)


def _rows(batches):
    return [tuple(b.tokens[i].tolist() + [b.labels[i, -1].item()]) for b in batches for i in range(len(b.tokens))]


def test_batch_shapes_and_shift(dataset):
    src = LocalBatchSource(dataset, micro_batch_size=4, global_batch_size=GBS)
    assert src.num_micro_batches == 4 and src.num_steps == 4
    b = src.get(1, 2)
    assert b.tokens.shape == b.labels.shape == b.loss_mask.shape == (4, SEQ)
    assert b.tokens.dtype == b.labels.dtype == torch.int64 and b.loss_mask.dtype == torch.float32
    assert torch.equal(b.tokens[:, 1:], b.labels[:, :-1]) and bool((b.loss_mask == 1).all())
    assert (b.step, b.microbatch) == (1, 2)
    # Megatron order: step 1, micro-batch 2 with dp=1 is shuffled samples 16 + 8 .. 16 + 12
    expected = np.stack([dataset[i] for i in range(GBS + 8, GBS + 12)])
    assert torch.equal(b.tokens, torch.from_numpy(expected[:, :-1]))


@pytest.mark.parametrize("step", [0, 3])
def test_ranks_partition_global_batch_identically_for_any_dp(dataset, step):
    global_batch = sorted(tuple(dataset[i].tolist()) for i in range(step * GBS, (step + 1) * GBS))
    for mbs in (1, 2):
        for dp in (1, 2, 4):
            rows = []
            for r in range(dp):
                src = LocalBatchSource(dataset, mbs, GBS, dp_rank=r, dp_size=dp)
                rows += _rows(src.micro_batches(step))
            assert len(rows) == GBS
            assert sorted(rows) == global_batch, f"mbs={mbs} dp={dp}"


def test_rank_slice_order(dataset):
    """dp=2, mbs=2: micro-batch m of step g, rank r is samples g*16 + m*4 + r*2 + [0, 2)."""
    for r in range(2):
        src = LocalBatchSource(dataset, 2, GBS, dp_rank=r, dp_size=2)
        for m in range(src.num_micro_batches):
            assert src.sample_indices(2, m).tolist() == [2 * GBS + m * 4 + r * 2 + k for k in range(2)]


def test_get_is_pure(dataset):
    src = LocalBatchSource(dataset, 2, GBS, dp_rank=1, dp_size=2)
    keys = [(s, m) for s in range(4) for m in range(src.num_micro_batches)]
    first = {k: src.get(*k).tokens for k in keys}
    random.Random(0).shuffle(keys)
    fresh = LocalBatchSource(dataset, 2, GBS, dp_rank=1, dp_size=2)
    for k in keys:
        assert torch.equal(fresh.get(*k).tokens, first[k])
        assert torch.equal(src.get(*k).tokens, first[k])


def test_errors(dataset):
    src = LocalBatchSource(dataset, 2, GBS, dp_rank=0, dp_size=2)
    src.get(3, 3)  # the last whole step is fine even though samples 64..66 are left over
    with pytest.raises(DataError, match="step 4"):
        src.get(4, 0)
    with pytest.raises(DataError, match="microbatch 4"):
        src.get(0, 4)
    with pytest.raises(DataError, match=r"global_batch_size=16.*micro_batch_size=3.*dp_size=2"):
        LocalBatchSource(dataset, 3, GBS, dp_size=2)
    with pytest.raises(DataError, match="dp_rank=2"):
        LocalBatchSource(dataset, 2, GBS, dp_rank=2, dp_size=2)


def test_eod_loss_mask_and_document_ids():
    from meshtrain.services.dataloader.loader import BatchOptions, batch_from_samples

    samples = np.array([[5, 9, 1, 9, 9, 2, 3]])  # EOD = 9
    b = batch_from_samples(samples, 0, 0, BatchOptions(eod_id=9, mask_eod_loss=True, document_ids=True))
    assert b.tokens.tolist() == [[5, 9, 1, 9, 9, 2]]
    assert b.loss_mask.tolist() == [[1, 0, 1, 0, 0, 1]]
    assert b.document_ids.tolist() == [[0, 0, 1, 1, 2, 3]]  # the EOD closes its own document
    plain = batch_from_samples(samples, 0, 0)
    assert plain.document_ids is None and plain.loss_mask.sum() == 6
    with pytest.raises(DataError, match="eod_id"):
        BatchOptions(mask_eod_loss=True)
