"""The data client's reading of one stream's `MicroBatch` messages: `MessageDecoder`.

It owns what a message must look like for the request that opened the stream, and turns a
message into arrays only once it does: tokens of a token dtype of the MMIDIDX format, in the
`payload_shape` asked for ((mbs, seq + 1), or under context parallelism the rank's two chunks
each with its next token, so whole samples from a worker that predates cp are an error, never a
batch of the wrong positions), with exactly the bytes that shape and dtype take; for SFT data
the loss mask and document ids alike, and for pretraining data neither. Multimodal payloads are
checked by `multimodal.payload_from_message`. Every mismatch is a DataError naming the worker,
the step and micro-batch, and what was expected. Connections, failover and the prefetch queue
stay in `client.py`.
"""

from __future__ import annotations

import numpy as np

from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.indexed import DTYPE_CODES
from meshtrain.services.dataloader.loader import document_id_dtype
from meshtrain.services.dataloader.rpc.multimodal import payload_from_message
from meshtrain.services.dataloader.spec import DatasetSpec
from meshtrain.services.dataloader.vision.dataset import MultimodalSpec


class MessageDecoder:
    """Checks and decodes the micro-batch messages streamed for one rank's request."""

    def __init__(
        self,
        spec: DatasetSpec | MultimodalSpec,
        micro_batch_size: int,
        cp_rank: int,
        cp_size: int,
        chunks: tuple[tuple[int, int], ...],
    ):
        """Args:
        spec: the stream asked for.
        micro_batch_size: samples per micro-batch.
        cp_rank: the rank's context-parallel index.
        cp_size: context-parallel ranks.
        chunks: `context_chunks(spec.seq_length, cp_rank, cp_size)`.
        """
        self.spec = spec
        self.micro_batch_size = micro_batch_size
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.chunks = chunks

    @property
    def payload_shape(self) -> tuple[int, ...]:
        """The shape of a micro-batch message's tokens: (mbs, seq + 1), or under context
        parallelism (mbs, 2, seq / (2 cp) + 1), the rank's two chunks each with its next token."""
        if self.cp_size == 1:
            return (self.micro_batch_size, self.spec.seq_length + 1)
        (a, b), _ = self.chunks
        return (self.micro_batch_size, len(self.chunks), b - a + 1)

    def decode(self, msg: pb.MicroBatch, address: str) -> tuple:
        """(samples, token mask, document ids) of a message from the worker at `address`."""
        # (mbs, seq + 1) or (mbs, 2, c + 1); SFT's mask and document ids alike
        return self._samples(msg, address), *self._sft_arrays(msg, address)

    def _samples(self, msg: pb.MicroBatch, address: str):
        """The `payload_shape` tokens of a message, checked against what was asked for: a
        malformed one raised numpy's bare ValueError, one with another dtype name than its
        bytes were decoded as garbage tokens, and whole samples from a worker that ignored
        the cp fields would have been read as the wrong positions."""
        where = f"worker {address} sent step {msg.step} micro-batch {msg.microbatch}"
        if isinstance(self.spec, MultimodalSpec):
            return payload_from_message(msg, self.spec, self.micro_batch_size, where)
        want = self.payload_shape
        dtype = next((d for d in DTYPE_CODES.values() if d.name == msg.dtype), None)
        if dtype is None:
            raise DataError(
                f"{where} as dtype {msg.dtype!r}, not a token dtype of the MMIDIDX format"
            )
        if tuple(msg.shape) != want:
            cp = ""
            if self.cp_size > 1:
                cp = (
                    f" (the chunks of cp_rank={self.cp_rank} of cp_size={self.cp_size}; a worker "
                    "that predates context parallelism sends whole samples: upgrade it)"
                )
            raise DataError(f"{where} of shape {tuple(msg.shape)}, expected {want}{cp}")
        n = int(np.prod(want))
        if len(msg.samples) != n * dtype.itemsize:
            raise DataError(
                f"{where} with {len(msg.samples)} bytes, expected "
                f"{n * dtype.itemsize} for {want} {dtype.name}"
            )
        return np.frombuffer(msg.samples, dtype=dtype.newbyteorder("<")).reshape(want)

    def _sft_arrays(
        self, msg: pb.MicroBatch, address: str
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(token mask, document ids) of an SFT message, checked like its samples; (None, None)
        for pretraining data, whose messages must carry neither."""
        where = f"worker {address} sent step {msg.step} micro-batch {msg.microbatch}"
        has = msg.HasField("token_mask"), msg.HasField("document_ids")
        fmt = getattr(self.spec, "format", "multimodal")  # a MultimodalSpec has no format
        if fmt != "sft":
            if any(has):
                raise DataError(f"{where} with an SFT loss mask, for format {fmt!r}")
            return None, None
        if not all(has):
            raise DataError(f"{where} without its loss mask and document ids (format 'sft')")
        want_doc = document_id_dtype(self.spec.seq_length)
        return (
            self._array(msg.token_mask, np.dtype(np.uint8), f"{where}: token_mask"),
            self._array(msg.document_ids, want_doc, f"{where}: document_ids"),
        )

    def _array(self, a: pb.Array, dtype: np.dtype, where: str) -> np.ndarray:
        """An Array message as `payload_shape` values of `dtype`, or a DataError saying why not."""
        want = self.payload_shape
        if a.dtype != dtype.name or tuple(a.shape) != want:
            raise DataError(f"{where} is {a.dtype} {tuple(a.shape)}, expected {dtype.name} {want}")
        if len(a.data) != int(np.prod(want)) * dtype.itemsize:
            raise DataError(f"{where} has {len(a.data)} bytes for {want} {dtype.name}")
        return np.frombuffer(a.data, dtype=dtype.newbyteorder("<")).reshape(want)
