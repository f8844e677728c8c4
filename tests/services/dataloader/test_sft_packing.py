"""Packed SFT samples: whole conversations, padding, the shifted loss mask, document ids, and
the same batches from the data service as in-process."""

import random
from dataclasses import replace

import numpy as np
import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.loader import BatchOptions, LocalBatchSource
from meshtrain.services.dataloader.packing import pack_first_fit
from meshtrain.services.dataloader.sft_data import open_sft_parts, preprocess_chat
from meshtrain.services.dataloader.spec import DatasetSpec, open_dataset
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer

from .chat_data import reverse_conversation, write_chat_tokenizer, write_chats


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """(spec, tokenizer) of 120 reverse-a-word conversations (38 to 54 tokens), seq_length 127."""
    d = tmp_path_factory.mktemp("sft")
    tok = build_tokenizer(str(write_chat_tokenizer(d / "tok")))
    rng = random.Random(0)
    rows = [reverse_conversation(rng, size=(2, 8)) for _ in range(120)]
    preprocess_chat([write_chats(d / "c.jsonl", rows)], d / "ds", tok, template="chatml")
    spec = DatasetSpec(
        (str(d / "ds"),), (1.0,), seq_length=127, num_samples=96, seed=3, split="90,10,0",
        format="sft",
    )  # fmt: skip
    return spec, tok


def test_first_fit_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, size=500)
    bins = pack_first_fit(lengths, 64, window=8)
    sums = np.bincount(bins, weights=lengths)
    assert sums.max() <= 64 and bins.size == 500
    assert set(np.unique(bins)) == set(range(bins.max() + 1))  # no empty bin number
    # first fit over 8 open bins fills them fuller than next fit (one open bin) does
    next_fit = np.bincount(pack_first_fit(lengths, 64, window=1), weights=lengths)
    assert sums[:-8].mean() > 55 > next_fit[:-1].mean() + 5
    assert np.array_equal(bins, pack_first_fit(lengths, 64, window=8))


def test_samples_hold_whole_conversations_then_padding(sft):
    spec, tok = sft
    ds = open_dataset(spec, cache=False)
    tokens, mask, _ = open_sft_parts(spec.prefixes[0])
    stored = {tuple(tokens[i]): mask[i] for i in range(tokens.num_documents)}
    n = spec.seq_length + 1
    seen = 0
    for i in range(len(ds)):
        t, m, d = np.empty(n, np.int64), np.empty(n, np.uint8), np.empty(n, np.int32)
        ds.read_into(i, t, mask_out=m, docs_out=d)
        assert np.all(np.diff(d) >= 0) and np.all(np.diff(d) <= 1) and d[0] == 0
        b = int(ds.shuffle_idx[i])
        pad = d == ds.bin_ptr[b + 1] - ds.bin_ptr[b]  # the id after the conversations'
        assert np.all(t[pad] == tok.eod_id) and not m[pad].any()
        for k in np.unique(d[~pad]):
            conv = tuple(t[d == k])
            assert conv in stored  # whole: exactly a stored conversation, never a cut one
            want = stored[conv].copy()
            want[0] = 0
            assert np.array_equal(m[d == k], want)
            seen += 1
        assert (~pad).sum() > n // 2  # 2 or 3 conversations fill most of each sequence
    assert seen > len(ds) * 2


def test_every_conversation_once_per_epoch(sft):
    spec, _ = sft
    ds = open_dataset(replace(spec, num_samples=200), cache=False)
    tokens, _, _ = open_sft_parts(spec.prefixes[0])
    train_docs = 108  # 90% of 120
    counts = np.bincount(ds.bin_docs, minlength=tokens.num_documents)
    assert counts[train_docs:].sum() == 0  # no valid conversation in train
    # complete epochs hold each conversation once; the last one is partly used
    assert counts[:train_docs].max() - counts[:train_docs].min() <= 1
    assert counts.sum() > 2 * train_docs


def test_loss_mask_counts_exactly_the_labels_that_are_assistant_tokens(sft):
    spec, tok = sft
    src = LocalBatchSource(open_dataset(spec, cache=False), 4, 16, 1, 2)
    for step in range(2):
        for mb in range(src.num_micro_batches):
            batch = src.get(step, mb)
            tokens, mask, docs = src.sample_arrays(step, mb)
            assert np.array_equal(batch.loss_mask.numpy(), mask[:, 1:].astype(np.float32))
            assert np.array_equal(batch.document_ids.numpy(), docs[:, :-1])
            for row in range(4):
                text = tok.decode(batch.labels[row][batch.loss_mask[row] > 0].tolist())
                # only answers and their end of turn; never a prompt, padding or EOD
                assert text and "user" not in text and "<|endoftext|>" not in text
                assert text.count("<|im_end|>\n") == text.count("<|im_end|>")
                # each trained label's input is in the same conversation
                on = batch.loss_mask[row] > 0
                assert (docs[row, 1:][on.numpy()] == docs[row, :-1][on.numpy()]).all()


def test_eod_mask_and_batches_are_a_pure_function_of_step_and_rank(sft):
    spec, tok = sft
    opts = BatchOptions(eod_id=tok.eod_id, mask_eod_loss=True)
    a = LocalBatchSource(open_dataset(spec, cache=False), 2, 8, 1, 2, options=opts)
    b = LocalBatchSource(open_dataset(spec, cache=False), 2, 8, 1, 2, options=opts)
    for step in (5, 0, 3):
        x, y = a.get(step, 1), b.get(step, 1)
        assert all(
            (getattr(x, f) == getattr(y, f)).all()
            for f in ("tokens", "labels", "loss_mask", "document_ids")
        )
        assert not x.loss_mask[x.tokens == tok.eod_id].any()


def test_a_conversation_longer_than_a_sequence_is_refused(sft):
    spec, _ = sft
    with pytest.raises(DataError, match=r"more than seq_length \+ 1.*--seq-length"):
        open_dataset(replace(spec, seq_length=40), cache=False)


def test_format_sft_on_pretraining_data_says_what_is_missing(tmp_path):
    from .conftest import write_dataset

    prefix = write_dataset(tmp_path / "plain", 1)
    spec = DatasetSpec((prefix,), (1.0,), seq_length=16, num_samples=8, seed=1, format="sft")
    with pytest.raises(DataError, match="not an SFT dataset"):
        open_dataset(spec, cache=False)
    with pytest.raises(DataError, match="format="):
        replace(spec, format="chat").validate()


def test_blended_sft_datasets(sft, tmp_path):
    spec, tok = sft
    rng = random.Random(5)
    rows = [reverse_conversation(rng) for _ in range(60)]
    preprocess_chat([write_chats(tmp_path / "c.jsonl", rows)], tmp_path / "b", tok, "chatml")
    blend = replace(spec, prefixes=(spec.prefixes[0], str(tmp_path / "b")), weights=(0.5, 0.5))
    src = LocalBatchSource(open_dataset(blend, cache=False), 4, 8)
    batch = src.get(1, 0)
    assert batch.document_ids is not None and batch.loss_mask.sum() > 0


@pytest.fixture(scope="module")
def server():
    from meshtrain.services.dataloader.rpc.server import start_server

    from .conftest import served_limits

    srv, port, _ = start_server(0, limits=served_limits())
    yield f"127.0.0.1:{port}"
    srv.stop(0)


@pytest.mark.parametrize("cp", [1, 2])
def test_service_batches_equal_in_process_ones(server, sft, cp):
    from meshtrain.services.dataloader.rpc.client import ServiceBatchSource

    spec, tok = sft
    spec = replace(spec, seq_length=128)
    opts = BatchOptions(eod_id=tok.eod_id, mask_eod_loss=True)
    for cp_rank in range(cp):
        local = LocalBatchSource(
            open_dataset(spec, cache=False), 2, 8, 1, 2, opts, cp_rank=cp_rank, cp_size=cp
        )
        with ServiceBatchSource(
            [server], spec, 2, 8, 1, 2, prefetch=3, options=opts, cp_rank=cp_rank, cp_size=cp
        ) as remote:
            for step in range(3, 6):
                for x, y in zip(local.micro_batches(step), remote.micro_batches(step)):
                    for f in ("tokens", "labels", "loss_mask", "document_ids"):
                        assert getattr(x, f).dtype == getattr(y, f).dtype
                        assert (getattr(x, f) == getattr(y, f)).all(), f
                    assert x.loss_mask.sum() > 0


def test_a_pretraining_request_for_an_sft_dataset_gets_no_mask(server, sft):
    from meshtrain.services.dataloader.rpc.client import ServiceBatchSource

    spec, _ = sft
    gpt = replace(spec, format="gpt")
    with ServiceBatchSource([server], gpt, 2, 8, 0, 2, prefetch=2) as remote:
        batch = remote.micro_batches(0)[0]
    assert batch.document_ids is None and bool((batch.loss_mask == 1).all())
