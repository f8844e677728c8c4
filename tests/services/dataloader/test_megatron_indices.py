"""meshtrain's split and its "megatron" sample order against megatron-core's own code.

megatron-core (a test extra) builds its GPTDataset splits on CPU without torch.distributed,
with its C++ sample-index helper (shipped built in its wheel). Its builder reads the datasets
meshtrain writes (and those its own writer makes, with several sequences per document), and
its document, sample and shuffle indices must equal ours bit for bit, dtypes included, as must
every sample. Cases span one to tens of epochs, with and without Megatron's separately
shuffled last epoch, and with empty documents.
"""

import types
from dataclasses import replace

import numpy as np
import pytest

from meshtrain.services.common.errors import ConfigError, DataError
from meshtrain.services.dataloader.config import DataConfig
from meshtrain.services.dataloader.indexed import IndexedDataset, IndexedDatasetWriter
from meshtrain.services.dataloader.loader import LocalBatchSource
from meshtrain.services.dataloader.samples import GPTDataset, split_ranges
from meshtrain.services.dataloader.spec import DatasetSpec, open_dataset
from tests.services.dataloader.conftest import served_limits

mcfg = pytest.importorskip(
    "megatron.core.datasets.blended_megatron_dataset_config",
    reason="megatron-core not installed (pip install megatron-core)",
)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402

SPLITS = ("90,5,5", "969,30,1", "1,1,1", "98,2,0", "8,1,1", "0.7,0.2,0.1")


def _megatron_matrix(split: str):
    """Megatron's split matrix of a `--split` string."""
    return mcfg.convert_split_vector_to_split_matrix(mcfg.parse_and_normalize_split(split))


def _megatron_edges(matrix, n: int) -> list[tuple[int, int] | None]:
    """Megatron's split of n sequences: the one line of its builder
    (`_build_megatron_dataset_splits`) that turns the split matrix into index ranges."""
    return [
        None if b is None else (int(round(b[0] * float(n))), int(round(b[1] * float(n))))
        for b in matrix
    ]


@pytest.mark.parametrize("split", SPLITS)
def test_split_ranges_match_megatron_for_every_size(split):
    """Every dataset size 1..50,000: the same three ranges (a split Megatron leaves out,
    None, is an empty range here), and an error here exactly where Megatron's train split is
    empty."""
    matrix = _megatron_matrix(split)
    for n in range(1, 50_001):
        expected = _megatron_edges(matrix, n)
        try:
            got = split_ranges(n, split)
        except DataError:
            assert expected[0] is None or expected[0][0] == expected[0][1], (split, n)
            continue
        for g, e in zip(got, expected):
            assert g == e if e is not None else g[0] == g[1], (split, n, got, expected)


def test_split_sweep_reaches_rounding_ties():
    """The sweep above can tell the arithmetic apart: summing raw weights before dividing
    (meshtrain's old way) puts one document elsewhere at hundreds of sizes for 90,5,5."""
    differ = 0
    cum = np.cumsum([90.0, 5.0, 5.0]) / 100.0
    for n in range(1, 50_001):
        naive = [0] + [round(float(c * n)) for c in cum[:-1]] + [n]
        differ += [(naive[i], naive[i + 1]) for i in range(3)] != split_ranges(n, "90,5,5")
    assert differ > 100


def _write_ours(prefix, seed, n_docs, max_len, empty_docs):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for n in rng.integers(0 if empty_docs else 1, max_len, size=n_docs):
            w.add_document(rng.integers(0, 60000, size=n))
    return str(prefix)


def _write_megatron_multi_sequence(prefix, seed, n_docs, max_len):
    """Documents of 1-3 sequences each, written by megatron-core's own builder."""
    import torch

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for _ in range(n_docs):
        for n in rng.integers(1, max_len, size=rng.integers(1, 4)):
            builder.add_item(torch.from_numpy(rng.integers(0, 2**20, size=n)))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def _megatron_splits(prefix, seed, seq_length, sizes, split, cache):
    tokenizer = types.SimpleNamespace(vocab_size=2**20, eod=0, unique_identifiers={"class": "test"})
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        path_to_cache=str(cache),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(
        MegatronGPTDataset, list(sizes), lambda: True, config
    ).build()


def _assert_same(ours: GPTDataset, theirs) -> None:
    for a, b, name in (
        (ours.doc_idx, theirs.document_index, "document index"),
        (ours.sample_idx, theirs.sample_index, "sample index"),
        (ours.shuffle_idx, theirs.shuffle_index, "shuffle index"),
    ):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b), name
    for k in range(len(ours)):
        sample = theirs[k]
        mine = ours[k]
        assert np.array_equal(mine[:-1], sample["tokens"].numpy()), k
        assert np.array_equal(mine[1:], sample["labels"].numpy()), k


# (seed, documents, max document length, seq_length, samples per split, split, empty documents,
#  per split: whether Megatron shuffles the last epoch apart)
CASES = [
    (1234, 50, 40, 16, (100, 10, 5), "90,5,5", False, (True, False, False)),  # 2-4 epochs
    (
        7,
        30,
        20,
        8,
        (1000, 50, 20),
        "8,1,1",
        True,
        (True, False, False),
    ),  # 6-34 epochs, empty documents
    (99, 1200, 100, 32, (37, 3, 3), "969,30,1", False, (False, False, False)),  # one or two epochs
    (3, 40, 60, 24, (250, 40, 40), "90,5,5", True, (True, True, False)),  # 7-14 epochs
    (2024, 64, 30, 5, (333, 21, 9), "80,15,5", False, (True, False, False)),  # odd seq_length
    # a third of the documents empty, one first in every split's stream: Megatron's row 0
    (6, 60, 4, 3, (60, 10, 10), "60,20,20", True, None),
]


@pytest.mark.parametrize("seed,n_docs,max_len,seq,sizes,split,empty,separate", CASES)
def test_indices_and_samples_match_megatron(
    tmp_path, seed, n_docs, max_len, seq, sizes, split, empty, separate
):
    prefix = _write_ours(tmp_path / "ds", seed, n_docs, max_len, empty)
    theirs = _megatron_splits(prefix, seed, seq, sizes, split, tmp_path / "mcache")
    indexed = IndexedDataset(prefix)
    ranges = split_ranges(len(indexed), split)
    for i, m in enumerate(theirs):
        assert np.array_equal(m.indices, np.arange(*ranges[i]))
        ours = GPTDataset(
            indexed, np.arange(*ranges[i]), seq, sizes[i], seed, sample_order="megatron"
        )
        _assert_same(ours, m)
        if separate is None:
            assert indexed.sequence_lengths[ours.doc_idx[0]] == 0
        else:  # the case covers the branch it names (CASES cover both)
            assert ours.separate_final_epoch == separate[i]


def test_megatron_order_counts_sequences(tmp_path):
    """Megatron's unit is the sequence: on a dataset of multi-sequence documents the split and
    the indices count sequences, through `open_dataset` as through `GPTDataset`."""
    prefix = _write_megatron_multi_sequence(tmp_path / "multi", 5, 60, 30)
    indexed = IndexedDataset(prefix)
    assert len(indexed) > indexed.num_documents
    sizes = (400, 30, 30)
    theirs = _megatron_splits(prefix, 11, 16, sizes, "90,5,5", tmp_path / "mcache")
    for i, name in enumerate(("train", "valid", "test")):
        spec = DatasetSpec(
            (prefix,),
            (1.0,),
            16,
            sizes[i],
            11,
            split="90,5,5",
            split_name=name,
            sample_order="megatron",
        )
        _assert_same(open_dataset(spec, cache=False), theirs[i])


def test_megatron_order_keeps_meshtrain_guarantees(tmp_path):
    """Batches stay a pure function of the spec (a fresh worker, from the cache or not, serves
    the same batch of any step to any rank), the option has its own cache entries, and a
    blend of Megatron-ordered parts serves each part's samples."""
    a = _write_ours(tmp_path / "a", 1, 80, 50, False)
    b = _write_ours(tmp_path / "b", 2, 50, 70, False)
    spec = DatasetSpec((a,), (1.0,), 16, 480, 17, split="90,5,5", sample_order="megatron")
    built = open_dataset(spec)  # builds and caches
    loaded = open_dataset(spec)  # memory-maps the cache
    fresh = open_dataset(spec, cache=False)
    theirs = _megatron_splits(a, 17, 16, (480, 1, 1), "90,5,5", tmp_path / "mcache")[0]
    _assert_same(loaded, theirs)
    assert (
        built.index_key
        == loaded.index_key
        != open_dataset(replace(spec, sample_order="meshtrain")).index_key
    )
    for step in (0, 7, 14):
        for rank in (0, 1):
            batches = [
                LocalBatchSource(ds, 4, 32, dp_rank=rank, dp_size=2).get(step, 3)
                for ds in (built, loaded, fresh)
            ]
            assert all(np.array_equal(x.tokens, batches[0].tokens) for x in batches[1:])
            # (step, micro-batch, rank) -> shuffled sample step*32 + micro*8 + rank*4 + j
            first = step * 32 + 3 * 8 + rank * 4
            assert np.array_equal(batches[0].tokens[0].numpy(), theirs[first]["tokens"].numpy())

    blend_spec = DatasetSpec(
        (a, b), (0.3, 0.7), 16, 300, 17, split="90,5,5", sample_order="megatron"
    )
    blend = open_dataset(blend_spec, cache=False)
    for part, prefix in zip(blend.datasets, (a, b)):
        assert part.sample_order == "megatron"
        alone = GPTDataset(
            IndexedDataset(prefix),
            np.arange(*split_ranges(len(part.indexed), "90,5,5")[0]),
            16,
            len(part),
            17,
            sample_order="megatron",
        )
        assert np.array_equal(part.shuffle_idx, alone.shuffle_idx)
    for i in range(len(blend)):
        d, k = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        assert np.array_equal(blend[i], blend.datasets[d][k])


def test_sample_order_is_checked_and_travels(tmp_path):
    from meshtrain.services.dataloader.rpc.servicer import spec_from_proto, spec_to_proto

    with pytest.raises(ConfigError, match="data.sample_order='mcore' is not one of"):
        DataConfig(sample_order="mcore")
    with pytest.raises(DataError, match="sample_order='Megatron' is not one of"):
        DatasetSpec(("x",), (1.0,), 16, 10, 1, sample_order="Megatron").validate()
    with pytest.raises(DataError, match="sample_order"):
        GPTDataset(
            IndexedDataset(_write_ours(tmp_path / "c", 3, 5, 9, False)),
            np.arange(5),
            4,
            5,
            1,
            sample_order="random",
        )
    prefix = _write_ours(tmp_path / "d", 4, 20, 30, False)
    spec = DatasetSpec((prefix,), (1.0,), 16, 10, 1, split="90,5,5", sample_order="megatron")
    message = spec_to_proto(spec)
    assert message.sample_order == "megatron" and spec_from_proto(message) == spec
    message.ClearField("sample_order")  # what a client that predates the field sends
    assert spec_from_proto(message).sample_order == "meshtrain"


def test_megatron_order_over_grpc_equals_in_process(tmp_path):
    """A data worker builds the order the spec names: its stream equals the in-process
    batches for any rank and step, and differs from meshtrain's order."""
    from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
    from meshtrain.services.dataloader.rpc.server import start_server

    a = _write_ours(tmp_path / "a", 1, 80, 50, False)
    b = _write_ours(tmp_path / "b", 2, 50, 70, False)
    spec = DatasetSpec((a, b), (0.4, 0.6), 16, 64 * 16, 5, split="90,5,5", sample_order="megatron")
    srv, port, _ = start_server(0, limits=served_limits())
    try:
        for rank in (0, 1):
            local = LocalBatchSource(open_dataset(spec), 2, 16, rank, 2)
            other = LocalBatchSource(
                open_dataset(replace(spec, sample_order="meshtrain")), 2, 16, rank, 2
            )
            with ServiceBatchSource(
                [f"127.0.0.1:{port}"], spec, 2, 16, rank, 2, prefetch=2
            ) as remote:
                for step in (0, 1, 50, 7):
                    for got, want, mesh in zip(
                        remote.micro_batches(step),
                        local.micro_batches(step),
                        other.micro_batches(step),
                        strict=True,
                    ):
                        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(
                            got.labels, want.labels
                        )
                        assert not np.array_equal(got.tokens, mesh.tokens)
    finally:
        srv.stop(0)


def test_a_worker_that_predates_the_order_is_refused(tmp_path):
    """A worker older than the field ignores it and would stream meshtrain's order: its
    Describe answer has no order, and the client stops with an error rather than train on it."""
    from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
    from meshtrain.services.common.grpc_server import make_server
    from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
    from meshtrain.services.dataloader.rpc.servicer import SERVICE_NAME, DataServicer

    class Older(DataServicer):
        def Describe(self, request, context):
            request.spec.ClearField("sample_order")  # it never read the field
            reply = super().Describe(request, context)
            reply.ClearField("sample_order")
            return reply

    a = _write_ours(tmp_path / "a", 1, 80, 50, False)
    spec = DatasetSpec((a,), (1.0,), 16, 64, 5, split="90,5,5", sample_order="megatron")
    srv, port, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(Older(), s)], [SERVICE_NAME]
    )
    try:
        with ServiceBatchSource([f"127.0.0.1:{port}"], spec, 2, 16, 0, 1, prefetch=2) as remote:
            with pytest.raises(
                DataError, match="serves sample_order 'meshtrain', not the 'megatron'.*upgrade"
            ):
                remote.micro_batches(0)
        with ServiceBatchSource(
            [f"127.0.0.1:{port}"], replace(spec, sample_order="meshtrain"), 2, 16, 0, 1
        ) as remote:
            assert len(remote.micro_batches(0)) == 8  # meshtrain's order is what it serves
    finally:
        srv.stop(0)


def test_the_trainer_config_reaches_the_dataset(tmp_path):
    """`--data.sample_order=megatron` on the trainer's command line: its train stream is
    Megatron's GPTDataset for train_iters x global_batch_size samples and the run's seed."""
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.data import build_data

    prefix = _write_ours(tmp_path / "t", 8, 80, 50, False)
    job = load_config(
        [
            "--data-path",
            prefix,
            "--tokenizer",
            "byte",
            "--seq-length",
            "16",
            "--split",
            "90,5,5",
            "--data.sample_order=megatron",
            "--seed",
            "21",
            "--train-iters",
            "10",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "2",
        ]
    )
    train = build_data(job).train
    assert train.dataset.sample_order == "megatron"
    theirs = _megatron_splits(prefix, 21, 16, (80, 1, 1), "90,5,5", tmp_path / "mcache")[0]
    batch = train.get(3, 2)  # samples 3*8 + 2*2 + (0, 1)
    for j in range(2):
        assert np.array_equal(batch.tokens[j].numpy(), theirs[28 + j]["tokens"].numpy())
