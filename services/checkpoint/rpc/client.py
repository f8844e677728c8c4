"""Client of the checkpoint service; returns domain objects, raises CheckpointError (the
request was refused), SaveForgottenError (a CheckpointError: the service restarted and forgot
the save; `resume_save` takes it up again) or ServiceUnavailableError (transient: worth a retry).

`CheckpointClient` is also a sink for `AsyncSaver` (same `writer()` / `commit()` as
`StorageSink`), so the trainer's async save code is the same with or without the service:

    client = CheckpointClient("127.0.0.1:50051")
    saver = AsyncSaver(client, writer_id=rank, num_writers=world)
    saver.save(step, save_id, boxes, committer=(rank == 0), metadata=meta)

The address may name several replicas of the service (`host:port,host:port`, a list, or
`dns:///name:port`; see `replicas.py`): writers are spread over them by writer id, a save's
commit goes to the replica its save id picks, and a call that a replica fails as unavailable (it
died, it is at its limits) is tried on the next replica at once; a replica that had not seen the
save adopts it from storage. With `direct_root`, the direct data plane: the service grants each
save (BeginSave, which also checks that it saves into that same root) and commits it, while
every writer stores its boxes and fragment straight into the root (`ShardWriter`), so the
service is not the path of the bytes.

A service that authenticates callers or serves TLS takes a `ClientSecurity` (the token to send,
the CA that verifies the service, a client certificate); without one, $MESHTRAIN_TOKEN is sent
if set. A refused token is a CheckpointError (UNAUTHENTICATED or PERMISSION_DENIED), never retried.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Self

import grpc
import numpy as np
import torch

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.protos.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.maintenance import RetentionResult
from meshtrain.services.checkpoint.multiwriter import SaveResult, ShardWriter
from meshtrain.services.checkpoint.rpc.replicas import Replicas
from meshtrain.services.checkpoint.store import open_root, same_root
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import CheckpointError, MeshtrainError, SaveForgottenError
from meshtrain.services.common.grpc_utils import (
    MAX_MESSAGE_BYTES,
    channel_options,
    is_lasting,
    is_permanent,
)


def box_to_pb(spec: ShardSpec) -> pb.Box:
    """ShardSpec -> protobuf Box."""
    box = pb.Box(
        array=spec.array,
        global_shape=spec.global_shape,
        dtype=spec.dtype,
        offsets=spec.offsets,
        shape=spec.shape,
        grid=spec.grid or (),
    )
    if spec.stacked is not None:
        box.stacked = spec.stacked
    return box


class ServiceUnavailableError(MeshtrainError):
    """The checkpoint service could not do it now (unreachable, at its stream limit, past the
    deadline, its storage failed): not a CheckpointError, so AsyncSaver's retry tries again,
    as it does for I/O errors of direct storage. `lasting`: the service marked its storage's
    failure as one that recurs on every try (`is_lasting_storage_error`)."""

    def __init__(self, message: str, lasting: bool = False):
        super().__init__(message)
        self.lasting = lasting


def _error(address: str, what: str, e: grpc.RpcError) -> MeshtrainError:
    """The domain error for a failed call: ServiceUnavailableError when worth a retry; a
    CheckpointError, never retried, for a refusal or a bug in the service's handler (another
    try fails the same way, after repeating the handler's side effects). It names the service's
    address: gRPC's own text often does not ("Stream removed (ping timeout)", "Deadline
    Exceeded")."""
    message = f"checkpoint service {address} {what}: {e.code().name}: {e.details()}"
    if e.code() == grpc.StatusCode.NOT_FOUND:  # the service's answer to a save id it does not know
        return SaveForgottenError(message)
    if is_permanent(e):
        return CheckpointError(message)
    return ServiceUnavailableError(message, lasting=is_lasting(e))


class RemoteWriter:
    """One writer's boxes for one save, sent in one WriteShards stream by `finish()`.

    Boxes are only referenced until then (the caller's snapshot buffers stay alive anyway),
    so sending costs no copy beyond gRPC's own; a failed stream is resent whole by a retry,
    which is safe because storing a box again replaces it.
    """

    def __init__(
        self, client: CheckpointClient, save_id: str, writer_id: int, step: int | None = None
    ):
        self.client = client
        self.save_id = save_id
        self.writer_id = writer_id
        self.step = step  # sent in the header: a replica that did not see BeginSave adopts the save
        self.boxes: dict[tuple[str, tuple[int, ...]], tuple[ShardSpec, np.ndarray]] = {}

    def write(self, spec: ShardSpec, data: np.ndarray | torch.Tensor) -> int:
        """Queues one box (stored dtype numpy array, or a tensor of the box's dtype)."""
        data = layout.as_stored(
            data, spec.dtype, f"box {spec.offsets}+{spec.shape} of array {spec.array!r}"
        )
        if tuple(data.shape) != spec.shape:
            raise CheckpointError(
                f"box {spec.offsets}+{spec.shape} of array {spec.array!r} got data of shape "
                f"{tuple(data.shape)}"
            )
        self.boxes[(spec.array, spec.offsets)] = (spec, data)
        return data.nbytes

    def _messages(self, error: str | None) -> Iterator[pb.WriteShardsRequest]:
        yield pb.WriteShardsRequest(
            header=pb.WriteHeader(save_id=self.save_id, writer_id=self.writer_id, step=self.step)
        )
        if error is not None:
            yield pb.WriteShardsRequest(error=error)
            return
        step = self.client.chunk_bytes
        for spec, data in self.boxes.values():
            yield pb.WriteShardsRequest(box=box_to_pb(spec))
            flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # (nbytes,)
            for start in range(0, flat.size, step):
                yield pb.WriteShardsRequest(chunk=flat[start : start + step].tobytes())

    def finish(self, error: str | None = None) -> None:
        """Streams every queued box (or only the error) and stores the fragment."""
        self.client._call(
            f"WriteShards (writer {self.writer_id})",
            "WriteShards",
            lambda: self._messages(error),
            key=self.writer_id,
            save_id=self.save_id,
        )


class CheckpointClient:
    """Talks to a CheckpointService: one process, or several replicas serving one root.

    Args:
        address: "host:port", several separated by commas (or a list), or "dns:///name:port".
        chunk_bytes: data bytes per message (must not exceed the server's chunk limit).
        security: token and TLS settings (None: plaintext, $MESHTRAIN_TOKEN if set).
        direct_root: the root the service saves into: writers store their boxes there
            themselves (the direct data plane) instead of streaming them to the service.
        down_s: how long a replica that failed a call is tried last.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        chunk_bytes: int = 4 << 20,
        security: ClientSecurity | None = None,
        direct_root: str | None = None,
        down_s: float = 5.0,
    ):
        self.address = address if isinstance(address, str) else ",".join(address)
        self.chunk_bytes = chunk_bytes
        security = security if security is not None else ClientSecurity.from_files()
        options = channel_options(max(2 * chunk_bytes, MAX_MESSAGE_BYTES)) + [
            # Receive what any server sends: its --max-chunk-mb may be larger than ours (above).
            # Reconnect to a restarted service within a second: gRPC's default backoff grows
            # to 120 s, and calls fail at once meanwhile, so a save retrying through a 30 s
            # restart found the service back only ~15 s after it was.
            # (Not grpc.min_reconnect_backoff_ms: it is also the connect timeout, 20 s.)
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.replicas = Replicas(
            address, lambda target: security.channel(target, options), down_s=down_s
        )
        self.direct_root = direct_root
        self._direct = open_root(direct_root) if direct_root else None
        self._forgotten: dict[str, str] = {}  # save id -> the replica that answered it unknown

    @property
    def stub(self) -> pb_grpc.CheckpointServiceStub:
        """The first replica's stub (for calls made by hand)."""
        return self.replicas.stub(self.replicas.order(0)[0])

    @property
    def channel(self) -> grpc.Channel:
        """The first replica's channel (to wait until it is ready, say)."""
        return self.replicas.channel(self.replicas.order(0)[0])

    def _call(
        self,
        what: str,
        method: str,
        request: Callable[[], object],
        key: int | str = 0,
        save_id: str | None = None,
        prefer: str | None = None,
        **kwargs,
    ):
        """Calls `method` on the replica `key` picks; on a failure worth a retry, on the next
        replica at once (each tried once). Raises the domain error of the last failure."""
        targets = self.replicas.order(key, prefer)
        for i, target in enumerate(targets):
            try:
                return getattr(self.replicas.stub(target), method)(request(), **kwargs)
            except grpc.RpcError as e:
                error = _error(target, what, e)
                if isinstance(error, SaveForgottenError) and save_id is not None:
                    self._forgotten[save_id] = target  # its ResumeSave goes there
                if (
                    not isinstance(error, ServiceUnavailableError)
                    or e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                ):
                    raise error from e
                if len(targets) > 1:
                    self.replicas.mark_down(target)
                if i == len(targets) - 1:
                    raise error from e

    def begin_save(self, step: int, num_writers: int = 1, overwrite: bool = False) -> str:
        """Starts a save of `step` by `num_writers` writers; returns its save id.

        Raises:
            CheckpointError: refused, or (direct data plane) the service saves into another root.
        """
        request = pb.BeginSaveRequest(step=step, num_writers=num_writers, overwrite=overwrite)
        response = self._call("BeginSave", "BeginSave", lambda: request, key=step)
        if self.direct_root is not None and not (
            response.root and same_root(response.root, self.direct_root)
        ):
            raise CheckpointError(
                f"checkpoint service {self.address} saves into "
                f"{response.root or 'a root it does not name'!r}, not {self.direct_root!r}: "
                "writers of the direct data plane must write where it commits (set the trainer's "
                "checkpoint.save to the service's root)"
            )
        return response.save_id

    def resume_save(self, step: int, save_id: str, num_writers: int) -> bool:
        """Takes a save up again on a replica that does not know it (it restarted since
        `begin_save`; its writes and commit got SaveForgottenError); each writer of the save
        may call it, the first one counts. It goes to the replica that forgot the save.

        Returns:
            True when the save had committed already (nothing to resend), else False: send the
            writer's boxes again and commit.

        Raises:
            CheckpointError: the save cannot be resumed (a newer save of the step began, ...).
        """
        request = pb.ResumeSaveRequest(save_id=save_id, step=step, num_writers=num_writers)
        return self._call(
            f"ResumeSave of step {step}",
            "ResumeSave",
            lambda: request,
            key=save_id,
            prefer=self._forgotten.pop(save_id, None),
        ).committed

    def writer(
        self, step: int, save_id: str, writer_id: int, num_writers: int
    ) -> RemoteWriter | ShardWriter:
        """A writer handle: streams to the replica its writer id picks, or, on the direct data
        plane, stores into the root itself."""
        if self._direct is not None:
            return ShardWriter(self._direct, step, save_id, writer_id, num_writers)
        return RemoteWriter(self, save_id, writer_id, step)

    def commit(
        self,
        step: int,
        save_id: str,
        num_writers: int,
        metadata: dict | None = None,
        timeout: float = 600.0,
    ) -> SaveResult:
        """Commits the save once all writers reported; returns what was committed."""
        # the step lets a replica that does not know the save adopt it, or find its commit
        request = pb.CommitRequest(
            save_id=save_id, metadata_json=json.dumps(metadata or {}), timeout_s=timeout, step=step
        )
        r = self._call(
            "Commit", "Commit", lambda: request, key=save_id, save_id=save_id, timeout=timeout + 60
        )
        return SaveResult(r.url, r.step, r.num_arrays, r.num_objects, r.bytes_written, r.seconds)

    def abort_save(
        self, save_id: str, reason: str = "its client aborted it", timeout: float = 60.0
    ) -> bool:
        """Gives a save up: its commit, under way or to come, stops waiting for writers that
        have not reported (it commits only if all have, else refuses naming `reason`). Asked of
        every replica, since the commit may have moved from the one its save id picks.

        Args:
            save_id: the save.
            reason: why, as a clause ("the run failed"); quoted in the refusals.
            timeout: seconds to wait for the service (it waits for a commit under way to settle).

        Returns:
            True when the save was given up, False when there was nothing to give up (it was
            committed, had ended, or the service does not know it).
        """
        request = pb.AbortSaveRequest(save_id=save_id, reason=reason)
        targets = self.replicas.order(save_id)
        if len(targets) == 1:
            return self._call(
                "AbortSave", "AbortSave", lambda: request, key=save_id, timeout=timeout
            ).aborted
        futures = [
            (t, self.replicas.stub(t).AbortSave.future(request, timeout=timeout)) for t in targets
        ]
        aborted, errors = False, []
        for target, future in futures:
            try:
                aborted |= future.result().aborted
            except grpc.RpcError as e:
                errors.append(_error(target, "AbortSave", e))
        if len(errors) == len(targets):
            raise errors[0]
        return aborted

    def list(self) -> list[int]:
        """Committed steps, ascending."""
        return list(self._call("List", "List", pb.ListRequest).steps)

    def describe(self, step: int) -> dict:
        """The manifest of a committed step."""
        response = self._call("Describe", "Describe", lambda: pb.DescribeRequest(step=step))
        return json.loads(response.manifest_json)

    def read_box(
        self, step: int, array: str, offsets: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Any box of an array (see `reader.read_box`), streamed in chunks."""
        request = pb.ReadSliceRequest(step=step, array=array, offsets=offsets, shape=shape)
        target = self.replicas.order(step)[0]  # a response stream fails when read: no failover
        try:
            responses = self.replicas.stub(target).ReadSlice(request)
        except grpc.RpcError as e:
            raise _error(target, "ReadSlice", e) from e
        try:
            head = next(responses)
            dtype = head.dtype
            if dtype not in layout._DTYPES or tuple(head.shape) != tuple(shape):
                raise CheckpointError(
                    f"ReadSlice of {array!r}: the service answered dtype {dtype!r} shape "
                    f"{tuple(head.shape)} for a {tuple(shape)} box"
                )
            stored = layout._DTYPES[dtype][1]
            buf = bytearray(math.prod(shape) * stored.itemsize)
            filled = 0
            for msg in responses:
                if filled + len(msg.chunk) > len(buf):
                    raise CheckpointError(
                        f"ReadSlice of {array!r} returned more than its {len(buf)} bytes"
                    )
                buf[filled : filled + len(msg.chunk)] = msg.chunk
                filled += len(msg.chunk)
        except grpc.RpcError as e:  # a response stream fails here, not in `_call`
            raise _error(target, "ReadSlice", e) from e
        if filled != len(buf):
            raise CheckpointError(f"ReadSlice of {array!r} returned {filled} of {len(buf)} bytes")
        return layout.from_stored(np.frombuffer(buf, dtype=stored).reshape(shape), dtype)

    def delete(self, step: int) -> bool:
        """Deletes a step; False when there was nothing."""
        return self._call("Delete", "Delete", lambda: pb.DeleteRequest(step=step)).deleted

    def apply_retention(self, keep_last: int, keep_every: int = 0) -> RetentionResult:
        """Keeps the last N and every K-th step; collects uncommitted leftovers."""
        r = self._call(
            "ApplyRetention",
            "ApplyRetention",
            lambda: pb.RetentionRequest(keep_last=keep_last, keep_every=keep_every),
        )
        return RetentionResult(deleted=list(r.deleted), collected=list(r.collected))

    def close(self) -> None:
        self.replicas.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
