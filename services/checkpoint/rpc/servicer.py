"""The CheckpointService servicer: protobuf in, core library call, protobuf out.

Writers stream boxes to `WriteShards`; each box is assembled in a buffer of exactly its size
(a chunk beyond it, or a chunk over the chunk limit, is an error) and stored as soon as it is
complete, so the service holds at most the boxes in flight. `ByteBudget` caps that total over
all streams: a stream waits for room instead of growing memory. A stream that sends nothing for
`stream_idle_timeout` seconds (a live writer that stalled) is aborted and its share freed, so
it cannot keep the other writers waiting. Saves in progress live in a
table keyed by save id; a restarted service has forgotten them, and their writers and
committer get NOT_FOUND, upon which they ResumeSave: the service takes the save up again if the
step's folder still belongs to it (`sharded.resume_save`), and the writers resend their boxes
(the previous checkpoint is untouched either way). BeginSave and ResumeSave run one at a time,
so a save is never resumed beside a newer save of its step. A failing
run gives its save up with AbortSave: its commit, under way or to come, stops waiting for
writers that have not reported (a save whose writers all reported is still committed), so the
committer is not held for the commit timeout by a dead writer.

A Commit refused for a definite reason (a CheckpointError: a writer's error, a timeout, holes)
ends its save, and every later call of that save id gets that reason back. A Commit that
failed any other way (storage or network trouble) keeps its save: the client retries such a
failure, and the retry reaches `commit` again, which finishes the save or, when the first
attempt's manifest did land, recognises its own commit and returns its result. Saves that
ended are remembered (boundedly), so a late call of one is told what happened to it, not that
its id is unknown.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.protos.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.maintenance import apply_retention, delete_checkpoint
from meshtrain.services.checkpoint.reader import (
    box_entry,
    list_checkpoints,
    read_box,
    read_manifest,
)
from meshtrain.services.checkpoint.sharded import (
    SaveResult,
    ShardWriter,
    begin_save,
    check_save_id,
    commit,
    committed_by,
    resume_save,
)
from meshtrain.services.checkpoint.shards import ShardSpec
from meshtrain.services.common.errors import (
    CheckpointError,
    StorageUnavailableError,
    is_lasting_storage_error,
    is_storage_error,
)
from meshtrain.services.common.grpc_utils import StreamIdleError, status_details, until_idle

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CheckpointService"].full_name
log = logging.getLogger("meshtrain.checkpoint")


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
            CheckpointError: `nbytes` can never fit, or the caller went away while waiting.
        """
        if nbytes > self.limit:
            raise CheckpointError(
                f"{what} is {nbytes} bytes, over the service's in-flight limit of {self.limit}; "
                "use smaller boxes or start the service with a larger --max-inflight-mb"
            )
        with self._cond:
            while not self._cond.wait_for(lambda: self.used + nbytes <= self.limit, timeout=0.5):
                if not is_active():
                    raise CheckpointError(f"{what}: the caller went away while waiting for "
                                          f"{nbytes} bytes of the in-flight budget")
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


def storage_unavailable(root: str) -> Callable[[Exception], StorageUnavailableError | None]:
    """The servicer's error translation: an exception of its storage (an OSError, botocore's
    own) becomes a StorageUnavailableError naming the root and the path (UNAVAILABLE: clients
    retry it); anything else is left a bug (UNKNOWN, which clients do not retry)."""

    def translate(exc: Exception) -> StorageUnavailableError | None:
        if not is_storage_error(exc):
            return None
        return StorageUnavailableError(f"checkpoint storage {root} failed: {type(exc).__name__}: {exc}",
                                       lasting=is_lasting_storage_error(exc))

    return translate


def _commit_response(result: SaveResult) -> pb.CommitResponse:
    return pb.CommitResponse(url=result.url, step=result.step, num_arrays=result.num_arrays,
                             num_objects=result.num_objects, bytes_written=result.bytes_written,
                             seconds=result.seconds)


@dataclass(eq=False)
class _Save:
    step: int
    num_writers: int
    started: float = field(default_factory=time.monotonic)
    commit_lock: threading.Lock = field(default_factory=threading.Lock)
    abort_reason: str | None = None  # AbortSave's: its commit stops waiting for writers


def box_from_pb(box: pb.Box) -> ShardSpec:
    """A protobuf Box -> ShardSpec (validated)."""
    return ShardSpec(
        box.array, tuple(box.global_shape), box.dtype, tuple(box.offsets), tuple(box.shape),
        grid=tuple(box.grid) or None, stacked=box.stacked if box.HasField("stacked") else None,
    )


class CheckpointServicer(pb_grpc.CheckpointServiceServicer):
    """Serves one checkpoint root.

    Args:
        root: root URL every request refers to.
        commit_timeout: seconds a commit waits for writers when the request gives none.
        max_chunk_bytes: largest data chunk accepted or sent.
        max_inflight_bytes: cap on box bytes held in memory over all streams.
        stream_idle_timeout: seconds a WriteShards stream may send nothing before it is
            aborted (ABORTED, which the writer retries) and its box's budget freed; 0: never.
    """

    def __init__(self, root: str, commit_timeout: float = 600.0, max_chunk_bytes: int = 4 << 20,
                 max_inflight_bytes: int = 1 << 30, stream_idle_timeout: float = 120.0):
        self.root = root
        self.commit_timeout = commit_timeout
        self.stream_idle_timeout = stream_idle_timeout
        self.max_chunk_bytes = max_chunk_bytes
        self.budget = ByteBudget(max_inflight_bytes)
        self._saves: dict[str, _Save] = {}
        # Saves that ended, bounded: a retried Commit of a committed save gets its result again,
        # and a late write or commit of a save that ended otherwise a refusal naming why.
        self._committed: OrderedDict[str, _Save] = OrderedDict()
        self._ended: OrderedDict[str, tuple[int, str]] = OrderedDict()  # id -> (step, why)
        self._lock = threading.Lock()
        # BeginSave and ResumeSave one at a time: a resume that checked the step's folder must
        # not register its save beside a newer BeginSave of the step clearing that folder
        self._begin_lock = threading.Lock()

    def _save(self, save_id: str, context) -> _Save:
        """The save in progress of `save_id`; otherwise aborts the RPC saying what became of it."""
        with self._lock:
            save = self._saves.get(save_id)
            committed = self._committed.get(save_id)
            ended = self._ended.get(save_id)
        if save is None:
            # each text fits a status (`why` may quote a writer's error of any length): a longer
            # one broke the trailers, and the client got RESOURCE_EXHAUSTED, which it retries
            if committed is not None:
                # e.g. a writer retrying a stream whose reply was lost: the commit needed its
                # fragment, so its first attempt was stored
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"save {save_id!r} of step {committed.step} is already committed; "
                              "it takes no more writes")
            if ended is not None:
                step, why = ended
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, status_details(
                              f"save {save_id!r} of step {step} {why}; its writes and commits are "
                              "refused (begin a new save)"))
            context.abort(grpc.StatusCode.NOT_FOUND, status_details(
                          f"unknown save id {save_id!r}: call BeginSave first, or ResumeSave for a "
                          "save begun before this service restarted (it forgets saves in progress)"))
        return save

    @staticmethod
    def _remember(table: OrderedDict, key, value, limit: int = 256) -> None:
        table[key] = value
        while len(table) > limit:
            table.popitem(last=False)

    def _busy(self, step: int) -> bool:
        """Whether a save of `step` is in progress (call with the lock held)."""
        self._expire()
        return any(s.step == step for s in self._saves.values())

    def _expire(self) -> None:
        """Forget saves begun longer ago than twice the commit timeout, and never committed
        (their trainer died): their steps are no longer busy, so retention collects the
        leftovers, and late writes are refused (call with the lock held)."""
        limit = time.monotonic() - 2 * self.commit_timeout
        for save_id in [k for k, v in self._saves.items() if v.started < limit and not v.commit_lock.locked()]:
            save = self._saves.pop(save_id)
            self._remember(self._ended, save_id,
                           (save.step, f"was abandoned (no commit within {2 * self.commit_timeout:g} s)"))
            log.warning("save %s of step %d abandoned (no commit within %.0f s); forgotten",
                        save_id, save.step, 2 * self.commit_timeout)

    def BeginSave(self, request, context):
        if request.num_writers < 1:
            raise CheckpointError(f"num_writers must be >= 1, got {request.num_writers}")
        with self._begin_lock:
            return self._begin(request)

    def _begin(self, request) -> pb.BeginSaveResponse:
        with self._lock:
            # A newer save of a step replaces an older one still open (a trainer restarted
            # mid-save): the old id's writes and commit are refused from now on, so its late
            # writers cannot mix their boxes into the new save's.
            old = [(k, v) for k, v in self._saves.items() if v.step == request.step]
            for old_id, _ in old:
                del self._saves[old_id]
                self._remember(self._ended, old_id,
                               (request.step, "was superseded by a newer BeginSave of the same step"))
                log.warning("save %s of step %d superseded by a newer BeginSave", old_id, request.step)
        for _, save in old:
            # A commit of an old save under way must not run beside the folder's removal below
            # (it wrote a manifest over shards just deleted: a committed, broken checkpoint).
            # Superseded, it stops at its next look for fragments, or it is already writing its
            # metadata and finishes: then the step is committed and begin_save treats it so.
            with save.commit_lock:
                pass
        save_id = begin_save(self.root, request.step, overwrite=request.overwrite, resumable=True)
        with self._lock:
            self._saves[save_id] = _Save(request.step, request.num_writers)
        return pb.BeginSaveResponse(save_id=save_id)

    def ResumeSave(self, request, context):
        save_id = check_save_id(request.save_id)
        if request.num_writers < 1:
            raise CheckpointError(f"num_writers must be >= 1, got {request.num_writers}")
        with self._begin_lock:
            with self._lock:
                if save_id in self._saves:  # another writer of the save resumed it already
                    return pb.ResumeSaveResponse(committed=False)
                if save_id in self._committed:
                    return pb.ResumeSaveResponse(committed=True)
                ended = save_id in self._ended
                other = [k for k, v in self._saves.items() if v.step == request.step]
            if ended:
                self._save(save_id, context)  # aborts, saying why it ended
            if other:
                raise CheckpointError(f"save {save_id} of step {request.step} cannot be resumed: save "
                                      f"{other[0]} of that step has begun since; begin a new save")
            if resume_save(self.root, request.step, save_id) is not None:
                return pb.ResumeSaveResponse(committed=True)
            with self._lock:
                self._saves[save_id] = _Save(request.step, request.num_writers)
        log.warning("save %s of step %d resumed (begun before this service started); its writers resend "
                    "their boxes", save_id, request.step)
        return pb.ResumeSaveResponse(committed=False)

    def WriteShards(self, request_iterator, context):
        request_iterator = until_idle(request_iterator, self.stream_idle_timeout)
        try:
            first = next(request_iterator, None)
        except StreamIdleError as e:
            context.abort(grpc.StatusCode.ABORTED, f"a WriteShards stream sent no header for {e.idle_s:g} s "
                          "(the service's --stream-idle-timeout); aborted")
        if first is None or first.WhichOneof("part") != "header":
            raise CheckpointError("a WriteShards stream must start with a header")
        save_id = check_save_id(first.header.save_id)
        save = self._save(save_id, context)
        writer = ShardWriter(self.root, save.step, save_id, first.header.writer_id,
                             save.num_writers)
        boxes = total = 0
        spec, buf, filled = None, None, 0
        try:
            for msg in request_iterator:
                kind = msg.WhichOneof("part")
                if kind == "box":
                    if spec is not None:
                        raise CheckpointError(
                            f"box {spec.offsets} of array {spec.array!r} ended after {filled} of "
                            f"{len(buf)} bytes")
                    spec = box_from_pb(msg.box)
                    nbytes = math.prod(spec.shape) * layout._DTYPES[spec.dtype][1].itemsize
                    self.budget.acquire(nbytes, f"box {spec.offsets} of array {spec.array!r}", context.is_active)
                    buf, filled = bytearray(nbytes), 0
                elif kind == "chunk":
                    if spec is None:
                        raise CheckpointError("a data chunk arrived before any box")
                    size = len(msg.chunk)
                    if size > self.max_chunk_bytes:
                        raise CheckpointError(
                            f"chunk of {size} bytes for array {spec.array!r} is over the limit "
                            f"of {self.max_chunk_bytes} bytes")
                    if filled + size > len(buf):
                        raise CheckpointError(
                            f"box {spec.offsets} of array {spec.array!r} got more than its "
                            f"{len(buf)} bytes")
                    buf[filled:filled + size] = msg.chunk
                    filled += size
                elif kind == "error":  # an empty text must still fail the save
                    writer.finish(error=msg.error or f"writer {first.header.writer_id} reported an error")
                    return pb.WriteShardsResponse(boxes=boxes, bytes=total)
                else:
                    raise CheckpointError(f"unexpected {kind!r} message inside a WriteShards stream")
                if spec is not None and filled == len(buf):
                    self._save(save_id, context)  # still this step's save (not superseded)
                    stored = np.frombuffer(buf, dtype=layout._DTYPES[spec.dtype][1])
                    total += writer.write(spec, stored.reshape(spec.shape))
                    boxes += 1
                    self.budget.release(len(buf))
                    spec, buf = None, None
            if spec is not None:
                raise CheckpointError(
                    f"stream ended inside box {spec.offsets} of array {spec.array!r} "
                    f"({filled} of {len(buf)} bytes)")
        except StreamIdleError as e:
            where = (f"inside box {spec.offsets} of array {spec.array!r} ({filled} of {len(buf)} bytes)"
                     if spec is not None else f"after {boxes} complete boxes")
            message = (f"save {save_id!r} (step {save.step}): writer {first.header.writer_id} sent nothing "
                       f"for {e.idle_s:g} s {where} (the service's --stream-idle-timeout); its stream is "
                       "aborted and its share of the in-flight budget freed")
            log.warning("%s", message)
            context.abort(grpc.StatusCode.ABORTED, status_details(message))
        finally:
            if buf is not None:
                self.budget.release(len(buf))
        self._save(save_id, context)  # a superseded save's fragment must not be stored either
        writer.finish()
        return pb.WriteShardsResponse(boxes=boxes, bytes=total)

    def Commit(self, request, context):
        save_id = check_save_id(request.save_id)
        with self._lock:  # a committed save stays known, so a retried Commit reaches `commit` again
            save = self._saves.get(save_id) or self._committed.get(save_id)
        if save is None and request.step > 0:
            # A restart forgot the save; its commit may have landed before the reply reached
            # the client, whose retry this is: the manifest, which records the save id, says so.
            done = committed_by(self.root, request.step, save_id)
            if done is not None:
                return _commit_response(done)
        if save is None:
            save = self._save(save_id, context)  # aborts, saying why
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            # NaN never passed the deadline: the commit waited forever for a missing writer,
            # holding a thread and keeping the save from expiring
            raise CheckpointError(f"commit timeout_s must be a finite number of seconds >= 0 "
                                  f"(0: the service's default), got {request.timeout_s!r}")
        try:
            metadata = json.loads(request.metadata_json or "{}")
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise CheckpointError(f"commit metadata is not JSON: {e}") from e
        if not isinstance(metadata, dict):  # readers look keys up in it
            raise CheckpointError(f"commit metadata must be a JSON object, got {type(metadata).__name__}: "
                                  f"{request.metadata_json[:100]!r}")
        with save.commit_lock:  # a second Commit of this save (a client retrying) waits for the first
            with self._lock:
                current = save_id in self._saves or save_id in self._committed
            if not current:  # superseded while this call waited for the lock
                self._save(save_id, context)  # aborts, saying why
            try:
                # `commit` returns the result again for a step this save already committed
                result = commit(self.root, save.step, save_id, save.num_writers, metadata,
                                timeout=request.timeout_s or self.commit_timeout,
                                cancelled=lambda: save.abort_reason if save_id in self._saves
                                else "its save was superseded by a newer BeginSave")
            except CheckpointError as e:
                # A definite refusal: trying again cannot help, so the save ends here, and a
                # later call of it (a retry whose first reply was lost) gets this cause.
                with self._lock:
                    if self._saves.pop(save_id, None) is not None:
                        self._remember(self._ended, save_id, (save.step, f"failed to commit: {e}"))
                raise
            except Exception as e:
                # Storage or network trouble: the client retries it, so the save stays and the
                # retry reaches `commit` again (the manifest may even have landed already).
                log.warning("commit of save %s (step %d) failed, kept for a retry: %r",
                            save_id, save.step, e)
                raise
            with self._lock:  # one step: a retry finds the save in one table or the other
                self._remember(self._committed, save_id, save)
                self._saves.pop(save_id, None)
        return _commit_response(result)

    def AbortSave(self, request, context):
        save_id = check_save_id(request.save_id)
        reason = request.reason or "its client aborted it"
        with self._lock:
            save = self._saves.get(save_id)
            if save is None:  # committed, ended already, or unknown (a restarted service)
                return pb.AbortSaveResponse(aborted=False)
            save.abort_reason = reason
        log.warning("save %s of step %d given up: %s", save_id, save.step, reason)
        # A commit under way sees the reason at its next look for fragments, and one that comes
        # later at its first: it commits the save if every writer has reported, else ends it at
        # once (as a trainer's own commit does when its run fails). Waiting for one under way
        # means the step is settled, one way or the other, when this returns.
        with save.commit_lock, self._lock:
            committed = save_id in self._committed
        return pb.AbortSaveResponse(aborted=not committed)

    def List(self, request, context):
        return pb.ListResponse(steps=list_checkpoints(self.root))

    def Describe(self, request, context):
        return pb.DescribeResponse(manifest_json=json.dumps(read_manifest(self.root, request.step)))

    def ReadSlice(self, request, context):
        shape, offsets = tuple(request.shape), tuple(request.offsets)
        manifest = read_manifest(self.root, request.step)
        # the request is checked before it is priced: an unknown array or a box outside it is
        # the error to report, not the budget its claimed shape would exceed
        entry = box_entry(self.root, request.step, manifest, request.array, offsets, shape)
        nbytes = math.prod(shape) * np.dtype(entry["stored_dtype"]).itemsize
        self.budget.acquire(nbytes, f"slice {shape} of array {request.array!r}", context.is_active)
        try:
            tensor = read_box(self.root, request.step, request.array, offsets, shape, manifest)
            data = layout.to_stored(tensor).reshape(-1).view(np.uint8)  # (nbytes,)
            yield pb.ReadSliceResponse(dtype=layout.dtype_name(tensor.dtype), shape=shape)
            for start in range(0, len(data), self.max_chunk_bytes):
                yield pb.ReadSliceResponse(chunk=data[start:start + self.max_chunk_bytes].tobytes())
        finally:
            self.budget.release(nbytes)

    def Delete(self, request, context):
        with self._lock:  # held while deleting: no save of the step can begin meanwhile
            if self._busy(request.step):
                raise CheckpointError(f"step {request.step} is being saved; delete it after its commit")
            return pb.DeleteResponse(deleted=delete_checkpoint(self.root, request.step))

    def ApplyRetention(self, request, context):
        with self._lock:
            self._expire()
            busy = [s.step for s in self._saves.values()]
        result = apply_retention(self.root, request.keep_last, request.keep_every, busy, guard=self._guard)
        return pb.RetentionResponse(deleted=result.deleted, collected=result.collected)

    @contextlib.contextmanager
    def _guard(self, step: int):
        """For retention's collection of a leftover: yields whether `step` is being saved,
        holding the lock so that no save of it begins while its folder is removed."""
        with self._lock:
            yield self._busy(step)
