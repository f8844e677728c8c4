"""Vision-language streams on the wire: `MultimodalSpec` and micro-batch payloads <-> messages.

A multimodal micro-batch is one `MicroBatch` message: the tokens as int32 `samples` (mbs,
seq_length + 1), the loss mask as uint8 bytes (mbs, seq_length), and the images, in order of
appearance, as raw little-endian bytes with their dtype and shape: uint8 pixels (the client
normalizes them, exactly as the in-process path does) or bfloat16 normalized values (twice the
bytes, no work on the client). A request is refused before anything is opened when its largest
possible message (every sample holding as many images as fit its `seq_length`) would pass
`MAX_MULTIMODAL_BATCH_BYTES`, which stays under gRPC's message limit as both ends raise it; the
error says how large and what to lower. The client checks every message against what it asked
for (dtype, shapes, byte counts) before it makes a Batch.
"""

from __future__ import annotations

import numpy as np

from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
from meshtrain.services.common.errors import DataError
from meshtrain.services.common.grpc_utils import MAX_MESSAGE_BYTES
from meshtrain.services.common.sanitize import check_text
from meshtrain.services.dataloader.blend import MAX_DATASETS
from meshtrain.services.dataloader.served_roots import ServedRoots
from meshtrain.services.dataloader.spec import MAX_SAMPLES
from meshtrain.services.dataloader.vision.dataset import MultimodalPayload, MultimodalSpec

# room for the message's other fields and protobuf framing under the raised gRPC limit
MAX_MULTIMODAL_BATCH_BYTES = MAX_MESSAGE_BYTES - (1 << 20)
WIRE_NUMPY: dict[str, np.dtype] = {
    "uint8": np.dtype(np.uint8),
    "bfloat16": np.dtype("<u2"),
}  # bf16 travels as bits
_MAX_PATH_CHARS = 4096
# tokenizer specs naming no file, and the prefixes of those that name files
_NO_FILE = ("byte", "null:")
_FILE_KINDS = ("tiktoken:", "sentencepiece:", "megatron-tiktoken:", "gpt2bpe:")


def mm_spec_to_proto(spec: MultimodalSpec) -> pb.MultimodalSpec:
    """The message form of a MultimodalSpec."""
    return pb.MultimodalSpec(
        paths=list(spec.paths),
        tokenizer=spec.tokenizer,
        seq_length=spec.seq_length,
        num_samples=spec.num_samples,
        seed=spec.seed,
        image_token_id=spec.image_token_id,
        tokens_per_image=spec.tokens_per_image,
        image_size=spec.image_size,
        resize_mode=spec.resize_mode,
        normalization=spec.normalization,
        wire_dtype=spec.wire_dtype,
        bad_image_policy=spec.bad_image_policy,
        split=spec.split,
        split_name=spec.split_name,
    )


def tokenizer_files(spec: str) -> list[str]:
    """The files a tokenizer spec names (none for 'byte' and 'null:N')."""
    if spec == "byte" or spec.startswith(_NO_FILE[1]):
        return []
    for kind in _FILE_KINDS:
        if spec.startswith(kind):
            return [p for p in spec[len(kind) :].split(",") if p]
    return [spec]


def mm_spec_from_proto(
    m: pb.MultimodalSpec, max_samples: int = MAX_SAMPLES, roots: ServedRoots | None = None
) -> MultimodalSpec:
    """A MultimodalSpec from its message, validated like `servicer.spec_from_proto`: bounded
    strings, local paths under the worker's `roots` (sources and tokenizer files), at most
    `max_samples` samples. Raises DataError naming the field (DataAccessDeniedError for a path
    outside `roots`)."""
    if not 1 <= len(m.paths) <= MAX_DATASETS:
        raise DataError(f"multimodal.paths has {len(m.paths)} entries; give 1 to {MAX_DATASETS}")
    check_text(m.tokenizer, "multimodal.tokenizer", _MAX_PATH_CHARS, DataError)
    for i, path in enumerate(m.paths):
        check_text(path, f"multimodal.paths[{i}]", _MAX_PATH_CHARS, DataError)
        if "://" in path or "::" in path:
            raise DataError(f"multimodal.paths[{i}]: only local paths are served")
    if roots is not None:
        for path in [*m.paths, *tokenizer_files(m.tokenizer)]:
            roots.check(path)
    for name in ("resize_mode", "normalization", "wire_dtype", "bad_image_policy", "split"):
        check_text(getattr(m, name), f"multimodal.{name}", 256, DataError, allow_empty=True)
    if m.num_samples > max_samples:
        raise DataError(
            f"multimodal.num_samples={m.num_samples} is over this data worker's limit of "
            f"{max_samples} (`data serve --max-samples`)"
        )
    spec = MultimodalSpec(
        paths=tuple(m.paths),
        tokenizer=m.tokenizer,
        seq_length=int(m.seq_length),
        num_samples=int(m.num_samples),
        seed=int(m.seed),
        image_token_id=int(m.image_token_id),
        tokens_per_image=int(m.tokens_per_image),
        image_size=int(m.image_size),
        resize_mode=m.resize_mode or "crop",
        normalization=m.normalization or "clip",
        wire_dtype=m.wire_dtype or "uint8",
        bad_image_policy=m.bad_image_policy or "stop",
        split=m.split or "969,30,1",
        split_name=m.split_name or "train",
    )
    spec.validate()
    return spec


def max_batch_bytes(spec: MultimodalSpec, micro_batch_size: int) -> int:
    """The largest message a micro-batch of `micro_batch_size` samples can make."""
    tokens = micro_batch_size * (spec.seq_length + 1) * 4 + micro_batch_size * spec.seq_length
    return tokens + micro_batch_size * spec.max_images * spec.image_wire_bytes()


def check_batch_bytes(spec: MultimodalSpec, micro_batch_size: int) -> None:
    """Raise DataError when a micro-batch could make a message over the limit."""
    n = max_batch_bytes(spec, micro_batch_size)
    if n > MAX_MULTIMODAL_BATCH_BYTES:
        raise DataError(
            f"micro_batch_size={micro_batch_size} samples of up to {spec.max_images} images "
            f"(seq_length {spec.seq_length} / tokens_per_image {spec.tokens_per_image}) of "
            f"{spec.image_size}^2 {spec.wire_dtype} pixels can make {n} byte messages, over the "
            f"{MAX_MULTIMODAL_BATCH_BYTES} limit: lower the micro-batch size, or send uint8 "
            "pixels (data.image_wire_dtype)"
        )


def payload_message(payload: MultimodalPayload, step: int, microbatch: int) -> pb.MicroBatch:
    """The MicroBatch of a multimodal payload."""
    tokens = payload.tokens.astype("<i4", copy=False)
    images = payload.images
    return pb.MicroBatch(
        step=step,
        microbatch=microbatch,
        dtype="int32",
        shape=list(tokens.shape),
        samples=tokens.tobytes(),
        loss_mask=payload.loss_mask.astype(np.uint8, copy=False).tobytes(),
        images_dtype="uint8" if images.dtype == np.uint8 else "bfloat16",
        images_shape=list(images.shape),
        images=images.astype(images.dtype.newbyteorder("<"), copy=False).tobytes(),
    )


def payload_from_message(
    msg: pb.MicroBatch, spec: MultimodalSpec, micro_batch_size: int, where: str
) -> MultimodalPayload:
    """The payload of a MicroBatch, checked against the spec and batch size; raises DataError
    saying what does not match (`where` names the worker and position)."""
    rows, s = micro_batch_size, spec.seq_length
    if (
        msg.dtype != "int32"
        or tuple(msg.shape) != (rows, s + 1)
        or len(msg.samples) != rows * (s + 1) * 4
    ):
        raise DataError(
            f"{where}: tokens {msg.dtype} {tuple(msg.shape)} ({len(msg.samples)} bytes), "
            f"expected int32 {(rows, s + 1)} (a worker that predates multimodal streams?)"
        )
    if len(msg.loss_mask) != rows * s:
        raise DataError(f"{where}: a loss mask of {len(msg.loss_mask)} bytes, expected {rows * s}")
    want = WIRE_NUMPY[spec.wire_dtype]
    shape = tuple(msg.images_shape)
    n = shape[0] if shape else -1
    if (
        msg.images_dtype != spec.wire_dtype
        or len(shape) != 4
        or shape[1:] != (3, spec.image_size, spec.image_size)
        or not 0 <= n <= rows * spec.max_images
        or len(msg.images) != int(np.prod(shape)) * want.itemsize
    ):
        raise DataError(
            f"{where}: images {msg.images_dtype} {shape} ({len(msg.images)} bytes), expected "
            f"{spec.wire_dtype} (n, 3, {spec.image_size}, {spec.image_size})"
        )
    return MultimodalPayload(
        tokens=np.frombuffer(msg.samples, dtype="<i4").reshape(rows, s + 1),
        loss_mask=np.frombuffer(msg.loss_mask, dtype=np.uint8).reshape(rows, s),
        images=np.frombuffer(msg.images, dtype=want).reshape(shape),
    )
