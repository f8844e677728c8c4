"""LocalBatchSource: Megatron sampler order, data-parallel partition, context-parallel slices,
purity, bounds."""

import random

import numpy as np
import pytest
import torch

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.indexed import IndexedDataset, IndexedDatasetWriter
from meshtrain.services.dataloader.loader import (
    BatchOptions,
    LocalBatchSource,
    batch_from_segments,
    context_positions,
)
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
    return [
        tuple(b.tokens[i].tolist() + [b.labels[i, -1].item()])
        for b in batches
        for i in range(len(b.tokens))
    ]


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
            assert src.sample_indices(2, m).tolist() == [
                2 * GBS + m * 4 + r * 2 + k for k in range(2)
            ]


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
    b = batch_from_samples(
        samples, 0, 0, BatchOptions(eod_id=9, mask_eod_loss=True, document_ids=True)
    )
    assert b.tokens.tolist() == [[5, 9, 1, 9, 9, 2]]
    assert b.loss_mask.tolist() == [[1, 0, 1, 0, 0, 1]]
    assert b.document_ids.tolist() == [[0, 0, 1, 1, 2, 3]]  # the EOD closes its own document
    plain = batch_from_samples(samples, 0, 0)
    assert plain.document_ids is None and plain.loss_mask.sum() == 6
    with pytest.raises(DataError, match="eod_id"):
        BatchOptions(mask_eod_loss=True)


@pytest.mark.parametrize(
    "sample,ids,positions",
    [
        # EOD (9) first: it ends an empty-before document of its own
        ([9, 4, 5, 9, 6, 7], [0, 1, 1, 1, 2], [0, 0, 1, 2, 0]),
        # EOD last input token: it ends the document; the next sample's token starts anew
        ([4, 5, 6, 7, 9, 1], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]),
        # consecutive EODs: each is a one-token document
        ([4, 9, 9, 9, 5, 6], [0, 0, 1, 2, 3], [0, 1, 0, 0, 0]),
        # no EOD: one document, plain positions
        ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]),
    ],
    ids=["eod-first", "eod-last", "consecutive-eods", "no-eod"],
)
def test_document_ids_and_positions_at_the_edges(sample, ids, positions):
    from meshtrain.services.dataloader.loader import BatchOptions, batch_from_samples

    opts = BatchOptions(eod_id=9, document_ids=True, position_ids=True)
    b = batch_from_samples(np.array([sample, sample[::-1]]), 0, 0, opts)
    assert b.document_ids.tolist()[0] == ids
    assert b.position_ids.tolist()[0] == positions
    assert b.document_ids.dtype == b.position_ids.dtype == torch.int32
    # the second row (reversed) on its own, by the definition: position = column - doc start
    row_ids = b.document_ids[1].tolist()
    starts = {d: row_ids.index(d) for d in set(row_ids)}
    assert b.position_ids[1].tolist() == [i - starts[d] for i, d in enumerate(row_ids)]
    only_positions = batch_from_samples(
        np.array([sample]), 0, 0, BatchOptions(eod_id=9, position_ids=True)
    )
    assert only_positions.document_ids is None
    assert only_positions.position_ids.tolist()[0] == positions
    with pytest.raises(DataError, match="eod_id"):
        BatchOptions(position_ids=True)


@pytest.mark.parametrize(
    "seq,cp,rank,want",
    [
        (8, 1, 0, list(range(8))),
        (8, 2, 0, [0, 1, 6, 7]),
        (8, 2, 1, [2, 3, 4, 5]),
        (16, 4, 0, [0, 1, 14, 15]),
        (16, 4, 1, [2, 3, 12, 13]),
        (16, 4, 3, [6, 7, 8, 9]),
        (7, 1, 0, list(range(7))),  # cp 1 cuts nothing, so any length does
    ],
)
def test_context_positions_layout(seq, cp, rank, want):
    got = context_positions(seq, rank, cp)
    assert got.dtype == np.int64 and got.tolist() == want


@pytest.mark.parametrize("seq,cp", [(8, 1), (8, 2), (8, 4), (24, 2), (24, 4), (64, 4)])
def test_context_positions_of_all_ranks_cover_the_sequence_once(seq, cp):
    ranks = [context_positions(seq, r, cp) for r in range(cp)]
    assert all(len(p) == seq // cp for p in ranks)
    assert sorted(np.concatenate(ranks).tolist()) == list(range(seq))


@pytest.mark.parametrize(
    "seq,rank,cp,match",
    [
        (10, 0, 4, r"seq_length=10 .* 2 x cp_size=4"),
        (12, 0, 4, r"seq_length=12 .* 2 x cp_size=4"),
        (8, 2, 2, r"cp_rank=2 is outside \[0, cp_size=2\)"),
        (8, -1, 2, r"cp_rank=-1 is outside \[0, cp_size=2\)"),
        (8, 1, 1, r"cp_rank=1 is outside \[0, cp_size=1\)"),
        (8, 0, 0, r"cp_size=0 must be >= 1"),
    ],
)
def test_context_positions_errors_name_the_values(seq, rank, cp, match):
    with pytest.raises(DataError, match=match):
        context_positions(seq, rank, cp)


@pytest.fixture(scope="module")
def eod_dataset(tmp_path_factory):
    """seq 16 over a 6-token vocabulary, so EOD (token 3) is common in every sample."""
    path = tmp_path_factory.mktemp("loader-cp") / "ds"
    rng = np.random.default_rng(1)
    with IndexedDatasetWriter(path, np.uint16) as w:
        for n in rng.integers(1, 40, size=40):
            w.add_document(rng.integers(0, 6, size=n))
    indexed = IndexedDataset(path)
    return GPTDataset(indexed, np.arange(indexed.num_documents), 16, 4 * GBS, seed=3)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_batches_are_the_full_batch_columns(eod_dataset, cp):
    options = BatchOptions(eod_id=3, mask_eod_loss=True)
    full = LocalBatchSource(eod_dataset, 2, GBS, dp_rank=1, dp_size=2, options=options)
    masked = 0
    for rank in range(cp):
        pos = torch.from_numpy(context_positions(16, rank, cp))
        src = LocalBatchSource(
            eod_dataset, 2, GBS, dp_rank=1, dp_size=2, options=options, cp_rank=rank, cp_size=cp
        )
        assert src.num_micro_batches == full.num_micro_batches
        for step in (0, 3):
            for got, want in zip(src.micro_batches(step), full.micro_batches(step), strict=True):
                assert got.tokens.shape == got.labels.shape == got.loss_mask.shape == (2, 16 // cp)
                assert torch.equal(got.tokens, want.tokens[:, pos])
                assert torch.equal(got.labels, want.labels[:, pos])
                assert torch.equal(got.loss_mask, want.loss_mask[:, pos])
                assert (got.step, got.microbatch) == (
                    want.step,
                    want.microbatch,
                ) and got.document_ids is None
                masked += int((got.loss_mask == 0).sum())
    assert masked > 0  # EOD masking was exercised


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_document_ids_and_positions_come_from_the_full_sample(eod_dataset, cp):
    """A rank's document ids and positions are the full batch's at its columns: they count
    the EODs in the chunks it does not hold."""
    options = BatchOptions(eod_id=3, document_ids=True, position_ids=True)
    full = LocalBatchSource(eod_dataset, 2, GBS, options=options)
    for rank in range(cp):
        pos = torch.from_numpy(context_positions(16, rank, cp))
        src = LocalBatchSource(eod_dataset, 2, GBS, options=options, cp_rank=rank, cp_size=cp)
        for got, want in zip(src.micro_batches(2), full.micro_batches(2), strict=True):
            for name in ("tokens", "labels", "loss_mask", "document_ids", "position_ids"):
                assert torch.equal(getattr(got, name), getattr(want, name)[:, pos]), name
    late = full.micro_batches(2)[0]
    assert int(late.document_ids[:, 8:].max()) > 0  # the late chunks follow earlier EODs


def test_context_parallel_payload_is_each_chunk_with_its_next_token(eod_dataset):
    src = LocalBatchSource(eod_dataset, 2, GBS, cp_rank=1, cp_size=2)  # chunks [4, 8) and [8, 12)
    samples, payload = src.samples(2, 1), src.payload(2, 1)
    assert payload.shape == (2, 2, 5) and payload.dtype == samples.dtype
    assert np.array_equal(payload[:, 0], samples[:, 4:9]) and np.array_equal(
        payload[:, 1], samples[:, 8:13]
    )
    assert np.array_equal(LocalBatchSource(eod_dataset, 2, GBS).payload(2, 1), samples)


def test_context_parallel_source_errors(eod_dataset):
    with pytest.raises(DataError, match=r"seq_length=16 .* cp_size=3"):
        LocalBatchSource(eod_dataset, 2, GBS, cp_rank=0, cp_size=3)
    with pytest.raises(DataError, match=r"cp_rank=2 is outside \[0, cp_size=2\)"):
        LocalBatchSource(eod_dataset, 2, GBS, cp_rank=2, cp_size=2)
    with pytest.raises(DataError, match="need the whole sample"):
        batch_from_segments(
            np.zeros((1, 2, 5), dtype=np.int64), 0, 0, BatchOptions(eod_id=3, position_ids=True)
        )
