"""GPT training samples over an indexed dataset, with Megatron GPTDataset semantics.

A split's documents are tiled over as many epochs as needed, each epoch a fresh seeded
permutation of them, and read as one token stream. Sample k is the `seq_length + 1` tokens of
that stream starting at `k * seq_length` (consecutive samples share one token, so
tokens = s[:-1], labels = s[1:] cover the stream without gaps) and may cross document
boundaries. Samples are then served in a seeded shuffled order. All three index arrays
(document order, sample starts, shuffle) are built with vectorized numpy, so millions of
samples take a second or two; everything is a pure function of (dataset, documents,
seq_length, num_samples, seed).

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
    cum = np.cumsum(weights) / sum(weights)
    # rounding the cumulative fractions (not each share) keeps the ranges contiguous and total exact
    edges = [0] + [round(float(c * num_documents)) for c in cum[:-1]] + [num_documents]
    ranges = [(edges[i], edges[i + 1]) for i in range(3)]
    if ranges[0][1] <= ranges[0][0]:
        raise DataError(f"split {split!r} over {num_documents} documents leaves the train split empty")
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
    """
    return 24 * num_epochs * num_documents + 48 * num_samples


def gpt_index_desc(indexed, documents: np.ndarray, seq_length: int, num_samples: int, seed: int) -> dict:
    """What a GPTDataset's indices depend on: their cache entry's description (`index_cache`)."""
    return {
        "kind": "gpt",
        "data": indexed.fingerprint,
        "documents": array_digest(np.asarray(documents, dtype=np.int64)),
        "seq_length": int(seq_length),
        "num_samples": int(num_samples),
        "seed": int(seed),
    }


class GPTDataset:
    """Shuffled fixed-length samples over one split of an IndexedDataset.

    Attributes:
        doc_idx: (num_epochs * documents,) document ids in stream order.
        sample_idx: (num_samples, 2) position in `doc_idx` and token offset in that
            document where each (unshuffled) sample starts.
        shuffle_idx: (num_samples,) unshuffled sample served at each index.
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
    ):
        """Args:
        indexed: the token source.
        documents: document ids (into `indexed.document_indices`) that make up this split.
        seq_length: tokens per training sequence; samples hold `seq_length + 1`.
        num_samples: samples to provide (epochs are added until they fit).
        seed: seed of the document and sample shuffles.
        name: split name used in error messages.
        cache_dir: folder where the indices are cached, or an `index_cache.IndexCache`;
            None: no cache.
        """
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
        documents = np.asarray(documents, dtype=np.int64)
        if documents.ndim != 1 or documents.size == 0:
            raise DataError(f"{where}: the split has no documents")
        if documents.min() < 0 or documents.max() >= indexed.num_documents:
            raise DataError(f"{where}: document ids outside [0, {indexed.num_documents})")

        # Token offset and length of every document in the flat `.bin` stream. Sequences are
        # contiguous (IndexedDataset validates pointers), so prefix sums of lengths locate them.
        seq_cum = np.zeros(len(indexed) + 1, dtype=np.int64)
        np.cumsum(indexed.sequence_lengths, out=seq_cum[1:])
        di = indexed.document_indices
        self._doc_start = seq_cum[di[:-1]]  # (all documents,)
        self._doc_len = seq_cum[di[1:]] - self._doc_start  # (all documents,)

        tokens_per_epoch = int(self._doc_len[documents].sum())
        if tokens_per_epoch == 0:
            raise DataError(f"{where}: the split's {documents.size} documents hold no tokens")
        if tokens_per_epoch < self.seq_length + 1:
            # tiling one short split many times into each sample would train on repeats of it
            raise DataError(
                f"{where}: seq_length {self.seq_length} + 1 is longer than the split's "
                f"{tokens_per_epoch} tokens"
            )
        self.num_epochs = epochs_needed(tokens_per_epoch, self.seq_length, self.num_samples)

        desc = gpt_index_desc(indexed, documents, self.seq_length, self.num_samples, self.seed)
        self.index_key = cache_key(desc)  # its entry in an index cache
        arrays = cached_arrays(cache_dir, desc, lambda: self._build_indices(documents))
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
        # side="right" lands on the last slot starting at or before the token, skipping empty documents
        pos = np.searchsorted(stream_cum, starts, side="right") - 1
        offset = starts - stream_cum[pos]
        largest = max(doc_idx.size, int(self._doc_len.max(initial=0)))
        idx_dtype = np.int32 if largest < 2**31 else np.int64  # halves the index for normal sizes
        sample_idx = np.stack([pos, offset], axis=1).astype(idx_dtype)  # (num_samples, 2)
        del starts, pos, offset, stream_cum

        perm = rng.permutation(self.num_samples)
        shuffle_idx = perm.astype(np.int32) if self.num_samples < 2**31 else perm
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
                f"{self.indexed.prefix} [{self.name}]: sample {i} out of range [0, {self.num_samples})"
            )
        return self.unshuffled(int(self.shuffle_idx[i]))

    def read_into(self, i: int, out: np.ndarray) -> None:
        """Write sample i of the shuffled order into `out` ((seq_length + 1,), any int dtype).

        The data service fills a whole micro-batch buffer this way, in the stored token
        dtype, without an int64 copy per sample.
        """
        if not 0 <= i < self.num_samples:
            raise IndexError(
                f"{self.indexed.prefix} [{self.name}]: sample {i} out of range [0, {self.num_samples})"
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
