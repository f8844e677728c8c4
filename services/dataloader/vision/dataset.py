"""Multimodal samples and batches: records -> tokens with image placeholders, loss mask, pixels.

A `MultimodalSpec` is everything that determines the stream (sources, tokenizer, sizes, seed,
image settings), as `DatasetSpec` is for text; `MultimodalDataset` serves its samples in a seeded
order over epochs (epoch e is the permutation `default_rng([seed, e])` of the split's records),
and `MultimodalBatchSource` cuts that order into the micro-batches of (step, dp rank) exactly as
`LocalBatchSource` does, so the batch of (step, rank) is a pure function of the spec and the
batch sizes: resume is exact and any data worker serves any rank.

A sample is `seq_length + 1` tokens. Each image becomes `tokens_per_image` copies of
`image_token_id` where its `<image>` tag stands in the text (a record with images and no tag
gets one `<image>\\n` per image before its first user turn, or before its caption, as LLaVA
does). A caption sample is the image placeholders then the caption and EOD, trained on the
caption and EOD. A conversation is rendered `USER: ...\\n` / `ASSISTANT: ...<EOD>` (system
turns as their text and a newline) and trained on the assistant replies and their EODs only.
The loss mask is 0 where the label is an image placeholder, on prompt tokens and
on padding (EOD ids after the sample). Text longer than the sample is cut at the end; a sample
whose image placeholders would be cut (they must all lie in the model's input, the first
`seq_length` tokens) is refused, counted and logged by name, and replaced.

A bad record (an image that does not decode, malformed text) is named in the error and, under
`bad_image_policy="stop"`, stops the run; under "skip" it is logged by name, counted
(`MultimodalDataset.skipped`) and replaced by the next good record of the same epoch's order.
Badness is a property of the record's bytes, so the replacement, and with it every batch,
stays a pure function of (spec, step, rank).

    spec = MultimodalSpec(("shards/",), "tok.json", seq_length=1024, num_samples=N, seed=1,
                          image_token_id=32000, tokens_per_image=576)
    src = MultimodalBatchSource(open_multimodal(spec), 4, 32, dp_rank=r, dp_size=2)
    src.get(step, 0).images   # (n_images, 3, 336, 336) float32
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.loader import Batch, LocalBatchSource
from meshtrain.services.dataloader.samples import split_ranges
from meshtrain.services.dataloader.spec import MAX_SAMPLES, SPLITS
from meshtrain.services.dataloader.vision.images import WIRE_DTYPES, ImageTransform
from meshtrain.services.dataloader.vision.sources import BadRecordError, Record, open_records

if TYPE_CHECKING:
    from meshtrain.services.dataloader.index_cache import IndexCache
    from meshtrain.services.dataloader.tokenizers.base import Tokenizer

log = logging.getLogger("meshtrain.data")

IMAGE_TAG = "<image>"
BAD_IMAGE_POLICIES = ("stop", "skip")
USER, ASSISTANT = "USER: ", "ASSISTANT: "


@dataclass(frozen=True)
class MultimodalSpec:
    """Everything that determines a multimodal sample stream (not the batching)."""

    paths: tuple[str, ...]
    """Sources: Energon dataset folders, folders of WebDataset `.tar` shards, `.tar` files or
    `.jsonl` files (`sources.open_records`), read end to end."""
    tokenizer: str
    """The tokenizer spec (`tokenizers.base.build_tokenizer`)."""
    seq_length: int
    num_samples: int
    seed: int
    image_token_id: int
    """The placeholder id standing for one image token."""
    tokens_per_image: int = 576
    image_size: int = 336
    resize_mode: str = "crop"
    normalization: str = "clip"
    wire_dtype: str = "uint8"
    """How pixels travel from the worker: "uint8" (normalized on the client) or "bfloat16"."""
    bad_image_policy: str = "stop"
    split: str = "969,30,1"
    """Train/valid/test weights over a plain source's records (an Energon dataset's split is
    its split.yaml's)."""
    split_name: str = "train"

    def validate(self) -> None:
        """Check the fields that need no file opened; raises DataError naming the field."""
        if not self.paths:
            raise DataError("multimodal spec names no source paths")
        if self.seq_length < 1:
            raise DataError(f"seq_length={self.seq_length} must be >= 1")
        if not 1 <= self.num_samples <= MAX_SAMPLES:
            raise DataError(f"num_samples={self.num_samples} must be in [1, 2^36]")
        if not 0 <= self.seed < 2**32:
            raise DataError(f"seed={self.seed} must be in [0, 2^32)")
        if not 0 <= self.image_token_id < 2**31:
            raise DataError(f"image_token_id={self.image_token_id} must be in [0, 2^31)")
        if not 1 <= self.tokens_per_image <= self.seq_length:
            raise DataError(
                f"tokens_per_image={self.tokens_per_image} must be in [1, seq_length="
                f"{self.seq_length}]"
            )
        if self.wire_dtype not in WIRE_DTYPES:
            raise DataError(f"image wire dtype {self.wire_dtype!r} is not one of {WIRE_DTYPES}")
        if self.bad_image_policy not in BAD_IMAGE_POLICIES:
            raise DataError(
                f"bad_image_policy {self.bad_image_policy!r} is not one of {BAD_IMAGE_POLICIES}"
            )
        if self.split_name not in SPLITS:
            raise DataError(f"split_name {self.split_name!r} is not one of {SPLITS}")
        split_ranges(1_000_000, self.split)
        self.transform  # noqa: B018 -- validates image_size, resize_mode, normalization

    @property
    def transform(self) -> ImageTransform:
        return ImageTransform(self.image_size, self.resize_mode, self.normalization)

    @property
    def max_images(self) -> int:
        """The most images one sample can hold: all their placeholders lie in its input."""
        return self.seq_length // self.tokens_per_image

    def image_wire_bytes(self) -> int:
        """Bytes of one image on the wire."""
        return 3 * self.image_size**2 * (1 if self.wire_dtype == "uint8" else 2)


@dataclass
class MultimodalPayload:
    """A micro-batch as the worker sends it."""

    tokens: np.ndarray  # (mbs, seq + 1) int32: tokens = [:, :-1], labels = [:, 1:]
    loss_mask: np.ndarray  # (mbs, seq) uint8
    images: np.ndarray  # (n_images, 3, S, S) uint8 pixels, or uint16 bf16 bits (normalized)


def render(
    rec: Record, tokenizer: Tokenizer, spec: MultimodalSpec
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained) of a record, before padding or truncation: int64 token ids with each image
    expanded to `tokens_per_image` placeholders, and 1 where a token is trained as a label.

    Raises:
        BadRecordError: the number of `<image>` tags differs from the record's images.
        DataError: the tokenizer emits `image_token_id` for ordinary text (a config error).
    """
    n = len(rec.images)
    eod = tokenizer.eod_id
    if rec.caption is not None:
        tags = rec.caption.count(IMAGE_TAG)
        turns = [("caption", rec.caption if tags or not n else IMAGE_TAG * n + rec.caption)]
    else:
        assert rec.conversation is not None
        tags = sum(text.count(IMAGE_TAG) for _, text in rec.conversation)
        turns = list(rec.conversation)
        if n and not tags:  # LLaVA: the image goes before the first user turn's text
            first = next((i for i, (role, _) in enumerate(turns) if role == "user"), 0)
            role, text = turns[first]
            turns[first] = (role, f"{IMAGE_TAG}\n" * n + text)
    if tags and tags != n:
        raise BadRecordError(f"{rec.name}: {tags} {IMAGE_TAG} tags for {n} images")
    ids: list[np.ndarray] = []
    trained: list[np.ndarray] = []
    image_block = np.full(spec.tokens_per_image, spec.image_token_id, np.int64)

    def add(text: str, train: bool) -> None:
        for k, piece in enumerate(text.split(IMAGE_TAG)):
            if k:
                ids.append(image_block)
                trained.append(np.zeros(spec.tokens_per_image, np.uint8))
            if piece:
                t = np.asarray(tokenizer.encode(piece), np.int64)
                if (t == spec.image_token_id).any():
                    raise DataError(
                        f"{rec.name}: the tokenizer gives the text {piece[:40]!r} the id "
                        f"image_token_id={spec.image_token_id}; give data.image_token_id an id "
                        f"the tokenizer never emits for text (e.g. its vocab_size, "
                        f"{tokenizer.vocab_size})"
                    )
                ids.append(t)
                trained.append(np.full(t.size, int(train), np.uint8))

    def end(train: bool) -> None:
        ids.append(np.asarray([eod], np.int64))
        trained.append(np.asarray([int(train)], np.uint8))

    for role, text in turns:
        if role == "caption":
            add(text, True)
            end(True)
        elif role == "system":
            add(text + "\n", False)
        elif role == "user":
            add(USER + text + "\n", False)
        else:
            add(ASSISTANT, False)
            add(text, True)
            end(True)
    return np.concatenate(ids), np.concatenate(trained)


class SampleTooLongError(BadRecordError):
    """A sample whose image placeholders would not all fit in the model's input; always
    refused (counted, logged by name, replaced), whatever `bad_image_policy` says."""


class MultimodalDataset:
    """The samples of a MultimodalSpec in their seeded order; `sample(k)` for k < num_samples."""

    def __init__(self, spec: MultimodalSpec, records, tokenizer: Tokenizer):
        spec.validate()
        if spec.image_token_id == tokenizer.eod_id:
            raise DataError(
                f"image_token_id={spec.image_token_id} is the tokenizer's end-of-document id, "
                f"which pads samples; give an id the tokenizer never emits (e.g. its vocab_size, "
                f"{tokenizer.vocab_size})"
            )
        self.spec = spec
        self.records = records
        self.tokenizer = tokenizer
        self.transform = spec.transform
        self.name = spec.split_name
        self.seq_length = spec.seq_length
        self.skipped: Counter[str] = Counter()  # "bad" / "too long" -> records skipped
        self._bad: dict[int, str] = {}  # record -> why it is skipped
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.spec.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                order = np.random.default_rng([self.spec.seed, epoch]).permutation(
                    len(self.records)
                )
                self._orders[epoch] = order
                while len(self._orders) > 4:
                    self._orders.popitem(last=False)
            return order

    def record_index(self, k: int) -> int:
        """The record sample k is drawn from, before any replacement."""
        n = len(self.records)
        return int(self._order(k // n)[k % n])

    def sample(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens (seq + 1,) int32, loss mask (seq,) uint8, pixels (n, 3, S, S) uint8) of
        sample k: its record's, or the next good record's of the same epoch's order when that
        one is skipped.

        Raises:
            BadRecordError: the record is bad and the policy is "stop" (its name and why).
            DataError: no record of the epoch can be trained on.
        """
        if not 0 <= k < self.spec.num_samples:
            raise DataError(f"sample {k} is outside [0, {self.spec.num_samples})")
        n = len(self.records)
        order = self._order(k // n)
        for t in range(n):
            r = int(order[(k % n + t) % n])
            if r in self._bad:
                continue
            try:
                return self._make(r)
            except BadRecordError as e:
                too_long = isinstance(e, SampleTooLongError)
                if self.spec.bad_image_policy == "stop" and not too_long:
                    raise type(e)(
                        f"{e} (data.bad_image_policy='stop'; 'skip' replaces bad records)"
                    ) from e
                with self._lock:
                    if r not in self._bad:
                        self._bad[r] = str(e)
                        self.skipped["too long" if too_long else "bad"] += 1
                        skipped = sum(self.skipped.values())
                log.warning(
                    "data: skipping record %s: %s (%d skipped so far%s)",
                    self.records.name(r),
                    e,
                    skipped,
                    "" if too_long else "; data.bad_image_policy='skip'",
                )
        raise DataError(
            f"no record of the {self.name} split of {list(self.spec.paths)} can be trained on "
            f"({dict(self.skipped)} skipped); the last: {self._bad.get(int(order[k % n]))}"
        )

    def _make(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        spec = self.spec
        rec = self.records.read(r)
        ids, trained = render(rec, self.tokenizer, spec)
        is_image = ids == spec.image_token_id
        s1 = spec.seq_length + 1
        if ids.size > s1 and is_image.any():
            last = int(np.flatnonzero(is_image)[-1])
            if last >= spec.seq_length:  # a placeholder past the model's input
                raise SampleTooLongError(
                    f"{rec.name}: its {len(rec.images)} image(s) and text take {ids.size} tokens; "
                    f"image tokens would be cut at seq_length={spec.seq_length} "
                    f"(tokens_per_image={spec.tokens_per_image})"
                )
        # decoded after the text checks: a refused sample costs no image decode
        pixels = np.empty((len(rec.images), 3, spec.image_size, spec.image_size), np.uint8)
        for i, (data, where) in enumerate(rec.images):
            pixels[i] = self.transform.pixels(data, where)
        tokens = np.full(s1, self.tokenizer.eod_id, np.int64)
        target = np.zeros(s1, np.uint8)
        m = min(ids.size, s1)
        tokens[:m], target[:m] = ids[:m], trained[:m]
        image = tokens == spec.image_token_id
        # label t is tokens[t + 1]: trained unless it is a placeholder, a prompt token or padding.
        # The text right after an image is predicted from the image's last position: trained, as
        # LLaVA does (it is where the model must read the image)
        loss_mask = (target[1:] & ~image[1:]).astype(np.uint8)
        return tokens.astype(np.int32), loss_mask, pixels


def open_multimodal(
    spec: MultimodalSpec, cache: bool | str | IndexCache = True, tokenizer: Tokenizer | None = None
) -> MultimodalDataset:
    """Open a spec's sources (building or loading their shard indices) and its tokenizer."""
    spec.validate()
    if tokenizer is None:
        from meshtrain.services.dataloader.tokenizers.base import build_tokenizer

        tokenizer = build_tokenizer(spec.tokenizer)
    records = open_records(list(spec.paths), spec.split, spec.split_name, cache)
    return MultimodalDataset(spec, records, tokenizer)


class MultimodalBatchSource(LocalBatchSource):
    """One data-parallel rank's multimodal micro-batches, in Megatron's sample order (as
    `LocalBatchSource`: global batch g is samples [g gbs, (g + 1) gbs), rank r's slice of each
    micro-batch)."""

    def __init__(
        self,
        dataset: MultimodalDataset,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
    ):
        if cp_size != 1:
            raise DataError(
                f"multimodal batches are not cut for context parallelism (cp_size={cp_size}): "
                "an image's placeholders would span cp ranks"
            )
        super().__init__(dataset, micro_batch_size, global_batch_size, dp_rank, dp_size)

    def payload(self, step: int, microbatch: int) -> MultimodalPayload:  # type: ignore[override]
        """What the data service sends for this rank's micro-batch."""
        ds = self.dataset
        rows = [ds.sample(int(k)) for k in self.sample_indices(step, microbatch)]
        spec = ds.spec
        pixels = [p for _, _, p in rows]
        images = (
            np.concatenate(pixels)
            if pixels
            else np.empty((0, 3, spec.image_size, spec.image_size), np.uint8)
        )
        return MultimodalPayload(
            tokens=np.stack([t for t, _, _ in rows]),
            loss_mask=np.stack([m for _, m, _ in rows]),
            images=ds.transform.encode_wire(images, spec.wire_dtype),
        )

    def samples(self, step: int, microbatch: int) -> np.ndarray:
        return self.payload(step, microbatch).tokens

    def get(self, step: int, microbatch: int) -> Batch:
        return batch_from_payload(
            self.payload(step, microbatch), step, microbatch, self.dataset.spec
        )


def batch_from_payload(
    payload: MultimodalPayload, step: int, microbatch: int, spec: MultimodalSpec
) -> Batch:
    """The trainer's Batch of a multimodal micro-batch: int64 tokens/labels, float32 loss mask,
    float32 normalized images (n_images, 3, S, S) in order of appearance (possibly none).

    Raises:
        DataError: the placeholders do not make exactly `tokens_per_image` per image.
    """
    import torch

    t = torch.from_numpy(np.asarray(payload.tokens, dtype=np.int64))  # (mbs, seq + 1)
    tokens = t[:, :-1].contiguous()
    n_placeholders = int((tokens == spec.image_token_id).sum())
    n_images = payload.images.shape[0]
    if n_placeholders != n_images * spec.tokens_per_image:
        raise DataError(
            f"step {step} micro-batch {microbatch}: {n_placeholders} image placeholders for "
            f"{n_images} images of {spec.tokens_per_image} tokens"
        )
    images = spec.transform.decode_wire(payload.images, spec.wire_dtype)
    return Batch(
        tokens=tokens,
        labels=t[:, 1:].contiguous(),
        loss_mask=torch.from_numpy(np.asarray(payload.loss_mask, dtype=np.float32)),
        step=step,
        microbatch=microbatch,
        images=torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)),
    )
