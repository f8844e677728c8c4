"""One WriteShards stream's boxes as they arrive: each box is assembled in a buffer of exactly
its size, drawn from the service's in-flight `ByteBudget` before it is allocated (a chunk beyond
the box, or over the chunk limit, is INVALID_ARGUMENT), and handed to the save's writer as soon as
it is complete, so the service holds at most the boxes in flight; the stream keeps count of what
it stored (the boxes, their bytes, and which boxes it began to store, for the removal of what a
stream failing with the disk full left behind) and says where it stood when it stalled.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.multiwriter import ShardWriter
from meshtrain.services.checkpoint.rpc.limits import ByteBudget, box_from_pb
from meshtrain.services.common.errors import InvalidRequestError


class BoxStream:
    """The boxes of one WriteShards stream.

    Args:
        budget: the service's in-flight budget each box's buffer is taken from.
        max_chunk_bytes: the largest data chunk accepted.
        is_active: the RPC's `context.is_active`: a caller gone stops waiting for the budget.
    """

    def __init__(self, budget: ByteBudget, max_chunk_bytes: int, is_active: Callable[[], bool]):
        self.budget = budget
        self.max_chunk_bytes = max_chunk_bytes
        self.is_active = is_active
        self.boxes = 0  # stored
        self.total = 0  # bytes the writer wrote
        self.spec: ShardSpec | None = None
        self.buf: bytearray | None = None  # the box's bytes: set and cleared with spec
        self.filled = 0
        self.stored: list[ShardSpec] = []  # the boxes begun to store, a torn one included

    def begin_box(self, box: pb.Box) -> None:
        """A box message: the box the next chunks fill, its buffer taken from the budget."""
        if self.spec is not None and self.buf is not None:
            raise InvalidRequestError(
                f"box {self.spec.offsets} of array {self.spec.array!r} ended after {self.filled} "
                f"of {len(self.buf)} bytes"
            )
        spec = self.spec = box_from_pb(box, self.budget.limit)
        nbytes = math.prod(spec.shape) * layout._DTYPES[spec.dtype][1].itemsize
        self.budget.acquire(nbytes, f"box {spec.offsets} of array {spec.array!r}", self.is_active)
        self.buf, self.filled = bytearray(nbytes), 0

    def take_chunk(self, chunk: bytes) -> None:
        """A data chunk, copied into the box's buffer."""
        spec, buf = self.spec, self.buf
        if spec is None:
            raise InvalidRequestError("a data chunk arrived before any box")
        assert buf is not None
        size = len(chunk)
        if size > self.max_chunk_bytes:
            raise InvalidRequestError(
                f"chunk of {size} bytes for array {spec.array!r} is over the limit "
                f"of {self.max_chunk_bytes} bytes"
            )
        if self.filled + size > len(buf):
            raise InvalidRequestError(
                f"box {spec.offsets} of array {spec.array!r} got more than its {len(buf)} bytes"
            )
        buf[self.filled : self.filled + size] = chunk
        self.filled += size

    def complete(self) -> bool:
        """Whether the box has all its bytes."""
        return self.spec is not None and self.buf is not None and self.filled == len(self.buf)

    def store(self, writer: ShardWriter) -> None:
        """Writes the complete box and gives its buffer back to the budget."""
        spec, buf = self.spec, self.buf
        assert spec is not None and buf is not None
        data = np.frombuffer(buf, dtype=layout._DTYPES[spec.dtype][1])
        self.stored.append(spec)
        self.total += writer.write(spec, data.reshape(spec.shape))
        self.boxes += 1
        self.budget.release(len(buf))
        self.spec, self.buf = None, None

    def check_ended(self) -> None:
        """At the end of the stream: refuses one that ended inside a box."""
        if self.spec is not None and self.buf is not None:
            raise InvalidRequestError(
                f"stream ended inside box {self.spec.offsets} of array {self.spec.array!r} "
                f"({self.filled} of {len(self.buf)} bytes)"
            )

    def where(self) -> str:
        """Where the stream stood, for the message of one that stalled."""
        if self.spec is not None and self.buf is not None:
            return (
                f"inside box {self.spec.offsets} of array {self.spec.array!r} "
                f"({self.filled} of {len(self.buf)} bytes)"
            )
        return f"after {self.boxes} complete boxes"

    def release(self) -> None:
        """Gives back the budget of a box left unfinished (the stream failed or stopped)."""
        if self.buf is not None:
            self.budget.release(len(self.buf))
