"""GPT training samples over an indexed dataset, with Megatron GPTDataset semantics.

A split's documents are tiled over as many epochs as needed, each epoch a fresh seeded
permutation of them, and read as one token stream. Sample k is the `seq_length + 1` tokens of
that stream starting at `k * seq_length` (consecutive samples share one token, so
tokens = s[:-1], labels = s[1:] cover the stream without gaps) and may cross document
boundaries. Samples are then served in a seeded shuffled order. All three index arrays
(document order, sample starts, shuffle) are built with vectorized numpy, so millions of
samples take a second or two; everything is a pure function of (dataset, documents,
seq_length, num_samples, seed, sample_order). `sample_order="megatron"` builds megatron-core
GPTDataset's own three indices instead, bit for bit (see `GPTDataset`), and `split_ranges`
computes Megatron's split edges with its floating-point arithmetic.

    ranges = split_ranges(ds.num_documents, "969,30,1")
    train = GPTDataset(ds, np.arange(*ranges[0]), seq_length=1024, num_samples=N, seed=1234)
    train[0]  # (1025,) int64
"""

from __future__ import annotations

import math
import os

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.index_cache import array_digest, cache_key, cached_arrays
from meshtrain.services.dataloader.indexed import IndexedDataset

_SPLIT_NAMES = ("train", "valid", "test")
SAMPLE_ORDERS = ("meshtrain", "megatron")
"""Recipes for the three index arrays (`GPTDataset`'s `sample_order`)."""
# Megatron shuffles the last epoch on its own when less than this share of it is used
_MEGATRON_SEPARATE_EPOCH_SHARE = 0.80


def split_ranges(num_documents: int, split: str = "969,30,1") -> list[tuple[int, int]]:
    """Contiguous train/valid/test document ranges by normalized weights (Megatron `--split`).

    Args:
        num_documents: documents in the dataset.
        split: up to three finite, non-negative weights separated by "," or "/"; missing
            ones are 0.

    Returns:
        Three `(begin, end)` ranges that tile `[0, num_documents)` in order.
    """
    # An empty field is an error, not dropped: "90,,10" would move test's 10 into valid.
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise DataError(f"split {split!r} must be up to three numbers like '969,30,1'") from None
    # float() takes "nan" and "inf" (and "1e308,1e308" sums to inf): the ranges would be NaN
    if not all(math.isfinite(w) for w in weights) or not math.isfinite(sum(weights)):
        raise DataError(f"split {split!r} must be finite numbers like '969,30,1' (no nan or inf)")
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"split {split!r} must be 1-3 non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    # Megatron's arithmetic, step for step, so that a document on a rounding tie lands in the
    # same split: normalize each weight first, then add the fractions up in Python floats, and
    # round each edge half to even (`round`). Summing the raw weights first (90+5 = 95, /100)
    # rounds some sizes differently (0.9 + 0.05 is 0.9500000000000001, not 0.95).
    total = 0.0
    for (
        w
    ) in weights:  # in order, as numpy.sum adds three numbers (Python's sum compensates since 3.12)
        total += w
    fractions = [w / total for w in weights]
    cum = [0.0]
    for f in fractions:
        cum.append(cum[-1] + f)
    # the last edge is Megatron's too (its sum of fractions times n rounds to n below 2^51)
    edges = [int(round(c * float(num_documents))) for c in cum[:-1]] + [num_documents]
    ranges = [(edges[i], edges[i + 1]) for i in range(3)]
    if ranges[0][1] <= ranges[0][0]:
        raise DataError(
            f"split {split!r} over {num_documents} documents leaves the train split empty"
        )
    return ranges


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Epochs of a split of `tokens_per_epoch` tokens that `num_samples` samples span (the last
    sample needs its one extra, label, token)."""
    return -(-(num_samples * seq_length + 1) // tokens_per_epoch)


def index_build_bytes(num_epochs: int, num_documents: int, num_samples: int) -> int:
    """Upper bound on the memory (bytes) building a GPTDataset's indices takes at its peak.

    The document shuffle holds three (epochs x documents) 8-byte arrays at once (the random
    keys, their argsort, doc_idx); the sample index then holds doc_idx, its prefix sums and
    at most six 8-byte values per sample (starts, positions, offsets, their int64 stack and
    its narrowed copy). Both phases are counted whole, so the bound holds for either peak.
    Megatron's recipe holds less per document slot (int32 ids, shuffled in place); give it
    the samples its index holds (`megatron_total_samples` + 1), not the ones asked for.
    """
    return 24 * num_epochs * num_documents + 48 * num_samples


def megatron_total_samples(tokens_per_epoch: int, seq_length: int, num_epochs: int) -> int:
    """Samples Megatron's sample index holds: every whole sample of the epochs it tiles (more
    than were asked for), each `seq_length + 1` tokens, consecutive ones sharing one."""
    return (num_epochs * tokens_per_epoch - 1) // seq_length


def check_sample_order(sample_order: str, what: str = "sample_order") -> None:
    """Raise DataError naming `what` unless `sample_order` is one of SAMPLE_ORDERS."""
    if sample_order not in SAMPLE_ORDERS:
        shown = sample_order[:40] if isinstance(sample_order, str) else sample_order
        raise DataError(f"{what}={shown!r} is not one of {SAMPLE_ORDERS}")


def gpt_index_desc(
    indexed,
    documents: np.ndarray,
    seq_length: int,
    num_samples: int,
    seed: int,
    sample_order: str = "meshtrain",
) -> dict:
    """What a GPTDataset's indices depend on: their cache entry's description (`index_cache`)."""
    desc = {
        "kind": "gpt",
        "data": indexed.fingerprint,
        "documents": array_digest(np.asarray(documents, dtype=np.int64)),
        "seq_length": int(seq_length),
        "num_samples": int(num_samples),
        "seed": int(seed),
    }
    if sample_order != "meshtrain":  # meshtrain's entries keep the keys they always had
        desc["sample_order"] = sample_order
    return desc


class GPTDataset:
    """Shuffled fixed-length samples over one split of an IndexedDataset.

    Two recipes build the indices (`sample_order`): meshtrain's (`"meshtrain"`, the default)
    shuffles each epoch's documents on its own and indexes exactly `num_samples` samples;
    Megatron's (`"megatron"`) reproduces megatron-core's GPTDataset bit for bit for the same
    seed, sequence length, sample count and split: one shuffle over all epochs' documents
    (the last epoch shuffled apart when less than 80% of it is used, Megatron's
    `separate_final_epoch`), a sample index over every whole sample of those epochs, and a
    shuffle of all of them (the last epoch's apart when its documents were). Megatron's unit
    is the sequence, so with "megatron" `documents` are sequence ids (the same thing for
    datasets of one sequence per document, as meshtrain writes). Samples always hold
    `seq_length + 1` tokens (Megatron's default `add_extra_token_to_sequence`), and the last
    partial sample is dropped (its default for every split).

    Attributes:
        doc_idx: (num_epochs * documents,) document ids in stream order (int32 with "megatron").
        sample_idx: position in `doc_idx` and token offset in that document where each
            (unshuffled) sample starts: (num_samples, 2), or with "megatron" one row per sample
            of the epochs plus the end of the last, as Megatron's `sample_index`.
        shuffle_idx: unshuffled sample served at each index: (num_samples,), or with
            "megatron" Megatron's `shuffle_index` over all samples of the epochs (uint32).
        separate_final_epoch: whether the last epoch was shuffled apart ("megatron" only).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        num_samples: int,
        seed: int,
        name: str = "train",
        cache_dir: str | os.PathLike | None = None,
        sample_order: str = "meshtrain",
    ):
        """Args:
        indexed: the token source.
        documents: document ids (into `indexed.document_indices`) that make up this split;
            with sample_order "megatron", sequence ids (into `indexed`), as Megatron's.
        seq_length: tokens per training sequence; samples hold `seq_length + 1`.
        num_samples: samples to provide (epochs are added until they fit).
        seed: seed of the document and sample shuffles.
        name: split name used in error messages.
        cache_dir: folder where the indices are cached, or an `index_cache.IndexCache`;
            None: no cache.
        sample_order: "meshtrain" or "megatron": which recipe builds the indices (see the
            class docstring).
        """
        check_sample_order(sample_order)
        self.sample_order = sample_order
        self.indexed = indexed
        self.name = name
        self.seq_length = int(seq_length)
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        where = f"{indexed.prefix} [{name}]"
        if self.seq_length < 1 or self.num_samples < 1:
            raise DataError(
                f"{where}: seq_length ({seq_length}) and num_samples ({num_samples}) must be >= 1"
            )
        megatron = sample_order == "megatron"
        documents = np.asarray(documents, dtype=np.int64)
        if documents.ndim != 1 or documents.size == 0:
            raise DataError(f"{where}: the split has no documents")
        units = len(indexed) if megatron else indexed.num_documents
        if documents.min() < 0 or documents.max() >= units:
            raise DataError(
                f"{where}: {'sequence' if megatron else 'document'} ids outside [0, {units})"
            )
        if megatron and units > np.iinfo(np.int32).max:
            raise DataError(
                f"{where}: sample_order 'megatron' indexes sequences as int32, as Megatron "
                f"does; this dataset has {units}"
            )

        # Token offset and length of every document in the flat `.bin` stream. Sequences are
        # contiguous (IndexedDataset validates pointers), so prefix sums of lengths locate them.
        seq_cum = np.zeros(len(indexed) + 1, dtype=np.int64)
        np.cumsum(indexed.sequence_lengths, out=seq_cum[1:])
        di = (
            np.arange(len(indexed) + 1) if megatron else indexed.document_indices
        )  # Megatron's unit: a sequence
        self._doc_start = seq_cum[di[:-1]]  # (all units,)
        self._doc_len = seq_cum[di[1:]] - self._doc_start  # (all units,)

        tokens_per_epoch = int(self._doc_len[documents].sum())
        if tokens_per_epoch == 0:
            raise DataError(f"{where}: the split's {documents.size} documents hold no tokens")
        if tokens_per_epoch < self.seq_length + 1:
            # tiling one short split many times into each sample would train on repeats of it
            raise DataError(
                f"{where}: seq_length {self.seq_length} + 1 is longer than the split's "
                f"{tokens_per_epoch} tokens"
            )
        self.tokens_per_epoch = tokens_per_epoch
        self.num_epochs = epochs_needed(tokens_per_epoch, self.seq_length, self.num_samples)

        desc = gpt_index_desc(
            indexed, documents, self.seq_length, self.num_samples, self.seed, sample_order
        )
        self.index_key = cache_key(desc)  # its entry in an index cache
        build = self._build_megatron_indices if megatron else self._build_indices
        self.separate_final_epoch = megatron and self._megatron_separates_final_epoch()
        arrays = cached_arrays(cache_dir, desc, lambda: build(documents))
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def _build_indices(self, documents: np.ndarray) -> dict[str, np.ndarray]:
        """The three index arrays, vectorized; a pure function of the constructor's arguments."""
        rng = np.random.RandomState(self.seed)
        # one independent permutation per epoch: argsort of uniform keys, row by row
        keys = rng.random_sample((self.num_epochs, documents.size))  # (epochs, docs)
        doc_idx = documents[np.argsort(keys, axis=1, kind="stable")].ravel()  # (epochs*docs,)
        del keys

        stream_cum = np.zeros(doc_idx.size + 1, dtype=np.int64)
        np.cumsum(self._doc_len[doc_idx], out=stream_cum[1:])  # token offset of each doc_idx slot
        starts = np.arange(self.num_samples, dtype=np.int64) * self.seq_length  # (num_samples,)
        # side="right" lands on the last slot starting at or before the token, skipping empty
        # documents
        pos = np.searchsorted(stream_cum, starts, side="right") - 1
        offset = starts - stream_cum[pos]
        largest = max(doc_idx.size, int(self._doc_len.max(initial=0)))
        idx_dtype = np.int32 if largest < 2**31 else np.int64  # halves the index for normal sizes
        sample_idx = np.stack([pos, offset], axis=1).astype(idx_dtype)  # (num_samples, 2)
        del starts, pos, offset, stream_cum

        perm = rng.permutation(self.num_samples)
        shuffle_idx = perm.astype(np.int32) if self.num_samples < 2**31 else perm
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def _megatron_separates_final_epoch(self) -> bool:
        """Megatron's `separate_final_epoch`: the last epoch is shuffled apart when less than
        80% of its samples are used."""
        if self.num_epochs == 1:
            return False
        tokens, seq = self.tokens_per_epoch, self.seq_length
        from_last = self.num_samples - megatron_total_samples(tokens, seq, self.num_epochs - 1)
        return from_last < int(
            _MEGATRON_SEPARATE_EPOCH_SHARE * megatron_total_samples(tokens, seq, 1)
        )

    def _build_megatron_indices(self, documents: np.ndarray) -> dict[str, np.ndarray]:
        """megatron-core GPTDataset's three indices, bit for bit, vectorized: its document index
        (`_build_document_index`), sample index (`helpers.build_sample_idx`, a C++ loop there)
        and shuffle index (`_build_shuffle_index`), drawn from one RandomState in that order."""
        tokens, epochs, seq = self.tokens_per_epoch, self.num_epochs, self.seq_length
        # samples the epochs before the last hold (with one epoch nothing is set apart)
        before_last = megatron_total_samples(tokens, seq, epochs - 1) if epochs > 1 else 0
        separate = self.separate_final_epoch
        rng = np.random.RandomState(self.seed)
        docs = documents.astype(np.int32)
        if separate:
            first = np.tile(docs, epochs - 1)  # (epochs-1)*docs, shuffled together
            rng.shuffle(first)
            last = docs.copy()  # the last epoch, shuffled on its own
            rng.shuffle(last)
            doc_idx = np.concatenate([first, last])
            del first, last
        else:
            doc_idx = np.tile(docs, epochs)  # (epochs*docs,), one shuffle over all epochs
            rng.shuffle(doc_idx)

        # Row k is where stream token k*seq lies: the slot holding it (past any empty
        # documents) and its offset there; row 0 is (0, 0) whatever slot 0 holds, as Megatron's
        # walk starts there. The rows run to the end of the last whole sample.
        total = megatron_total_samples(tokens, seq, epochs)
        stream_cum = np.zeros(doc_idx.size + 1, dtype=np.int64)
        np.cumsum(self._doc_len[doc_idx], out=stream_cum[1:])  # token offset of each doc_idx slot
        starts = np.arange(total + 1, dtype=np.int64) * seq  # (total + 1,)
        pos = np.searchsorted(stream_cum, starts, side="right") - 1
        offset = starts - stream_cum[pos]
        pos[0] = offset[0] = 0
        largest = max(doc_idx.size, int(self.indexed.sequence_lengths.max(initial=0)))
        idx_dtype = np.int32 if largest <= np.iinfo(np.int32).max else np.int64  # Megatron's choice
        sample_idx = np.stack([pos, offset], axis=1).astype(idx_dtype)  # (total + 1, 2)
        del starts, pos, offset, stream_cum

        shuffle_dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
        if separate:
            head = np.arange(before_last, dtype=shuffle_dtype)
            rng.shuffle(head)
            tail = np.arange(before_last, total, dtype=shuffle_dtype)
            rng.shuffle(tail)
            shuffle_idx = np.concatenate([head, tail])
        else:
            shuffle_idx = np.arange(total, dtype=shuffle_dtype)
            rng.shuffle(shuffle_idx)
        return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}

    def __len__(self) -> int:
        return self.num_samples

    @property
    def token_dtype(self) -> np.dtype:
        """Dtype of the stored tokens: samples fit in it, so the wire can use it."""
        return self.indexed.dtype

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample i of the shuffled order.

        Returns:
            (seq_length + 1,) int64 token ids.
        """
        if not 0 <= i < self.num_samples:
            raise IndexError(
                f"{self.indexed.prefix} [{self.name}]: sample {i} out of range [0, "
                f"{self.num_samples})"
            )
        return self.unshuffled(int(self.shuffle_idx[i]))

    def read_into(self, i: int, out: np.ndarray) -> None:
        """Write sample i of the shuffled order into `out` ((seq_length + 1,), any int dtype).

        The data service fills a whole micro-batch buffer this way, in the stored token
        dtype, without an int64 copy per sample.
        """
        if not 0 <= i < self.num_samples:
            raise IndexError(
                f"{self.indexed.prefix} [{self.name}]: sample {i} out of range [0, "
                f"{self.num_samples})"
            )
        self.unshuffled(int(self.shuffle_idx[i]), out)

    def unshuffled(self, k: int, out: np.ndarray | None = None) -> np.ndarray:
        """Sample k in stream order: tokens [k*seq_length, k*seq_length + seq_length + 1).

        Args:
            k: unshuffled sample index.
            out: optional (seq_length + 1,) buffer to fill; a new int64 array if None.

        Returns:
            (seq_length + 1,) token ids (`out` when given, else int64).
        """
        pos, offset = (int(v) for v in self.sample_idx[k])
        if out is None:
            out = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        while filled < out.size:
            doc = int(self.doc_idx[pos])
            take = min(int(self._doc_len[doc]) - offset, out.size - filled)
            if take > 0:
                start = int(self._doc_start[doc]) + offset
                out[filled : filled + take] = self.indexed.read_tokens(start, take)
                filled += take
            pos += 1
            offset = 0
        return out
