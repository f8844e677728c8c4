"""Batches for one data-parallel rank, as a pure function of (dataset, step, micro-batch).

Sample order follows Megatron's pretraining sampler: global batch g covers shuffled samples
`[g*gbs, (g+1)*gbs)`; micro-batch m of it is the slice `[m*mbs*dp, (m+1)*mbs*dp)`, of which
rank r takes `[r*mbs, (r+1)*mbs)`. Nothing is stateful, so any worker can serve any rank from
any step and resuming at step g is exact. This is the in-process path; the gRPC client returns
the same `Batch` objects.

Under context parallelism (cp) the cp ranks of one data-parallel rank read the same samples and
each keeps only its positions of the sequence (`context_positions`: chunks i and 2cp-1-i of
2cp, Megatron's causal load balance); the data service sends only those two chunks.

Packed SFT datasets (`packing.SFTDataset`) bring a per-token loss mask and document ids with
their samples (`sample_arrays`); the batch's loss mask is that mask shifted onto the labels.

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
    document_ids: torch.Tensor | None = (
        None  # (micro_batch, seq) int32, +1 after each EOD; None if not asked (SFT: always set)
    )
    position_ids: torch.Tensor | None = (
        None  # (micro_batch, seq) int32, 0 again after each EOD; None if not asked
    )
    images: torch.Tensor | None = None
    """(n_images, 3, H, W) float32, resized and normalized: the micro-batch's images in the order
    their placeholders appear (sample by sample, left to right); each takes the place of
    tokens_per_image copies of model.vision.image_token_id in `tokens` (loss mask 0 there).
    None: no images."""


@dataclass(frozen=True)
class BatchOptions:
    """What a Batch carries besides tokens and labels; derived from the tokens, so the
    service never sends it (the client computes it exactly as the in-process path does)."""

    eod_id: int | None = None
    """End-of-document token id; needed by the two options below."""
    mask_eod_loss: bool = False
    """Zero the loss where the input token is EOD (Megatron `--eod-mask-loss`)."""
    document_ids: bool = False
    """Fill `Batch.document_ids`, for attention that does not cross documents (Megatron
    `--reset-attention-mask`)."""
    position_ids: bool = False
    """Fill `Batch.position_ids`: each token's position in its document, 0 on the token after
    an EOD (Megatron `--reset-position-ids`)."""

    def __post_init__(self) -> None:
        if (self.mask_eod_loss or self.document_ids or self.position_ids) and self.eod_id is None:
            raise DataError(
                "mask_eod_loss, document_ids and position_ids need the tokenizer's eod_id; "
                "this tokenizer has no end-of-document token"
            )

    @property
    def per_document(self) -> bool:
        """Whether batches carry document boundaries (ids or positions), which only the full
        sample shows: a context-parallel rank's chunks do not see the EODs before them."""
        return self.document_ids or self.position_ids


def context_chunks(seq_length: int, cp_rank: int, cp_size: int) -> tuple[tuple[int, int], ...]:
    """The [start, end) ranges of the sequence that context-parallel rank `cp_rank` holds, in order.

    The sequence is cut into 2*cp_size chunks of c = seq_length / (2*cp_size) tokens and rank i
    holds chunks i and 2*cp_size-1-i (an early and a late one, so causal attention costs every
    rank the same); with cp_size 1, the whole sequence.

    Args:
        seq_length: tokens per training sequence.
        cp_rank: this rank's context-parallel index, in [0, cp_size).
        cp_size: context-parallel ranks.

    Returns:
        ((0, seq_length),) for cp_size 1, else ((i*c, (i+1)*c), ((2cp-1-i)*c, (2cp-i)*c)).

    Raises:
        DataError: cp_size < 1, cp_rank outside [0, cp_size), or seq_length not divisible by
            2*cp_size.
    """
    if cp_size < 1:
        raise DataError(f"cp_size={cp_size} must be >= 1")
    if not 0 <= cp_rank < cp_size:
        raise DataError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
    if cp_size == 1:
        return ((0, seq_length),)
    if seq_length < 1 or seq_length % (2 * cp_size):
        raise DataError(
            f"seq_length={seq_length} is not a positive multiple of 2 x cp_size={cp_size} "
            f"(context parallelism cuts each sequence into 2 x cp_size equal chunks)"
        )
    c = seq_length // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return ((cp_rank * c, (cp_rank + 1) * c), (late * c, (late + 1) * c))


def context_positions(seq_length: int, cp_rank: int, cp_size: int) -> np.ndarray:
    """Positions in the full sequence of context-parallel rank `cp_rank`'s tokens, in its order.

    Args:
        seq_length: tokens per training sequence.
        cp_rank: this rank's context-parallel index, in [0, cp_size).
        cp_size: context-parallel ranks (1: the whole sequence).

    Returns:
        (seq_length // cp_size,) int64: chunk cp_rank then chunk 2*cp_size-1-cp_rank of the
        sequence cut into 2*cp_size equal chunks (see `context_chunks`); arange(seq_length)
        for cp_size 1.

    Raises:
        DataError: as `context_chunks`.
    """
    return np.concatenate(
        [np.arange(a, b, dtype=np.int64) for a, b in context_chunks(seq_length, cp_rank, cp_size)]
    )


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
        cp_rank: int = 0,
        cp_size: int = 1,
    ):
        """Args:
        dataset: shuffled samples: a GPTDataset or BlendedDataset (`len`, `[i]` -> (seq+1,),
            `seq_length`).
        micro_batch_size: samples per micro-batch per rank (mbs).
        global_batch_size: samples per optimizer step over all ranks (gbs).
        dp_rank: this rank's data-parallel index.
        dp_size: data-parallel ranks.
        options: loss-mask and document-boundary options (default: neither).
        cp_rank: this rank's context-parallel index; its batches hold only the sequence
            positions `context_positions(seq_length, cp_rank, cp_size)`.
        cp_size: context-parallel ranks (they all read the samples of one dp rank).
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
        self.options = options or BatchOptions()
        self.chunks = None  # cp 1: the whole sequence (and any dataset with `[i]` will do)
        if cp_size != 1 or cp_rank != 0:
            self.chunks = context_chunks(dataset.seq_length, cp_rank, cp_size)  # ((a, b), (a2, b2))
        self.carries_mask = bool(getattr(dataset, "carries_mask", False))
        self.dataset = dataset
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    @property
    def dataset_format(self) -> str:
        """ "sft" for packed conversations with loss masks, else "gpt"."""
        return "sft" if self.carries_mask else "gpt"

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
                f"step {step} needs samples up to {(step + 1) * self.global_batch_size} but "
                f"dataset {self.dataset.name!r} has {len(self.dataset)} ({self.num_steps} steps of "
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

    def sample_arrays(
        self, step: int, microbatch: int
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The micro-batch's samples with, for packed SFT data, their masks and document ids.

        Returns:
            (tokens, token_mask, document_ids), each (micro_batch_size, seq_length + 1): tokens
            as `samples`; token_mask uint8, 1 where the token is an assistant token to predict;
            document_ids (`document_id_dtype`) numbering the conversations of each sample, the
            padding one more. The last two are None for pretraining data.
        """
        if not self.carries_mask:
            return self.samples(step, microbatch), None, None
        idx = self.sample_indices(step, microbatch)
        n = self.dataset.seq_length + 1
        out = np.empty((idx.size, n), dtype=self.dataset.token_dtype)
        mask = np.empty((idx.size, n), dtype=np.uint8)
        docs = np.empty((idx.size, n), dtype=document_id_dtype(self.dataset.seq_length))
        for row, i in enumerate(idx):
            self.dataset.read_into(int(i), out[row], mask_out=mask[row], docs_out=docs[row])
        return out, mask, docs

    def payload_arrays(
        self, step: int, microbatch: int
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """`sample_arrays` as the data service sends them: under context parallelism each
        array cut to this cp rank's two chunks as `payload` cuts the tokens."""
        arrays = self.sample_arrays(step, microbatch)
        if self.cp_size == 1:
            return arrays
        assert self.chunks is not None
        tokens, mask, docs = (
            None if a is None else np.stack([a[:, x : y + 1] for x, y in self.chunks], axis=1)
            for a in arrays
        )  # (mbs, 2, c + 1) each
        assert tokens is not None
        return tokens, mask, docs

    def payload(self, step: int, microbatch: int) -> np.ndarray:
        """The token ids the data service sends for this rank's micro-batch.

        Args:
            step: global batch index (0-based).
            microbatch: micro-batch index in `[0, num_micro_batches)`.

        Returns:
            With cp_size 1, `samples(step, microbatch)`: (micro_batch_size, seq_length + 1).
            Otherwise this cp rank's two chunks [a, b), each with the token after it (the last
            label): (micro_batch_size, 2, seq_length / (2 cp_size) + 1). Dataset token dtype.
        """
        samples = self.samples(step, microbatch)  # (mbs, seq + 1)
        if self.cp_size == 1:
            return samples
        assert self.chunks is not None  # set with cp_size > 1
        return np.stack([samples[:, a : b + 1] for a, b in self.chunks], axis=1)  # (mbs, 2, c + 1)

    def get(self, step: int, microbatch: int) -> Batch:
        """This rank's micro-batch `microbatch` of global step `step`.

        Args:
            step: global batch index (0-based).
            microbatch: micro-batch index in `[0, num_micro_batches)`.

        Returns:
            A Batch of shape (micro_batch_size, seq_length // cp_size): the full batch's columns
            at `context_positions(seq_length, cp_rank, cp_size)`.
        """
        if self.cp_size == 1 or self.options.per_document:
            tokens, mask, docs = self.sample_arrays(step, microbatch)
            full = batch_from_samples(
                tokens, step, microbatch, self.options, token_mask=mask, document_ids=docs
            )
            if self.cp_size == 1:
                return full
            # document ids and positions count the documents of the whole sample, before the
            # chunks: a rank's chunks do not show where the documents before them started
            return select_columns(
                full, context_positions(full.tokens.shape[1], self.cp_rank, self.cp_size)
            )
        tokens, mask, docs = self.payload_arrays(step, microbatch)
        return batch_from_segments(
            tokens, step, microbatch, self.options, token_mask=mask, document_ids=docs
        )

    def micro_batches(self, step: int) -> list[Batch]:
        """All of this rank's micro-batches for one step, in order.

        Args:
            step: global batch index.

        Returns:
            `num_micro_batches` Batches.
        """
        return [self.get(step, m) for m in range(self.num_micro_batches)]


def document_id_dtype(seq_length: int) -> np.dtype:
    """The dtype of packed samples' document ids (at most seq_length + 2 of them)."""
    return np.dtype(np.uint16 if seq_length + 2 <= np.iinfo(np.uint16).max else np.int32)


def batch_from_samples(
    samples: np.ndarray,
    step: int,
    microbatch: int,
    options: BatchOptions | None = None,
    token_mask: np.ndarray | None = None,
    document_ids: np.ndarray | None = None,
) -> Batch:
    """Split (mbs, seq + 1) samples into a Batch of inputs and next-token labels.

    Args:
        samples: (micro_batch_size, seq_length + 1) token ids of any integer dtype.
        step: global batch index.
        microbatch: micro-batch index within the step.
        options: EOD loss masking and document ids (default: neither).
        token_mask: packed SFT samples' (micro_batch_size, seq_length + 1) mask, 1 where the
            token is an assistant token; label position t counts iff token t + 1 is one.
        document_ids: packed SFT samples' (micro_batch_size, seq_length + 1) document ids.

    Returns:
        A Batch with int64 tokens/labels, a float32 loss mask (ones, or the shifted token mask,
        times EOD masking if asked) and document ids (the given ones, else from EODs if asked);
        all (micro_batch_size, seq_length).
    """
    import torch

    t = torch.from_numpy(np.asarray(samples, dtype=np.int64))  # (mbs, seq + 1) int64
    label_mask = None if token_mask is None else _tensor(token_mask)[:, 1:]
    docs = None if document_ids is None else _tensor(document_ids)[:, :-1]
    return _batch(
        t[:, :-1].contiguous(), t[:, 1:].contiguous(), step, microbatch, options, label_mask, docs
    )


def _tensor(a: np.ndarray):
    """A uint8 mask or document ids as an int32 tensor (torch has no uint16 arithmetic)."""
    import torch

    return torch.from_numpy(np.asarray(a, dtype=np.int32))


def batch_from_segments(
    segments: np.ndarray,
    step: int,
    microbatch: int,
    options: BatchOptions | None = None,
    token_mask: np.ndarray | None = None,
    document_ids: np.ndarray | None = None,
) -> Batch:
    """A context-parallel rank's Batch from its chunks of the samples, each with its next token.

    Args:
        segments: (micro_batch_size, n_chunks, c + 1) token ids of any integer dtype: chunk k
            is the samples' tokens [a_k, b_k + 1) (`LocalBatchSource.payload`).
        step: global batch index.
        microbatch: micro-batch index within the step.
        options: EOD loss masking (document ids counted from EODs, and positions, are
            refused: a chunk does not show the EODs before it).
        token_mask, document_ids: packed SFT samples' mask and document ids, cut into the same
            (micro_batch_size, n_chunks, c + 1) chunks.

    Returns:
        A Batch whose tokens/labels/loss mask, (micro_batch_size, n_chunks * c), are the chunks'
        inputs and next-token labels side by side: the columns of `batch_from_samples` on the
        full samples at the chunks' positions.
    """
    import torch

    if options is not None and (
        options.position_ids or (options.document_ids and document_ids is None)
    ):
        raise DataError(
            "document ids counted from EODs, and positions, are not computed from a "
            "context-parallel rank's chunks: they need the whole sample (`select_columns` of "
            "the full batch)"
        )
    t = torch.from_numpy(np.asarray(segments, dtype=np.int64))  # (mbs, n_chunks, c + 1) int64
    mbs = t.shape[0]
    tokens = t[:, :, :-1].reshape(mbs, -1)  # (mbs, n_chunks * c), a copy: chunks are not contiguous
    labels = t[:, :, 1:].reshape(mbs, -1)  # (mbs, n_chunks * c)
    label_mask = None if token_mask is None else _tensor(token_mask)[:, :, 1:].reshape(mbs, -1)
    docs = None if document_ids is None else _tensor(document_ids)[:, :, :-1].reshape(mbs, -1)
    return _batch(tokens, labels, step, microbatch, options, label_mask, docs)


def _batch(
    tokens,
    labels,
    step: int,
    microbatch: int,
    options: BatchOptions | None,
    label_mask=None,
    document_ids=None,
) -> Batch:
    """A Batch of int64 (mbs, seq) inputs and labels, with its loss mask and document ids
    (`label_mask`, `document_ids`: packed SFT data's, already aligned with the labels/inputs)."""
    import torch

    if label_mask is None:
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    else:
        loss_mask = label_mask.to(torch.float32)  # (mbs, seq), a new tensor
    if document_ids is not None:
        document_ids = document_ids.contiguous()  # int32; explicit ids beat EOD counting
    position_ids = None
    if options is not None and options.eod_id is not None:
        is_eod = tokens == options.eod_id  # (mbs, seq)
        if options.mask_eod_loss:
            loss_mask[is_eod] = 0.0
        if options.per_document:
            ids = document_ids
            if ids is None:
                # a document starts after each EOD: count the EODs strictly before each position
                ends = torch.cumsum(is_eod, dim=1, dtype=torch.int32)  # (mbs, seq)
                ids = ends - is_eod.to(torch.int32)
                document_ids = ids if options.document_ids else None
            if options.position_ids:
                position_ids = document_positions(ids)
    return Batch(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        step=step,
        microbatch=microbatch,
        document_ids=document_ids,
        position_ids=position_ids,
    )


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """(mbs, seq) int32: each token's position in its document, from non-decreasing document
    ids (`Batch.document_ids`): the column minus the column where its document starts."""
    import torch

    seq = document_ids.shape[1]
    column = torch.arange(seq, dtype=torch.int32).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # the start column of each token's document: the running maximum of the starts' columns
    first = torch.where(starts, column, torch.zeros_like(column)).cummax(dim=1).values
    return (column - first).to(torch.int32)


def select_columns(batch: Batch, columns: np.ndarray) -> Batch:
    """`batch` at sequence positions `columns` (a context-parallel rank's, `context_positions`)."""
    import torch

    idx = torch.from_numpy(columns)

    def pick(t):
        return None if t is None else t[:, idx].contiguous()

    return Batch(
        tokens=pick(batch.tokens),
        labels=pick(batch.labels),
        loss_mask=pick(batch.loss_mask),
        step=batch.step,
        microbatch=batch.microbatch,
        document_ids=pick(batch.document_ids),
        position_ids=pick(batch.position_ids),
        images=batch.images,
    )
