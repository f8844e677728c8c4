"""Where the trainer's batches come from: in-process by default, the data service on request.

`build_data` resolves the dataset (the embedded stdlib corpus, built and cached on first use,
or the `data.data_path` prefixes, blended by weight when there are several), the tokenizer and
thus the vocabulary, and returns batch sources for the train and validation splits. Both
kinds of source have the same `micro_batches(step)` / `num_micro_batches` interface: a
`LocalBatchSource` reading the files in this process, or, when `data.service_addresses` is
set, a `ServiceBatchSource` streaming the same batches, bit for bit, from DataService
workers. Batches are a pure function of (dataset spec, seed, step), which makes resume exact.
With `data.format = "sft"` the prefixes are chat datasets (checked against the tokenizer), whose
batches carry the assistant-only loss mask and the document ids of their packed conversations.
From the service, the ranks that pull are spread over the workers by their `spread` slot, and
a tensor-parallel group pulls once: its first rank reads and shares (`GroupSharedSource`).
With `data.format = "multimodal"` the sources are image-text records (`dataloader/vision/`) and
the batches carry images; the same two kinds of source serve them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import ConfigError, DataError
from meshtrain.services.dataloader.loader import BatchOptions, LocalBatchSource
from meshtrain.services.dataloader.preprocess import prepare_default_dataset
from meshtrain.services.dataloader.sft_data import check_sft_tokenizer, read_sft_meta
from meshtrain.services.dataloader.spec import DatasetSpec, open_dataset, parse_data_path
from meshtrain.services.dataloader.tokenizers.base import absolute_spec, build_tokenizer
from meshtrain.services.dataloader.vision.dataset import (
    MultimodalBatchSource,
    MultimodalSpec,
    open_multimodal,
)
from meshtrain.services.trainer.config.sections import JobConfig

if TYPE_CHECKING:  # torch loads with the sources that need it, not with the config
    import torch.distributed as dist

log = logging.getLogger("meshtrain.data")


@dataclass
class TrainData:
    """Batch sources and what the model needs to know about the data."""

    train: object  # LocalBatchSource or ServiceBatchSource: micro_batches(step) -> list[Batch]
    valid: object | None
    vocab_size: int
    tokenizer: str
    prefix: str  # the first (or only) dataset prefix


def make_source(
    spec: DatasetSpec | MultimodalSpec,
    micro_batch_size: int,
    global_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    addresses: list[str] | None = None,
    prefetch: int = 8,
    options: BatchOptions | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    **service,
):
    """One rank's batch source for a spec: in-process, or the service when given addresses.

    Args:
        spec: the sample stream.
        micro_batch_size: samples per micro-batch per rank.
        global_batch_size: samples per step over all ranks.
        dp_rank: this rank.
        dp_size: data-parallel ranks.
        addresses: DataService workers; None or empty reads in-process.
        prefetch: micro-batches the service client fetches ahead.
        options: EOD loss masking / document ids for the batches.
        cp_rank, cp_size: this rank's context-parallel coordinate; its batches hold only its
            chunks of each sequence (`context_positions`), and the service sends only those.
        service: more ServiceBatchSource settings (stall_s, give_up_s, open_timeout_s, security).

    Returns:
        A LocalBatchSource or a ServiceBatchSource.
    """
    if addresses:
        from meshtrain.services.dataloader.rpc.client import (
            ServiceBatchSource,
        )  # grpc only when asked for

        return ServiceBatchSource(
            addresses,
            spec,
            micro_batch_size,
            global_batch_size,
            dp_rank,
            dp_size,
            prefetch=prefetch,
            options=options,
            cp_rank=cp_rank,
            cp_size=cp_size,
            **service,
        )
    if isinstance(spec, MultimodalSpec):
        return MultimodalBatchSource(
            open_multimodal(spec),
            micro_batch_size,
            global_batch_size,
            dp_rank,
            dp_size,
            cp_rank=cp_rank,
            cp_size=cp_size,
        )
    return LocalBatchSource(
        open_dataset(spec),
        micro_batch_size,
        global_batch_size,
        dp_rank,
        dp_size,
        options=options,
        cp_rank=cp_rank,
        cp_size=cp_size,
    )


# A peer waits this long in the broadcast for the rank that pulls (which may itself wait up to
# the client's give_up_s for a worker, and then broadcasts its failure).
_SHARE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Sharing:
    """How a rank's tensor-parallel group shares service batches: `group` (gloo, the peers),
    `src` (the global rank that pulls), and whether this rank is it."""

    group: dist.ProcessGroup
    src: int
    reads: bool


def placement(mesh, uses_service: bool) -> tuple[tuple[int, int] | None, Sharing | None]:
    """Where this rank's batches come from on the data service: its `spread` slot among the
    ranks that pull (the first rank of each tensor-parallel group, for each dp and cp rank, on
    the first and the last pipeline stage) and, with tp > 1, its group's `Sharing`.

    Collective when it makes groups (data service and tp > 1): every rank calls it, in order.
    """
    if not uses_service:
        return None, None
    ends = 2 if mesh.pp > 1 else 1
    end = 1 if mesh.pp > 1 and mesh.pp_rank == mesh.pp - 1 else 0
    spread = ((end * mesh.dp + mesh.dp_rank) * mesh.cp + mesh.cp_rank, ends * mesh.dp * mesh.cp)
    if mesh.tp == 1:
        return spread, None
    group, members = mesh.host_group("tp", timeout_s=_SHARE_TIMEOUT_S)
    return spread, Sharing(group, members[0], reads=mesh.rank == members[0])


def _shared(source, sharing: Sharing):
    from meshtrain.services.trainer.shared_batches import GroupSharedSource

    return GroupSharedSource(
        source if sharing.reads else None, sharing.group, sharing.src, shape_of=source
    )


def _dataset(job: JobConfig) -> tuple[list[str], list[float], str, int, int]:
    """(prefixes, weights, tokenizer spec, vocabulary size, EOD id) of the job's dataset: the
    `data.data_path` prefixes with `data.tokenizer`, or the embedded corpus (built on first use).

    Raises:
        ConfigError: model.vocab_size is set below the tokenizer's vocabulary.
    """
    d = job.data
    if d.data_path:
        prefixes, weights = parse_data_path(d.data_path)
        tokenizer_spec = d.tokenizer
        tok = build_tokenizer(tokenizer_spec)
        vocab_size, eod_id = tok.vocab_size, tok.eod_id
        if d.format == "sft":
            for prefix in prefixes:  # a mask made with another tokenizer marks the wrong tokens
                try:
                    check_sft_tokenizer(read_sft_meta(prefix), tok, prefix)
                except DataError as e:
                    raise ConfigError(f"data.data_path: {e}") from None
    else:
        default = prepare_default_dataset(
            Path(d.cache_dir),
            tokenizer=d.tokenizer,
            vocab_size=d.default_vocab_size,
            max_bytes=d.default_corpus_bytes,
        )
        prefixes, weights = [default.prefix], [1.0]
        tokenizer_spec, vocab_size, eod_id = (
            default.tokenizer_spec,
            default.vocab_size,
            default.eod_id,
        )
    # Recorded in every checkpoint; a path relative to this working directory (the embedded
    # corpus's `.cache/meshtrain/...`, or `--tokenizer tok.json`) would not be found by a
    # `meshtrain ckpt export` run from anywhere else.
    tokenizer_spec = absolute_spec(tokenizer_spec)
    if job.model.vocab_size is not None and job.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={job.model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({vocab_size}, {tokenizer_spec})"
        )
    return prefixes, weights, tokenizer_spec, vocab_size, eod_id


def batch_options(job: JobConfig, eod_id: int | None, tokenizer: str) -> BatchOptions:
    """What the job's batches carry besides tokens and labels: the EOD loss mask
    (data.eod_mask_loss), document ids (data.reset_attention_mask) and positions within the
    documents (data.reset_position_ids).

    Raises:
        ConfigError: one of those is on and the tokenizer has no end-of-document token.
    """
    d = job.data
    wanted = [
        key
        for key, on in (
            ("data.eod_mask_loss", d.eod_mask_loss),
            ("data.reset_attention_mask", d.reset_attention_mask),
            ("data.reset_position_ids", d.reset_position_ids),
        )
        if on
    ]
    if wanted and (eod_id is None or eod_id < 0):  # SentencePiece says -1 for none
        raise ConfigError(
            f"{', '.join(wanted)} need(s) the tokenizer's end-of-document id, and tokenizer "
            f"{tokenizer} has none: use a tokenizer with an EOD token or turn them off"
        )
    return BatchOptions(
        eod_id=eod_id,
        mask_eod_loss=d.eod_mask_loss,
        document_ids=d.reset_attention_mask,
        position_ids=d.reset_position_ids,
    )


def _service_options(job: JobConfig, spread: tuple[int, int] | None) -> dict:
    """`make_source`'s options for streaming from the data service (data.service_* and auth)."""
    d = job.data
    return {
        "stall_s": d.service_stall_s,
        "give_up_s": d.service_give_up_s,
        "open_timeout_s": d.service_open_timeout_s,
        "rebalance_s": d.service_rebalance_s,
        "spread": spread,
        "security": ClientSecurity.from_config(job.auth),
    }


def build_data(
    job: JobConfig,
    dp_rank: int = 0,
    dp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    spread: tuple[int, int] | None = None,
    sharing: Sharing | None = None,
) -> TrainData:
    """Open (or build) the dataset for `job` and the sample streams for its splits.

    Args:
        job: the job config (its `data`, `model.seq_length` and `train` sections).
        dp_rank, dp_size: this rank's data-parallel coordinate; the train stream is split over
            dp ranks (Megatron's order), and so is the evaluation set.
        cp_rank, cp_size: this rank's context-parallel coordinate: the cp ranks of a dp rank
            read the same samples and each gets only its chunks of every sequence.
        spread: (slot, slots) of this rank among the ranks that pull from the data service
            (None: by dp and cp rank); it streams from live worker `slot mod count`.
        sharing: with the data service, this rank's tensor-parallel group pulls once and shares
            (None: every rank pulls its own).

    Returns:
        TrainData with the train source and, when evaluation is on, the valid source.
    """
    d, t = job.data, job.train
    if d.format == "multimodal":
        return _multimodal_data(job, dp_rank, dp_size, cp_rank, cp_size, spread)
    prefixes, weights, tokenizer_spec, vocab_size, eod_id = _dataset(job)
    addresses = list(d.service_addresses)
    options = batch_options(job, eod_id, tokenizer_spec)
    service = _service_options(job, spread) if addresses else {}

    def source(split_name: str, num_samples: int, batch: int):
        """The batch source of split `split_name`: `num_samples` samples, `batch` a step."""
        return make_source(
            DatasetSpec(
                tuple(prefixes),
                tuple(weights),
                job.model.seq_length,
                num_samples,
                t.seed,
                split=d.split,
                split_name=split_name,
                sample_order=d.sample_order,
                format=d.format,
            ),
            t.micro_batch_size,
            batch,
            dp_rank,
            dp_size,
            addresses=addresses,
            prefetch=d.prefetch,
            options=options,
            cp_rank=cp_rank,
            cp_size=cp_size,
            **service,
        )

    train = source("train", t.train_iters * t.global_batch_size, t.global_batch_size)
    valid = None
    if t.eval_interval > 0:
        # Megatron's unit: eval_iters global batches, split over the dp ranks like a training
        # step, so the held-out set does not change when a resumed run changes the micro-batch
        # or data-parallel size (the global batch size cannot change across a resume).
        n = t.eval_iters * t.global_batch_size
        valid = source("valid", n, n)
    if addresses and sharing is not None:
        train, valid = (None if src is None else _shared(src, sharing) for src in (train, valid))
    log.info(
        "data: %s (weights %s), tokenizer %s, vocab %d, %s",
        prefixes,
        weights,
        tokenizer_spec,
        vocab_size,
        f"service {addresses}" if addresses else "in-process",
    )
    return TrainData(train, valid, vocab_size, tokenizer_spec, prefixes[0])


def _multimodal_data(
    job: JobConfig,
    dp_rank: int,
    dp_size: int,
    cp_rank: int,
    cp_size: int,
    spread: tuple[int, int] | None,
) -> TrainData:
    """`build_data` for `data.format = "multimodal"`: image-text records of the `data.data_path`
    sources, tokenized with `data.tokenizer`, with the image keys JobConfig took from
    model.vision (`config.checks.resolve_multimodal`); the vocabulary reported to the model
    covers the placeholder. Each rank pulls its own batches, from the service too:
    tensor-parallel peers do not share image batches, they ask for the same (step, dp rank)
    batch, which is a pure function of the spec."""
    d, t = job.data, job.train
    image_size, per_image, normalization = d.image_size, d.tokens_per_image, d.image_normalization
    assert d.image_token_id is not None and image_size and per_image and normalization
    tok = build_tokenizer(d.tokenizer)
    tokenizer_spec = absolute_spec(d.tokenizer)
    image_token_id = d.image_token_id
    vocab_size = max(tok.vocab_size, image_token_id + 1)
    if job.model.vocab_size is not None and job.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={job.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"with the image placeholder ({vocab_size}: model.vision.image_token_id="
            f"{image_token_id})"
        )
    addresses = list(d.service_addresses)
    service = _service_options(job, spread) if addresses else {}

    def source(split_name: str, num_samples: int, batch: int):
        spec = MultimodalSpec(
            paths=tuple(d.data_path),
            tokenizer=tokenizer_spec,
            seq_length=job.model.seq_length,
            num_samples=num_samples,
            seed=t.seed,
            image_token_id=image_token_id,
            tokens_per_image=per_image,
            image_size=image_size,
            resize_mode=d.image_resize,
            normalization=normalization,
            wire_dtype=d.image_wire_dtype,
            bad_image_policy=d.bad_image_policy,
            split=d.split,
            split_name=split_name,
        )
        return make_source(
            spec,
            t.micro_batch_size,
            batch,
            dp_rank,
            dp_size,
            addresses=addresses,
            prefetch=d.prefetch,
            cp_rank=cp_rank,
            cp_size=cp_size,
            **service,
        )

    train = source("train", t.train_iters * t.global_batch_size, t.global_batch_size)
    valid = None
    if t.eval_interval > 0:
        n = t.eval_iters * t.global_batch_size
        valid = source("valid", n, n)
    log.info(
        "data: multimodal %s, tokenizer %s, vocab %d (image placeholder %d x %d), %s",
        d.data_path,
        tokenizer_spec,
        vocab_size,
        image_token_id,
        d.tokens_per_image,
        f"service {addresses}" if addresses else "in-process",
    )
    return TrainData(train, valid, vocab_size, tokenizer_spec, d.data_path[0])
