"""Batches for one data-parallel rank, as a pure function of (dataset, step, micro-batch).

Sample order follows Megatron's pretraining sampler: global batch g covers shuffled samples
`[g*gbs, (g+1)*gbs)`; micro-batch m of it is the slice `[m*mbs*dp, (m+1)*mbs*dp)`, of which
rank r takes `[r*mbs, (r+1)*mbs)`. Nothing is stateful, so any worker can serve any rank from
any step and resuming at step g is exact. This is the in-process path; the gRPC client returns
the same `Batch` objects.

    src = LocalBatchSource(train, micro_batch_size=4, global_batch_size=32, dp_rank=r, dp_size=2)
    for batch in src.micro_batches(step): ...   # 4 micro-batches of (4, seq_length)
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

import numpy as np

from meshtrain.services.common.errors import DataError

if TYPE_CHECKING:  # torch is imported where batches are made: data workers never need it
    import torch


@dataclass
class Batch:
    """One micro-batch for one rank."""

    tokens: torch.Tensor  # (micro_batch, seq) int64, inputs
    labels: torch.Tensor  # (micro_batch, seq) int64, next tokens
    loss_mask: torch.Tensor  # (micro_batch, seq) float32, 1 where the loss counts
    step: int  # global batch index (0-based)
    microbatch: int  # index within the step's micro-batches
    document_ids: torch.Tensor | None = None  # (micro_batch, seq) int32, +1 after each EOD; None if not asked


@dataclass(frozen=True)
class BatchOptions:
    """What a Batch carries besides tokens and labels; derived from the tokens, so the
    service never sends it (the client computes it exactly as the in-process path does)."""

    eod_id: int | None = None
    """End-of-document token id; needed by the two options below."""
    mask_eod_loss: bool = False
    """Zero the loss where the input token is EOD (Megatron `--eod-mask-loss`)."""
    document_ids: bool = False
    """Fill `Batch.document_ids`, for attention that does not cross documents."""

    def __post_init__(self) -> None:
        if (self.mask_eod_loss or self.document_ids) and self.eod_id is None:
            raise DataError("mask_eod_loss and document_ids need the tokenizer's eod_id")


class LocalBatchSource:
    """Serves one data-parallel rank's micro-batches straight from a GPTDataset."""

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        options: BatchOptions | None = None,
    ):
        """Args:
        dataset: shuffled samples: a GPTDataset or BlendedDataset (`len`, `[i]` -> (seq+1,)).
        micro_batch_size: samples per micro-batch per rank (mbs).
        global_batch_size: samples per optimizer step over all ranks (gbs).
        dp_rank: this rank's data-parallel index.
        dp_size: data-parallel ranks.
        options: loss-mask and document-boundary options (default: neither).
        """
        if micro_batch_size < 1 or dp_size < 1 or global_batch_size < 1:
            raise DataError(
                f"batch sizes must be >= 1: micro_batch_size={micro_batch_size}, "
                f"global_batch_size={global_batch_size}, dp_size={dp_size}"
            )
        if global_batch_size % (micro_batch_size * dp_size):
            raise DataError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"micro_batch_size={micro_batch_size} x dp_size={dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.options = options or BatchOptions()

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each rank (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def num_steps(self) -> int:
        """Whole global batches the dataset holds."""
        return len(self.dataset) // self.global_batch_size

    def sample_indices(self, step: int, microbatch: int) -> np.ndarray:
        """Indices into the dataset for this rank's micro-batch.

        Args:
            step: global batch index.
            microbatch: micro-batch index within the step.

        Returns:
            (micro_batch_size,) int64 dataset indices.
        """
        if step < 0:
            raise DataError(f"step {step} is negative")
        if not 0 <= microbatch < self.num_micro_batches:
            raise DataError(
                f"microbatch {microbatch} is outside [0, {self.num_micro_batches}) at step {step}"
            )
        # the whole global batch must exist, so every rank fails on the same step
        if (step + 1) * self.global_batch_size > len(self.dataset):
            raise DataError(
                f"step {step} needs samples up to {(step + 1) * self.global_batch_size} but dataset "
                f"{self.dataset.name!r} has {len(self.dataset)} ({self.num_steps} steps of "
                f"{self.global_batch_size}); build it with more num_samples"
            )
        mbs = self.micro_batch_size
        start = step * self.global_batch_size + microbatch * mbs * self.dp_size + self.dp_rank * mbs
        return np.arange(start, start + mbs, dtype=np.int64)

    def samples(self, step: int, microbatch: int) -> np.ndarray:
        """The raw samples of this rank's micro-batch, in the dataset's token dtype.

        Args:
            step: global batch index (0-based).
            microbatch: micro-batch index in `[0, num_micro_batches)`.

        Returns:
            (micro_batch_size, seq_length + 1) token ids in the dataset's token dtype (int64
            if it has none); what the data service sends.
        """
        idx = self.sample_indices(step, microbatch)
        if not hasattr(self.dataset, "read_into"):
            return np.stack([self.dataset[int(i)] for i in idx])
        out = np.empty((idx.size, self.dataset.seq_length + 1), dtype=self.dataset.token_dtype)
        for row, i in enumerate(idx):
            self.dataset.read_into(int(i), out[row])
        return out

    def get(self, step: int, microbatch: int) -> Batch:
        """This rank's micro-batch `microbatch` of global step `step`.

        Args:
            step: global batch index (0-based).
            microbatch: micro-batch index in `[0, num_micro_batches)`.

        Returns:
            A Batch of shape (micro_batch_size, seq_length).
        """
        return batch_from_samples(self.samples(step, microbatch), step, microbatch, self.options)

    def micro_batches(self, step: int) -> list[Batch]:
        """All of this rank's micro-batches for one step, in order.

        Args:
            step: global batch index.

        Returns:
            `num_micro_batches` Batches.
        """
        return [self.get(step, m) for m in range(self.num_micro_batches)]


def batch_from_samples(samples: np.ndarray, step: int, microbatch: int,
                       options: BatchOptions | None = None) -> Batch:
    """Split (mbs, seq + 1) samples into a Batch of inputs and next-token labels.

    Args:
        samples: (micro_batch_size, seq_length + 1) token ids of any integer dtype.
        step: global batch index.
        microbatch: micro-batch index within the step.
        options: EOD loss masking and document ids (default: neither).

    Returns:
        A Batch with int64 tokens/labels, a float32 loss mask (ones unless EOD is masked) and,
        if asked, document ids; all (micro_batch_size, seq_length).
    """
    import torch

    t = torch.from_numpy(np.asarray(samples, dtype=np.int64))  # (mbs, seq + 1) int64
    tokens = t[:, :-1].contiguous()  # (mbs, seq)
    labels = t[:, 1:].contiguous()  # (mbs, seq)
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    document_ids = None
    if options is not None and options.eod_id is not None:
        is_eod = tokens == options.eod_id  # (mbs, seq)
        if options.mask_eod_loss:
            loss_mask[is_eod] = 0.0
        if options.document_ids:
            # a document starts after each EOD: count the EODs strictly before each position
            ends = torch.cumsum(is_eod, dim=1, dtype=torch.int32)  # (mbs, seq)
            document_ids = ends - is_eod.to(torch.int32)
    return Batch(tokens=tokens, labels=labels, loss_mask=loss_mask, step=step, microbatch=microbatch,
                 document_ids=document_ids)
