"""The checkpoint service's bounds on what a client chooses, checked before anything is allocated
for it: the defaults of its limits (`ckpt serve` flags), the in-flight byte budget every
WriteShards and ReadSlice stream draws its buffers from (`ByteBudget`: a stream waits for room
rather than growing memory, and stops waiting when its caller goes), and the checks of a request's
fields (a step, a save id, a box's shape and shard grid) that answer INVALID_ARGUMENT naming the
field that is wrong.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import MAX_NDIM, ShardSpec
from meshtrain.services.checkpoint.multiwriter import check_save_id
from meshtrain.services.common.errors import CheckpointError, InvalidRequestError
from meshtrain.services.common.sanitize import check_text

# Defaults of the service's bounds (`ckpt serve` flags).
MAX_WRITERS = 65536  # --max-writers: writers of one save (ranks of a run)
MAX_COMMIT_TIMEOUT = 3600.0  # --max-commit-timeout: seconds a Commit may ask to wait
MAX_COMMITS = 4  # --max-commits: Commits waiting at once (below grpc_server.UNARY_RESERVE)
MAX_METADATA_BYTES = 1 << 20  # a commit's user metadata, stored in the manifest
MAX_REASON_CHARS = 1000  # an AbortSave reason or a writer's error, quoted in refusals


def check_step(step: int, field_name: str = "step") -> int:
    if step < 0:
        raise InvalidRequestError(f"{field_name}={step} must be >= 0")
    return int(step)


def check_request_save_id(value: str) -> str:
    """A request's save id, checked (INVALID_ARGUMENT naming it otherwise)."""
    try:
        return check_save_id(value)
    except CheckpointError as e:
        raise InvalidRequestError(str(e)) from None


class ByteBudget:
    """Bytes of box data the service may hold at once, shared by all streams.

    Args:
        limit: the cap in bytes.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, what: str, is_active: Callable[[], bool] = lambda: True) -> None:
        """Waits until `nbytes` fit under the cap, then takes them.

        Args:
            nbytes: bytes to take.
            what: for messages.
            is_active: the RPC's `context.is_active`: a caller that has gone away (cancelled,
                past its deadline) stops waiting instead of holding its thread and RPC slot.

        Raises:
            InvalidRequestError: `nbytes` can never fit.
            CheckpointError: the caller went away while waiting.
        """
        if nbytes > self.limit:  # a size the client chose
            raise InvalidRequestError(
                f"{what} is {nbytes} bytes, over the service's in-flight limit of {self.limit}; "
                "use smaller boxes or start the service with a larger --max-inflight-mb"
            )
        with self._cond:
            while not self._cond.wait_for(lambda: self.used + nbytes <= self.limit, timeout=0.5):
                if not is_active():
                    raise CheckpointError(
                        f"{what}: the caller went away while waiting for "
                        f"{nbytes} bytes of the in-flight budget"
                    )
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


def box_from_pb(box: pb.Box, max_shard_bytes: int | None = None) -> ShardSpec:
    """A protobuf Box -> ShardSpec, validated (InvalidRequestError naming what is wrong): its
    fields bounded before anything is computed from them, the box inside its array, its shard
    grid consistent with the array and, with `max_shard_bytes`, no larger than that (a shard
    is what encoding an edge box allocates, and what the array's other boxes are)."""
    check_text(box.array, "box.array", 255, InvalidRequestError)
    check_text(box.dtype, "box.dtype", 16, InvalidRequestError)
    for name in ("global_shape", "offsets", "shape", "grid"):
        if len(getattr(box, name)) > MAX_NDIM:
            raise InvalidRequestError(
                f"box.{name} of array {box.array!r} has {len(getattr(box, name))} dims, "
                f"over the limit of {MAX_NDIM}"
            )
    try:
        spec = ShardSpec(
            box.array,
            tuple(box.global_shape),
            box.dtype,
            tuple(box.offsets),
            tuple(box.shape),
            grid=tuple(box.grid) or None,
            stacked=box.stacked if box.HasField("stacked") else None,
        )
    except CheckpointError as e:
        raise InvalidRequestError(str(e)) from None
    if max_shard_bytes is not None:
        shard = (
            math.prod(max(1, g) for g in spec.grid_shape) * layout._DTYPES[spec.dtype][1].itemsize
        )
        if shard > max_shard_bytes:
            raise InvalidRequestError(
                f"box.grid {spec.grid_shape} of array {spec.array!r} makes {shard}-byte shards, "
                f"over the service's in-flight limit of {max_shard_bytes} bytes "
                "(--max-inflight-mb): no box of such a grid could be taken"
            )
    return spec
