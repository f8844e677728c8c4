"""Packed SFT samples: whole conversations placed into sequences of `seq_length + 1` tokens.

Unlike pretraining samples (`samples.py`), a conversation is never cut. Each epoch shuffles the
split's conversations with its own seeded permutation (`RandomState([seed, epoch])`, so adding
epochs never changes earlier ones) and packs them first-fit: each goes into the oldest open
sequence it fits in, with at most `PACK_WINDOW` sequences open at once (the oldest is closed
when a new one is needed), which keeps a pass linear and fills sequences to within a few
tokens. Epochs are packed until `num_samples` sequences exist; the first `num_samples` are
served in a seeded shuffled order. A sequence is its conversations back to back (each ends
with the EOD the preprocessing appended) and then padding: the EOD token, loss mask 0, and one
document id of its own, so padding never attends into a conversation. Everything is a pure
function of (dataset, documents, seq_length, num_samples, seed), cached like the GPT indices.

    ds = SFTDataset(tokens, mask, np.arange(n), seq_length=2048, num_samples=N, seed=1, pad_id=eod)
    ds.read_into(i, tokens_out, mask_out=m, docs_out=d)   # (2049,) each
"""

from __future__ import annotations

import os

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.index_cache import array_digest, cache_key, cached_arrays
from meshtrain.services.dataloader.indexed import IndexedDataset

PACK_WINDOW = 64
"""Sequences open at once while packing (first-fit looks at each of them)."""
_SHUFFLE_STREAM = 2**32 - 1  # the seed stream of the sample shuffle, apart from the epochs'


def pack_first_fit(lengths: np.ndarray, capacity: int, window: int = PACK_WINDOW) -> np.ndarray:
    """Bins of items packed first-fit over at most `window` open bins.

    Args:
        lengths: (n,) item sizes, each in [1, capacity], in the order they are placed.
        capacity: bin size.
        window: bins open at once; when none fits and all are open, the oldest is closed.

    Returns:
        (n,) int64: the bin of each item, bins numbered in the order they are closed (the
        order they are served in); every bin's items keep their input order.
    """
    n = lengths.size
    free = np.full(window, -1, dtype=np.int64)  # room left in each slot's bin; -1: no bin
    opened = np.zeros(window, dtype=np.int64)  # when each slot's bin was opened
    slot_bin = np.full(window, -1, dtype=np.int64)  # opening number of each slot's bin
    closed_as: list[int] = []  # per bin in opening order, its closing number
    bin_of_item = np.empty(n, dtype=np.int64)  # opening number of each item's bin
    count = n_closed = 0
    for j in range(n):
        need = int(lengths[j])
        fits = np.flatnonzero(free >= need)
        if fits.size:
            s = int(fits[np.argmin(opened[fits])])  # first fit: the oldest bin with room
        else:
            empty = np.flatnonzero(free < 0)
            if empty.size:
                s = int(empty[0])
            else:
                s = int(np.argmin(opened))  # close the oldest to make room
                closed_as[slot_bin[s]] = n_closed
                n_closed += 1
            free[s], opened[s], slot_bin[s] = capacity, count, count
            closed_as.append(-1)
            count += 1
        free[s] -= need
        bin_of_item[j] = slot_bin[s]
    for s in np.argsort(opened, kind="stable"):  # the rest close oldest first
        if slot_bin[s] >= 0:
            closed_as[slot_bin[s]] = n_closed
            n_closed += 1
    return np.asarray(closed_as, dtype=np.int64)[bin_of_item]


def sft_index_desc(tokens: IndexedDataset, documents, seq_length, num_samples, seed) -> dict:
    """What an SFTDataset's indices depend on: their cache entry's description."""
    return {
        "kind": "sft-packed",
        "data": tokens.fingerprint,
        "documents": array_digest(np.asarray(documents, dtype=np.int64)),
        "seq_length": int(seq_length),
        "num_samples": int(num_samples),
        "seed": int(seed),
        "window": PACK_WINDOW,
    }


class SFTDataset:
    """Shuffled packed sequences of whole conversations over one split of an SFT dataset.

    Attributes:
        bin_docs: document ids of every packed sequence, back to back, in stream order.
        bin_ptr: (num_samples + 1,) where each sequence's documents start in `bin_docs`.
        shuffle_idx: (num_samples,) the packed sequence served at each index.
    """

    carries_mask = True  # samples come with a loss mask and document ids (`read_into`)

    def __init__(
        self,
        tokens: IndexedDataset,
        mask: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        num_samples: int,
        seed: int,
        pad_id: int,
        name: str = "train",
        cache_dir: str | os.PathLike | None = None,
    ):
        """Args:
        tokens: the conversations' tokens, one document each.
        mask: their uint8 loss masks (1 on assistant tokens), the same lengths.
        documents: document ids of this split.
        seq_length: tokens per training sequence; packed samples hold `seq_length + 1`.
        num_samples: packed sequences to provide (epochs are added until they exist).
        seed: seed of the conversation and sample shuffles.
        pad_id: the token that fills the end of a sequence (the EOD).
        name: split name for error messages.
        cache_dir: folder (or `IndexCache`) of the cached indices; None: no cache.
        """
        self.indexed, self.mask = tokens, mask
        self.name, self.pad_id = name, int(pad_id)
        self.seq_length, self.num_samples, self.seed = int(seq_length), int(num_samples), int(seed)
        where = f"{tokens.prefix} [{name}]"
        if self.seq_length < 1 or self.num_samples < 1:
            raise DataError(f"{where}: seq_length and num_samples must be >= 1")
        documents = np.asarray(documents, dtype=np.int64)
        if documents.ndim != 1 or documents.size == 0:
            raise DataError(f"{where}: the split has no conversations")
        seq_cum = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum(tokens.sequence_lengths, out=seq_cum[1:])
        di = tokens.document_indices
        self._doc_start = seq_cum[di[:-1]]
        self._doc_len = seq_cum[di[1:]] - self._doc_start
        lengths = self._doc_len[documents]
        capacity = self.seq_length + 1
        if (lengths > capacity).any():
            k = int(np.argmax(lengths > capacity))
            raise DataError(
                f"{where}: conversation {int(documents[k])} has {int(lengths[k])} tokens, more "
                f"than seq_length + 1 = {capacity}; packing never cuts one: preprocess with "
                f"--seq-length {self.seq_length} (over-long rows are bad rows) or train longer"
            )
        if (lengths == 0).all():
            raise DataError(f"{where}: the split's conversations hold no tokens")
        self._documents = documents
        desc = sft_index_desc(tokens, documents, self.seq_length, self.num_samples, self.seed)
        self.index_key = cache_key(desc)
        arrays = cached_arrays(cache_dir, desc, self._build)
        self.bin_docs, self.bin_ptr = arrays["bin_docs"], arrays["bin_ptr"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def _build(self) -> dict[str, np.ndarray]:
        docs_parts: list[np.ndarray] = []
        sizes_parts: list[np.ndarray] = []
        have, epoch = 0, 0
        capacity = self.seq_length + 1
        while have < self.num_samples:
            rng = np.random.RandomState([self.seed, epoch])
            order = self._documents[rng.permutation(self._documents.size)]
            order = order[self._doc_len[order] > 0]
            bins = pack_first_fit(self._doc_len[order], capacity)
            by_bin = np.argsort(bins, kind="stable")  # items grouped by bin, input order kept
            docs_parts.append(order[by_bin])
            sizes_parts.append(np.bincount(bins))
            have += sizes_parts[-1].size
            epoch += 1
        sizes = np.concatenate(sizes_parts)[: self.num_samples]
        bin_ptr = np.zeros(self.num_samples + 1, dtype=np.int64)
        np.cumsum(sizes, out=bin_ptr[1:])
        bin_docs = np.concatenate(docs_parts)[: bin_ptr[-1]]
        perm = np.random.RandomState([self.seed, _SHUFFLE_STREAM]).permutation(self.num_samples)
        return {"bin_docs": bin_docs, "bin_ptr": bin_ptr, "shuffle_idx": perm}

    def __len__(self) -> int:
        return self.num_samples

    @property
    def token_dtype(self) -> np.dtype:
        return self.indexed.dtype

    def __getitem__(self, i: int) -> np.ndarray:
        """The tokens of packed sample i: (seq_length + 1,) int64."""
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        self.read_into(i, out)
        return out

    def read_into(
        self,
        i: int,
        out: np.ndarray,
        mask_out: np.ndarray | None = None,
        docs_out: np.ndarray | None = None,
    ) -> None:
        """Fill packed sample i of the shuffled order.

        Args:
            i: sample index.
            out: (seq_length + 1,) tokens.
            mask_out: (seq_length + 1,) 1 where the token is an assistant token to predict (never
                a conversation's first token, which nothing before it in its document predicts).
            docs_out: (seq_length + 1,) document ids 0, 1, ... of the conversations in order,
                and one more for the padding.
        """
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.indexed.prefix} [{self.name}]: sample {i} out of range")
        b = int(self.shuffle_idx[i])
        filled = 0
        docs = self.bin_docs[self.bin_ptr[b] : self.bin_ptr[b + 1]]
        for k, doc in enumerate(docs):
            start, n = int(self._doc_start[doc]), int(self._doc_len[doc])
            out[filled : filled + n] = self.indexed.read_tokens(start, n)
            if mask_out is not None:
                mask_out[filled : filled + n] = self.mask.read_tokens(start, n)
                mask_out[filled] = 0
            if docs_out is not None:
                docs_out[filled : filled + n] = k
            filled += n
        out[filled:] = self.pad_id
        if mask_out is not None:
            mask_out[filled:] = 0
        if docs_out is not None:
            docs_out[filled:] = len(docs)
