"""Where the trainer's batches come from: the in-process dataloader library (embedded default).

`build_data` resolves the dataset (the embedded stdlib corpus, built and cached on first use,
or a given `PREFIX`), the tokenizer and thus the vocabulary, and returns batch sources for
the train and validation splits. Batches are a pure function of (dataset, seed, step), which
is what makes resume exact. The gRPC dataloader client will plug in here with the same
`micro_batches(step)` interface.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.errors import ConfigError, DataError
from services.dataloader.indexed import IndexedDataset
from services.dataloader.loader import LocalBatchSource
from services.dataloader.preprocess import prepare_default_dataset
from services.dataloader.samples import GPTDataset, split_ranges
from services.dataloader.tokenizers import build_tokenizer
from services.trainer.config import JobConfig

log = logging.getLogger("meshtrain.data")


@dataclass
class TrainData:
    """Batch sources and what the model needs to know about the data."""

    train: LocalBatchSource
    valid: LocalBatchSource | None
    vocab_size: int
    tokenizer: str
    prefix: str


def build_data(job: JobConfig) -> TrainData:
    """Open (or build) the dataset for `job` and the sample streams for its splits."""
    d = job.data
    if d.data_path:
        prefix = d.data_path[0]
        tokenizer_spec = d.tokenizer
        vocab_size = build_tokenizer(tokenizer_spec).vocab_size
    else:
        default = prepare_default_dataset(
            Path(d.cache_dir), tokenizer=d.tokenizer, vocab_size=d.default_vocab_size,
            max_bytes=d.default_corpus_bytes,
        )
        prefix, tokenizer_spec, vocab_size = default.prefix, default.tokenizer_spec, default.vocab_size
    if job.model.vocab_size is not None and job.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={job.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({vocab_size}, {tokenizer_spec})"
        )
    indexed = IndexedDataset(prefix)
    ranges = split_ranges(len(indexed.document_indices) - 1, d.split)
    t = job.train
    seq = job.model.seq_length

    def dataset(split: int, num_samples: int, name: str) -> GPTDataset:
        start, end = ranges[split]
        docs = np.arange(start, end, dtype=np.int64)
        return GPTDataset(indexed, docs, seq, num_samples, t.seed, name=name)

    train = LocalBatchSource(dataset(0, t.train_iters * t.global_batch_size, "train"),
                             t.micro_batch_size, t.global_batch_size)
    valid = None
    if t.eval_interval > 0:
        start, end = ranges[1]
        if end <= start:
            raise DataError(f"train.eval_interval={t.eval_interval} but data.split={d.split!r} leaves no validation documents")
        n = t.eval_iters * t.micro_batch_size
        valid = LocalBatchSource(dataset(1, n, "valid"), t.micro_batch_size, n)
    log.info("data: %s (%d documents, %d tokens), tokenizer %s, vocab %d",
             prefix, len(indexed.document_indices) - 1, indexed.num_tokens, tokenizer_spec, vocab_size)
    return TrainData(train, valid, vocab_size, tokenizer_spec, prefix)
