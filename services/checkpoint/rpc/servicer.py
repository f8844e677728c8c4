"""The CheckpointService servicer: protobuf in, core library call, protobuf out.

Writers stream boxes to `WriteShards`; each box is assembled in a buffer of exactly its size
(a chunk beyond it, or a chunk over the chunk limit, is an error) and stored as soon as it is
complete, so the service holds at most the boxes in flight (`write_stream.py`). `ByteBudget`
caps that total over all streams: a stream waits for room instead of growing memory. A stream
that sends nothing for `stream_idle_timeout` seconds (a live writer that stalled) is aborted and
its share freed, so it cannot keep the other writers waiting. Saves in progress live in a
table keyed by save id; a restarted service has forgotten them, and their writers and
committer get NOT_FOUND, upon which they ResumeSave: the service takes the save up again if the
step's folder still belongs to it (`multiwriter.resume_save`), and the writers resend their boxes
(the previous checkpoint is untouched either way). BeginSave and ResumeSave run one at a time,
so a save is never resumed beside a newer save of its step. Replicas of the service serving one
root share nothing but storage: a WriteShards whose header names the step, or a Commit, of a save
this replica has not seen adopts it from its marker (`multiwriter.read_begun`: the step's folder
still belongs to that save, and the marker holds its writer count), ending any save of the step
it knew whose marker is gone (a newer save of the step began on another replica); a save's
marker is checked again before each writer's fragment is stored, while its commit waits, and
before the commit writes anything, so a superseded save neither reports nor commits. Which
committer commits is decided by storage (the manifest is created only if absent). A failing
run gives its save up with AbortSave: its commit, under way or to come, stops waiting for
writers that have not reported (a save whose writers all reported is still committed), so the
committer is not held for the commit timeout by a dead writer.

A Commit refused for a definite reason (a CheckpointError: a writer's error, a timeout, holes)
ends its save, and every later call of that save id gets that reason back. A Commit that
failed any other way (storage or network trouble) keeps its save: the client retries such a
failure, and the retry reaches `commit` again, which finishes the save or, when the first
attempt's manifest did land, recognises its own commit and returns its result. The table of
saves, their adoption, expiry and the reclaiming of failed saves' storage are `saves.py`'s.

Every size a client chooses is bounded before anything is allocated for it, and a bad field is
INVALID_ARGUMENT naming it (`limits.py`): `num_writers` (at most `max_writers`), a box's shape
and shard grid (inside the array, a shard no larger than the in-flight limit), strings (names,
save ids, metadata), steps. Waits end when their client goes: a Commit whose client
disconnected stops waiting for writers within a second (its save stays, for the client's retry),
its timeout is capped at `max_commit_timeout`, and at most `max_commits` commits wait at once, so
waiting commits never take the slots health checks need. A ReadSlice whose client takes nothing for
`stream_idle_timeout` seconds is cancelled. On a local root no symlink inside a step folder is
followed: writes open every folder with O_NOFOLLOW, and a commit or a read refuses a step
folder holding one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.protos.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import MAX_NDIM, ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.maintenance import (
    apply_retention,
    delete_checkpoint,
    keep_every_needs_keep_last,
)
from meshtrain.services.checkpoint.multiwriter import (
    SaveResult,
    ShardWriter,
    begin_save,
    committed_by,
    read_begun,
    resume_save,
)
from meshtrain.services.checkpoint.nofollow import refuse_symlinks
from meshtrain.services.checkpoint.reader import (
    box_entry,
    list_checkpoints,
    read_box,
    read_manifest,
)
from meshtrain.services.checkpoint.rpc.limits import (
    MAX_COMMIT_TIMEOUT,
    MAX_COMMITS,
    MAX_METADATA_BYTES,
    MAX_REASON_CHARS,
    MAX_WRITERS,
    ByteBudget,
    check_request_save_id,
    check_step,
)
from meshtrain.services.checkpoint.rpc.saves import Save, SaveTable
from meshtrain.services.checkpoint.rpc.write_stream import BoxStream
from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.common.errors import (
    CheckpointError,
    ConfigError,
    InvalidRequestError,
    is_disk_full,
)
from meshtrain.services.common.grpc_utils import StreamIdleError, status_details, until_idle
from meshtrain.services.common.sanitize import check_text, loggable, quiet_undecodable_requests
from meshtrain.services.common.stream_guards import IdleReaper

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CheckpointService"].full_name
log = logging.getLogger("meshtrain.checkpoint")
MARKER_CHECK_S = (
    2.0  # a waiting commit looks this often whether its save still owns the step's folder
)


class _CallerGone(Exception):
    """The client of a waiting call went away (cancelled, disconnected, past its deadline)."""


def _wait_for(lock: threading.Lock, context) -> None:
    """Acquires `lock`, waiting only while the RPC's client is still there (_CallerGone)."""
    while not lock.acquire(timeout=0.5):
        if not context.is_active():
            raise _CallerGone()


def _commit_response(result: SaveResult) -> pb.CommitResponse:
    return pb.CommitResponse(
        url=result.url,
        step=result.step,
        num_arrays=result.num_arrays,
        num_objects=result.num_objects,
        bytes_written=result.bytes_written,
        seconds=result.seconds,
    )


def _commit_metadata(metadata_json: str) -> dict:
    """A commit's user metadata, parsed (INVALID_ARGUMENT unless it is a JSON object)."""
    try:
        metadata = json.loads(metadata_json or "{}")
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise InvalidRequestError(f"commit metadata_json is not JSON: {e}") from e
    if not isinstance(metadata, dict):  # readers look keys up in it
        raise InvalidRequestError(
            f"commit metadata_json must be a JSON object, got "
            f"{type(metadata).__name__}: {loggable(metadata_json, 100)}"
        )
    return metadata


class CheckpointServicer(SaveTable, pb_grpc.CheckpointServiceServicer):
    """Serves one checkpoint root.

    Args:
        root: root URL every request refers to.
        commit_timeout: seconds a commit waits for writers when the request gives none.
        max_chunk_bytes: largest data chunk accepted or sent.
        max_inflight_bytes: cap on box bytes held in memory over all streams.
        stream_idle_timeout: seconds a WriteShards stream may send nothing before it is
            aborted (ABORTED, which the writer retries) and its box's budget freed, or a
            ReadSlice stream's client may take nothing before it is cancelled; 0: never.
        max_writers: the most writers one save may have.
        max_commit_timeout: the longest a Commit waits for writers, whatever it asks for.
        max_commits: Commits waiting at once; one more is refused with RESOURCE_EXHAUSTED.
    """

    def __init__(
        self,
        root: str,
        commit_timeout: float = 600.0,
        max_chunk_bytes: int = 4 << 20,
        max_inflight_bytes: int = 1 << 30,
        stream_idle_timeout: float = 120.0,
        max_writers: int = MAX_WRITERS,
        max_commit_timeout: float = MAX_COMMIT_TIMEOUT,
        max_commits: int = MAX_COMMITS,
    ):
        quiet_undecodable_requests()
        if max_writers < 1 or max_commits < 1 or not 0 < max_commit_timeout < math.inf:
            raise ConfigError(
                f"--max-writers {max_writers} and --max-commits {max_commits} must be >= 1 and "
                f"--max-commit-timeout {max_commit_timeout} a positive number of seconds"
            )
        SaveTable.__init__(self, root, commit_timeout, max_writers)
        self.max_commit_timeout = max_commit_timeout
        self.max_commits = max_commits
        self._commit_slots = threading.BoundedSemaphore(max_commits)
        self._reaper = IdleReaper(stream_idle_timeout, "--stream-idle-timeout")
        opened = open_root(root)
        self._local_path = opened.path if opened.is_local else None  # where symlinks are refused
        self.stream_idle_timeout = stream_idle_timeout
        self.max_chunk_bytes = max_chunk_bytes
        self.budget = ByteBudget(max_inflight_bytes)

    def _no_symlinks(self, step: int) -> None:
        """On a local root: refuses (CheckpointError) a step folder holding a symlink."""
        if self._local_path is not None:
            refuse_symlinks(self._local_path, open_root(self.root).step_path(step))

    def BeginSave(self, request, context):
        check_step(request.step)
        self._num_writers(request.num_writers)
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
                self._remember(
                    self._ended,
                    old_id,
                    (request.step, "was superseded by a newer BeginSave of the same step"),
                )
                log.warning(
                    "save %s of step %d superseded by a newer BeginSave", old_id, request.step
                )
        for _, save in old:
            # A commit of an old save under way must not run beside the folder's removal below
            # (it wrote a manifest over shards just deleted: a committed, broken checkpoint).
            # Superseded, it stops at its next look for fragments, or it is already writing its
            # metadata and finishes: then the step is committed and begin_save treats it so.
            with save.commit_lock:
                pass
        save_id = begin_save(
            self.root,
            request.step,
            overwrite=request.overwrite,
            resumable=True,
            num_writers=request.num_writers,
        )
        with self._lock:
            self._saves[save_id] = Save(request.step, request.num_writers)
        return pb.BeginSaveResponse(save_id=save_id, root=self.root)

    def ResumeSave(self, request, context):
        save_id = check_request_save_id(request.save_id)
        check_step(request.step)
        self._num_writers(request.num_writers)
        with self._lock:
            if save_id in self._saves:  # another writer of the save resumed it already
                return pb.ResumeSaveResponse(committed=False)
            if save_id in self._committed:
                return pb.ResumeSaveResponse(committed=True)
            ended = save_id in self._ended
            others = [k for k, v in self._saves.items() if v.step == request.step]
        if ended:
            self._save(save_id, context)  # aborts, saying why it ended
        for other in others:  # a save of the step known here, and still owning its folder, is newer
            if read_begun(self.root, request.step, other) is not None:
                raise CheckpointError(
                    f"save {save_id} of step {request.step} cannot be resumed: save {other} of "
                    "that step has begun since; begin a new save"
                )
        # raises, saying why, for a save storage no longer holds
        if resume_save(self.root, request.step, save_id) is not None:
            return pb.ResumeSaveResponse(committed=True)
        if self._adopt(save_id, request.step, request.num_writers) is None:
            raise CheckpointError(
                f"save {save_id} of step {request.step} cannot be resumed: its folder changed "
                "while it was being taken up; begin a new save"
            )
        log.warning(
            "save %s of step %d resumed (begun before this service started, or on another "
            "replica); its writers resend their boxes",
            save_id,
            request.step,
        )
        return pb.ResumeSaveResponse(committed=False)

    def WriteShards(self, request_iterator, context):
        request_iterator = until_idle(request_iterator, self.stream_idle_timeout)
        save_id, save, writer = self._open_stream(request_iterator, context)
        stream = BoxStream(self.budget, self.max_chunk_bytes, context.is_active)
        try:
            for msg in request_iterator:
                kind = msg.WhichOneof("part")
                if kind == "box":
                    stream.begin_box(msg.box)
                elif kind == "chunk":
                    stream.take_chunk(msg.chunk)
                elif kind == "error":  # an empty text must still fail the save
                    self._writer_failed(save_id, save, writer, msg.error)
                    return pb.WriteShardsResponse(boxes=stream.boxes, bytes=stream.total)
                else:
                    raise InvalidRequestError(
                        f"unexpected {kind!r} message inside a WriteShards stream"
                    )
                if stream.complete():
                    self._save(save_id, context)  # still this step's save (not superseded)
                    stream.store(writer)
            stream.check_ended()
        except StreamIdleError as e:
            self._abort_idle(save_id, save, writer, e.idle_s, stream.where(), context)
        except Exception as e:
            if is_disk_full(e):
                self._remove_stored(save_id, save, writer, stream.stored)
            raise
        finally:
            stream.release()
        self._finish_stream(save_id, save, writer, stream.stored, context)
        return pb.WriteShardsResponse(boxes=stream.boxes, bytes=stream.total)

    def _open_stream(self, request_iterator, context) -> tuple[str, Save, ShardWriter]:
        """A WriteShards stream's header, checked: its save (taken up here if the header names
        the step of a save begun elsewhere) and the writer storing what the stream sends."""
        try:
            first = next(request_iterator, None)
        except StreamIdleError as e:
            context.abort(
                grpc.StatusCode.ABORTED,
                f"a WriteShards stream sent no header for {e.idle_s:g} s "
                "(the service's --stream-idle-timeout); aborted",
            )
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidRequestError("a WriteShards stream must start with a header")
        save_id = check_request_save_id(first.header.save_id)
        if first.header.HasField("step"):  # a save begun elsewhere is taken up here
            self._adopt(save_id, check_step(first.header.step, "header.step"))
        save = self._save(save_id, context)
        if first.header.HasField("step") and first.header.step != save.step:
            raise InvalidRequestError(
                f"header.step={first.header.step}, but save {save_id!r} saves step {save.step}"
            )
        if not 0 <= first.header.writer_id < save.num_writers:
            raise InvalidRequestError(
                f"writer_id={first.header.writer_id} is outside [0, {save.num_writers}) "
                f"(save {save_id!r} has {save.num_writers} writers)"
            )
        writer = ShardWriter(
            self.root, save.step, save_id, first.header.writer_id, save.num_writers
        )
        return save_id, save, writer

    def _writer_failed(self, save_id: str, save: Save, writer: ShardWriter, error: str) -> None:
        """A writer's error report: recorded in its fragment, and its save ends."""
        error = error[:MAX_REASON_CHARS]  # quoted in the commit's refusal
        reported = {writer.writer_id: error or f"writer {writer.writer_id} reported an error"}
        try:  # read by a commit waiting on another replica
            writer.finish(error=reported[writer.writer_id])
        finally:  # the save can no longer commit: it ends here, and its objects go
            self._end_failed(save_id, save, f"was aborted: writers reported errors {reported}")

    def _abort_idle(
        self, save_id: str, save: Save, writer: ShardWriter, idle_s: float, where: str, context
    ) -> None:
        """Aborts a stream that sent nothing for the idle timeout (ABORTED: the writer retries)."""
        message = (
            f"save {save_id!r} (step {save.step}): writer {writer.writer_id} sent "
            f"nothing for {idle_s:g} s {where} (the service's --stream-idle-timeout); its "
            "stream is aborted and its share of the in-flight budget freed"
        )
        log.warning("%s", message)
        context.abort(grpc.StatusCode.ABORTED, status_details(message))

    def _finish_stream(
        self, save_id: str, save: Save, writer: ShardWriter, stored: list[ShardSpec], context
    ) -> None:
        """Stores the writer's fragment, once its save is known to be still the step's."""
        self._save(save_id, context)  # a superseded save's fragment must not be stored either
        if read_begun(self.root, save.step, save_id) is None:  # superseded on another replica
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                status_details(
                    f"save {save_id!r} of step {save.step} was superseded (a newer save of the "
                    "step cleared its folder); its writes are refused (begin a new save)"
                ),
            )
        try:
            writer.finish()
        except Exception as e:
            if is_disk_full(e):
                self._remove_stored(save_id, save, writer, stored)
            raise

    def Commit(self, request, context):
        save_id = check_request_save_id(request.save_id)
        check_step(request.step)
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            # NaN never passed the deadline: the commit waited forever for a missing writer,
            # holding a thread and keeping the save from expiring
            raise InvalidRequestError(
                f"commit timeout_s must be a finite number of seconds >= 0 "
                f"(0: the service's default), got {request.timeout_s!r}"
            )
        if len(request.metadata_json) > MAX_METADATA_BYTES:
            raise InvalidRequestError(
                f"commit metadata_json is {len(request.metadata_json)} characters, over "
                f"the limit of {MAX_METADATA_BYTES}"
            )
        if not self._commit_slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"all {self.max_commits} commit slots of this service are in use (--max-commits); "
                "try again",
            )
        try:
            return self._commit(request, save_id, context)
        except _CallerGone:
            log.info("commit of save %s: its client went away; the save stays for a retry", save_id)
            context.abort(
                grpc.StatusCode.CANCELLED, f"the client of the commit of save {save_id!r} went away"
            )
        finally:
            self._commit_slots.release()

    def _commit(self, request, save_id: str, context) -> pb.CommitResponse:
        with self._lock:  # a committed save stays known, so a retried Commit reaches `commit` again
            save = self._saves.get(save_id) or self._committed.get(save_id)
        if save is None:
            # A restart forgot the save (or another replica served it); its commit may have
            # landed before the reply reached the client, whose retry this is: the manifest,
            # which records the save id, says so.
            done = committed_by(self.root, request.step, save_id)
            if done is not None:
                return _commit_response(done)
            save = self._adopt(save_id, request.step)
        if save is None:
            save = self._save(save_id, context)  # aborts, saying why
        metadata = _commit_metadata(request.metadata_json)
        timeout = min(request.timeout_s or self.commit_timeout, self.max_commit_timeout)
        cancelled = self._commit_cancelled(save_id, save, context)
        _wait_for(
            save.commit_lock, context
        )  # a second Commit of this save (a client retrying) waits for the first
        refused = False
        try:
            with self._lock:
                current = save_id in self._saves or save_id in self._committed
            if not current:  # superseded while this call waited for the lock
                self._save(save_id, context)  # aborts, saying why
            try:
                # `commit` returns the result again for a step this save already committed
                result = commit(
                    self.root,
                    save.step,
                    save_id,
                    save.num_writers,
                    metadata,
                    timeout=timeout,
                    cancelled=cancelled,
                    require_marker=True,
                )
            except _CallerGone:  # not the save's fault: it stays, for the client's retry
                raise
            except CheckpointError as e:
                # A definite refusal: trying again cannot help, so the save ends here, and a
                # later call of it (a retry whose first reply was lost) gets this cause.
                with self._lock:
                    if self._saves.pop(save_id, None) is not None:
                        self._remember(self._ended, save_id, (save.step, f"failed to commit: {e}"))
                refused = True
                raise
            except Exception as e:
                # Storage or network trouble: the client retries it, so the save stays and the
                # retry reaches `commit` again (the manifest may even have landed already).
                log.warning(
                    "commit of save %s (step %d) failed, kept for a retry: %r",
                    save_id,
                    save.step,
                    e,
                )
                raise
            with self._lock:  # one step: a retry finds the save in one table or the other
                self._remember(self._committed, save_id, save)
                self._saves.pop(save_id, None)
        finally:
            save.commit_lock.release()
            if refused:  # what the save stored is of no use now, and may be what fills the disk
                self._reclaim(save_id, save)
        return _commit_response(result)

    def _commit_cancelled(self, save_id: str, save: Save, context) -> Callable[[], str | None]:
        """The check a waiting commit makes at each look for fragments: why it stops waiting
        (superseded, its folder taken, AbortSave's reason), or None; _CallerGone when its
        client went away."""
        checked = [time.monotonic()]

        def cancelled() -> str | None:
            if not context.is_active():
                raise _CallerGone()
            if save_id not in self._saves:
                return "its save was superseded by a newer BeginSave"
            if (
                time.monotonic() - checked[0] > MARKER_CHECK_S
            ):  # a newer save of the step, begun elsewhere
                checked[0] = time.monotonic()
                if read_begun(self.root, save.step, save_id) is None:
                    return "its folder was taken by a newer save of the step"
            return save.abort_reason

        return cancelled

    def AbortSave(self, request, context):
        save_id = check_request_save_id(request.save_id)
        reason = request.reason[:MAX_REASON_CHARS] or "its client aborted it"  # quoted in refusals
        with self._lock:
            save = self._saves.get(save_id)
            if save is None:  # committed, ended already, or unknown (a restarted service)
                return pb.AbortSaveResponse(aborted=False)
            save.abort_reason = reason
        log.warning("save %s of step %d given up: %s", save_id, save.step, loggable(reason))
        # A commit under way sees the reason at its next look for fragments, and one that comes
        # later at its first: it commits the save if every writer has reported, else ends it at
        # once (as a trainer's own commit does when its run fails). Waiting for one under way
        # means the step is settled, one way or the other, when this returns.
        try:
            _wait_for(save.commit_lock, context)
        except _CallerGone:
            return pb.AbortSaveResponse(aborted=True)  # nobody reads it
        try:
            with self._lock:
                committed = save_id in self._committed
        finally:
            save.commit_lock.release()
        return pb.AbortSaveResponse(aborted=not committed)

    def List(self, request, context):
        return pb.ListResponse(steps=list_checkpoints(self.root))

    def Describe(self, request, context):
        self._no_symlinks(check_step(request.step))
        return pb.DescribeResponse(manifest_json=json.dumps(read_manifest(self.root, request.step)))

    def ReadSlice(self, request, context):
        check_step(request.step)
        check_text(request.array, "array", 255, InvalidRequestError)
        if len(request.shape) > MAX_NDIM or len(request.offsets) > MAX_NDIM:
            raise InvalidRequestError(
                f"offsets and shape of a slice of {request.array!r} have at most "
                f"{MAX_NDIM} dims, got {len(request.offsets)} and {len(request.shape)}"
            )
        if any(n < 0 for n in request.shape):
            raise InvalidRequestError(
                f"shape {list(request.shape)} of a slice of {request.array!r} must be >= 0"
            )
        self._no_symlinks(request.step)
        yield from self._reaper.watch(
            self._read_slice(request, context),
            context,
            f"ReadSlice of {request.array!r} at step {request.step}",
        )

    def _read_slice(self, request, context):
        shape, offsets = tuple(request.shape), tuple(request.offsets)
        manifest = read_manifest(self.root, request.step)
        # the request is checked before it is priced: an unknown array or a box outside it is
        # the error to report, not the budget its claimed shape would exceed
        try:
            entry = box_entry(self.root, request.step, manifest, request.array, offsets, shape)
        except CheckpointError as e:  # an array the step lacks, a box outside it: the request's
            raise InvalidRequestError(str(e)) from None
        nbytes = math.prod(shape) * np.dtype(entry["stored_dtype"]).itemsize
        self.budget.acquire(nbytes, f"slice {shape} of array {request.array!r}", context.is_active)
        try:
            tensor = read_box(self.root, request.step, request.array, offsets, shape, manifest)
            data = layout.to_stored(tensor).reshape(-1).view(np.uint8)  # (nbytes,)
            yield pb.ReadSliceResponse(dtype=layout.dtype_name(tensor.dtype), shape=shape)
            for start in range(0, len(data), self.max_chunk_bytes):
                yield pb.ReadSliceResponse(
                    chunk=data[start : start + self.max_chunk_bytes].tobytes()
                )
        finally:
            self.budget.release(nbytes)

    def Delete(self, request, context):
        check_step(request.step)
        with self._lock:  # held while deleting: no save of the step can begin meanwhile
            if self._busy(request.step):
                raise CheckpointError(
                    f"step {request.step} is being saved; delete it after its commit"
                )
            return pb.DeleteResponse(deleted=delete_checkpoint(self.root, request.step))

    def ApplyRetention(self, request, context):
        if request.keep_last < 0 or request.keep_every < 0:
            raise InvalidRequestError(
                f"retention keep_last={request.keep_last} keep_every={request.keep_every}: "
                "both must be >= 0"
            )
        if request.keep_every and not request.keep_last:  # as `ckpt delete` refuses it
            raise InvalidRequestError(
                keep_every_needs_keep_last(request.keep_every, request.keep_last)
            )
        with self._lock:
            self._expire()
            busy = [s.step for s in self._saves.values()]
        result = apply_retention(
            self.root, request.keep_last, request.keep_every, busy, guard=self._guard
        )
        return pb.RetentionResponse(deleted=result.deleted, collected=result.collected)

    @contextlib.contextmanager
    def _guard(self, step: int):
        """For retention's collection of a leftover: yields whether `step` is being saved,
        holding the lock so that no save of it begins while its folder is removed."""
        with self._lock:
            yield self._busy(step)
