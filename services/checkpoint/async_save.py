"""Asynchronous saves: snapshot into reused host buffers, upload on a background thread.

`AsyncSaver.save(...)` waits for the previous save, copies each box the writer owns into a host
buffer (pinned when CUDA is available; allocated on first use and reused by later saves of the same
boxes), and returns: the training stall is that device-to-host copy. Pinning is slow (measured:
BENCHMARKS.md, 'Checkpoints: persist, load and stall'), so a run that will save calls
`prepare(specs)` once its boxes are known: a background thread allocates their buffers while
training runs, pausing after each as long as it took (pinning holds the CUDA driver's lock, and
back-to-back allocations starved the training thread), and the first save finds them ready (it waits
for any still being allocated). A background thread then stores the boxes through a *sink*, writes
the writer's fragment and, on the committing writer, commits. A failed store is retried with backoff
(`attempts` tries, and for `retry_timeout` seconds at least); if it still fails, the error is kept
and raised by the next `save()` or `wait()`, never dropped. A checkpoint service that restarted
mid-save forgets the save (SaveForgottenError): the saver resumes it there (`sink.resume_save`) and
sends its boxes again, or commits again; every writer of the save does so on its own, and one that
had stored its fragment before the restart has nothing to redo (the fragment is in storage).

A save that fails because its storage is full (DiskFullError: ENOSPC, EDQUOT) is tried
`attempts` times only, and what it had stored is removed: every writer removes its own objects
(so its error report fits), and the only writer of a save the whole uncommitted step folder
(with several, `Checkpointer` does that once they have all ended). A full disk is thus not kept
full by a save that cannot commit.

The sink is what differs between the embedded default and service mode: `StorageSink(root)` writes
straight to storage; `meshtrain.services.checkpoint.rpc.client.CheckpointClient` streams to the
checkpoint service. Both offer `writer(step, save_id, writer_id, num_writers)` (an object with
`write(spec, data)` and `finish(error=None)`) and `commit(step, save_id, num_writers, metadata,
timeout)`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.multiwriter import (
    REPLACEMENTS,
    SaveResult,
    ShardWriter,
    abort_save,
    committed_by,
    data_path,
    is_committed,
    is_replacement,
)
from meshtrain.services.checkpoint.store import Root, join, open_root
from meshtrain.services.common.errors import (
    CheckpointError,
    CheckpointStorageError,
    DiskFullError,
    SaveForgottenError,
    is_disk_full,
    is_lasting_storage_error,
)

log = logging.getLogger(__name__)


class BoxWriter(Protocol):
    """One writer's handle for one save (see `ShardWriter`)."""

    def write(self, spec: ShardSpec, data: np.ndarray) -> int: ...

    def finish(self, error: str | None = None) -> None: ...


class Sink(Protocol):
    """Where saves go: storage directly, or the checkpoint service."""

    def writer(self, step: int, save_id: str, writer_id: int, num_writers: int) -> BoxWriter: ...

    def commit(
        self, step: int, save_id: str, num_writers: int, metadata: dict | None, timeout: float
    ) -> SaveResult: ...


class StorageSink:
    """The embedded default: writers and committer talk to storage directly.

    Args:
        root: root URL.
    """

    def __init__(self, root: str):
        self.root: Root = open_root(root)

    def writer(self, step: int, save_id: str, writer_id: int, num_writers: int) -> ShardWriter:
        return ShardWriter(self.root, step, save_id, writer_id, num_writers)

    def commit(
        self,
        step: int,
        save_id: str,
        num_writers: int,
        metadata: dict | None,
        timeout: float,
        cancelled: Callable[[], str | None] | None = None,
    ) -> SaveResult:
        return commit(self.root, step, save_id, num_writers, metadata, timeout, cancelled=cancelled)


MAX_RETRY_SLEEP_S = 2.0  # a retry waiting out an outage looks again this often, at least


def retry(
    what: str, fn: Callable[[], Any], attempts: int, backoff: float, timeout: float = 0.0
) -> Any:
    """Calls `fn` until it succeeds: at least `attempts` times, and for `timeout` seconds after
    the first try; sleeps `backoff * 2**i` between tries, at most MAX_RETRY_SLEEP_S (or
    `backoff`, if larger), so a service back after an outage is found within seconds.

    Domain errors (CheckpointError: bad input, overlap, ...) are not retried: trying again
    cannot fix them. Anything else (I/O, network) is; storage failing in a way waiting does
    not change (`is_lasting_storage_error`: a path through a file, EACCES, EROFS, a full disk)
    is tried `attempts` times only, not for `timeout`, which is there to outlast an outage; a
    full disk is then raised as a DiskFullError.

    Args:
        what: description for the log and the final error.
        fn: the action.
        attempts: least number of tries, >= 1.
        backoff: first sleep in seconds.
        timeout: keep trying for this many seconds (0: `attempts` tries only).

    Returns:
        What `fn` returned.
    """
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as e:
            attempt += 1
            elapsed = time.monotonic() - start
            full = is_disk_full(e)
            if attempt >= attempts and (elapsed >= timeout or full or is_lasting_storage_error(e)):
                if full:
                    raise DiskFullError(
                        f"{what} failed after {attempt} attempts: disk full: {e!r} "
                        f"(tried for {elapsed:.1f} s)"
                    ) from e
                raise CheckpointStorageError(
                    f"{what} failed after {attempt} attempts: {e!r} (tried for {elapsed:.1f} s)"
                ) from e
            log.warning(
                "%s failed (attempt %d, %.1f s of at least %d attempts and %g s), retrying: %r",
                what,
                attempt,
                elapsed,
                attempts,
                timeout,
                e,
            )
            time.sleep(min(backoff * 2 ** min(attempt - 1, 30), max(backoff, MAX_RETRY_SLEEP_S)))


PREPARE_PAUSE_S = 0.002
"""Least pause of `AsyncSaver.prepare` after each buffer it allocates (see there)."""


class AsyncSaver:
    """Saves one writer's boxes in the background; one save in flight at a time.

    Args:
        sink: `StorageSink(root)` or a service client.
        writer_id: this writer's number.
        num_writers: writers per save.
        attempts: tries per stored object / commit before the save is reported failed.
        backoff: first retry sleep in seconds (doubles each retry).
        commit_timeout: seconds the committer waits for the other writers.
        retry_timeout: keep retrying a failed store, fragment or commit (and resuming a save its
            checkpoint service forgot) for this many seconds, however many attempts that takes.
    """

    def __init__(
        self,
        sink: Sink,
        writer_id: int = 0,
        num_writers: int = 1,
        attempts: int = 3,
        backoff: float = 0.2,
        commit_timeout: float = 600.0,
        retry_timeout: float = 0.0,
    ):
        self.sink = sink
        self.writer_id = writer_id
        self.num_writers = num_writers
        self.attempts = attempts
        self.backoff = backoff
        self.retry_timeout = retry_timeout
        self.commit_timeout = commit_timeout
        self.pin = torch.cuda.is_available()
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._preparing: threading.Thread | None = None
        self._stop_preparing = (
            threading.Event()
        )  # `close`: allocate nothing more, so the thread ends
        self._prepare_error: BaseException | None = None
        self.prepared_s: float | None = None  # how long `prepare`'s allocation took, once done
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._pending: Future | None = None
        self._abandoned = (
            threading.Event()
        )  # `abandon`: the committer stops waiting for missing writers
        self._in_flight: tuple[str, bool] | None = None  # (save id, committer) of the last `save`
        self.last_stall_s = 0.0
        # The step of the newest save this saver committed (committer only; None before):
        # retention must never delete it, whatever steps other runs left in the root.
        self.last_committed: int | None = None

    def prepare(self, specs: Sequence[ShardSpec]) -> None:
        """Allocate the host buffers of these boxes on a background thread, so the first save
        does not (its stall would otherwise include pinning them). Call it only in a run that
        will save: the buffers stay held for the saver's life. Boxes a save later brings that
        were not prepared are allocated then, as without `prepare`."""
        if self._preparing is not None:
            raise CheckpointError("AsyncSaver.prepare was already called")
        wanted = [(spec, layout.torch_dtype(spec.dtype)) for spec in specs]

        def allocate() -> None:
            start = time.perf_counter()
            try:
                for spec, dtype in wanted:
                    if self._stop_preparing.is_set():
                        break
                    key = (spec.array, spec.offsets)
                    if key not in self._buffers:
                        t0 = time.perf_counter()
                        buf = torch.empty(spec.shape, dtype=dtype, pin_memory=self.pin)
                        if (
                            not self.pin
                        ):  # pinning maps every page; plain memory is mapped at first touch
                            buf.zero_()
                        self._buffers[key] = buf
                        # Pinning holds the CUDA driver's lock: allocated back to back, the buffers
                        # starved the training thread's launches (measured: BENCHMARKS.md,
                        # 'Levers tried and dropped'); a pause as long as each allocation lets
                        # it in.
                        self._stop_preparing.wait(max(PREPARE_PAUSE_S, time.perf_counter() - t0))
            except BaseException as e:  # noqa: BLE001 -- reported at the first save, which then allocates
                self._prepare_error = e
            self.prepared_s = time.perf_counter() - start

        # Not a daemon: `close` stops and joins it, so the process never exits (a failing run
        # included) with the thread inside a torch call, which aborted the interpreter at exit.
        self._preparing = threading.Thread(target=allocate, name="ckpt-prepare")
        self._preparing.start()

    def _prepared(self) -> None:
        """Wait for `prepare`'s allocation to end (a save must not race it for the buffers)."""
        if self._preparing is not None:
            self._preparing.join()
            if self._prepare_error is not None:
                log.warning(
                    "preparing the checkpoint buffers failed (%s); the save allocates them",
                    self._prepare_error,
                )
                self._prepare_error = None

    def save(
        self,
        step: int,
        save_id: str,
        boxes: Sequence[tuple[ShardSpec, torch.Tensor]],
        committer: bool = False,
        metadata: dict | None = None,
    ) -> None:
        """Snapshots `boxes` and starts storing them; returns once the snapshot is taken.

        Args:
            step: the step.
            save_id: the id every writer of this save shares (`multiwriter.begin_save`).
            boxes: (box, tensor holding exactly that box) for each box this writer owns.
            committer: this writer also commits the save once all writers reported.
            metadata: manifest metadata (used by the committer only).

        Raises:
            CheckpointError: the previous save failed (raised here, so it is not lost), or a
                tensor does not match its box.
        """
        self.wait()
        start = time.perf_counter()
        self._prepared()
        snapshot = [(spec, self._snapshot(spec, tensor)) for spec, tensor in boxes]
        if self.pin and any(t.is_cuda for _, t in boxes):
            torch.cuda.synchronize()  # the non_blocking copies must land before we return
        self.last_stall_s = time.perf_counter() - start
        self._in_flight = (save_id, committer)
        self._pending = self._pool.submit(
            self._upload, step, save_id, snapshot, committer, metadata
        )

    def outcome(self) -> tuple[bool, BaseException | None]:
        """(whether `wait` would not block, the error it would raise) without waiting: no save
        in flight, or the one in flight has ended."""
        pending = self._pending
        if pending is None:
            return True, None
        if not pending.done():
            return False, None
        return True, pending.exception()

    def wait(self) -> SaveResult | None:
        """Blocks until the save in flight is stored (and committed, on the committer).

        Returns:
            The SaveResult on the committer, else None (also when nothing was in flight).

        Raises:
            CheckpointError: that save failed after its retries (DiskFullError: its storage is
                full).
        """
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def abandon(self) -> None:
        """The run failed: the save in flight commits only if every writer has already
        reported; the committer stops waiting for the others (a dead rank never reports, and
        the commit would otherwise hold this process for `commit_timeout`). Its `wait` then
        raises. With a checkpoint service (a sink with `abort_save`) the committer tells the
        service, whose commit then stops waiting likewise."""
        self._abandoned.set()
        pending, in_flight = self._pending, self._in_flight
        abort = getattr(self.sink, "abort_save", None)
        if (
            abort is None
            or pending is None
            or pending.done()
            or in_flight is None
            or not in_flight[1]
        ):
            return
        try:
            abort(in_flight[0], "the run failed")
        except Exception as e:  # noqa: BLE001 -- the commit then runs to its timeout, as before
            log.warning(
                "could not tell the checkpoint service to give up save %s: %s", in_flight[0], e
            )

    def close(self) -> None:
        """Stops preparing buffers, waits for the save in flight and stops the upload thread."""
        self._stop_preparing.set()
        try:
            self.wait()
        finally:
            if self._preparing is not None:
                self._preparing.join()
            self._pool.shutdown(wait=True)

    def _snapshot(self, spec: ShardSpec, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != spec.shape or layout.dtype_name(tensor.dtype) != spec.dtype:
            raise CheckpointError(
                f"box {spec.offsets}+{spec.shape} of array {spec.array!r} ({spec.dtype}) got a "
                f"tensor of shape {tuple(tensor.shape)} dtype {tensor.dtype}"
            )
        key = (spec.array, spec.offsets)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            # Allocated once per box and reused: pinning is slow, and so is page-faulting
            # fresh host memory on every save.
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
            self._buffers[key] = buf
        buf.copy_(tensor.detach(), non_blocking=self.pin)
        return buf

    def _upload(
        self,
        step: int,
        save_id: str,
        snapshot: list[tuple[ShardSpec, torch.Tensor]],
        committer: bool,
        metadata: dict | None,
    ) -> SaveResult | None:
        writer = self.sink.writer(step, save_id, self.writer_id, self.num_writers)
        try:
            for spec, buf in snapshot:
                data = layout.to_stored(buf)
                self._retry(
                    f"storing box {spec.offsets} of array {spec.array!r} (step {step})",
                    functools.partial(writer.write, spec, data),
                    step,
                    save_id,
                )
            self._retry(
                f"storing the fragment of writer {self.writer_id} (step {step})",
                writer.finish,
                step,
                save_id,
                done_if_committed=True,
            )
        except Exception as e:
            full = is_disk_full(e)
            if full:  # frees the space, so that the report below fits
                self._remove_stored(step, save_id, snapshot)
            try:  # tell the committer, so it aborts now instead of at its timeout
                writer.finish(error=f"writer {self.writer_id}: {e}")
            except Exception as report_error:  # noqa: BLE001 - the raise below reports the cause
                log.warning("could not report the failure to the committer: %r", report_error)
            log.error("checkpoint save of step %d failed: %s", step, e)
            if not full:
                raise
            self._remove_step(step, save_id)
            if isinstance(e, DiskFullError):
                raise
            raise DiskFullError(f"checkpoint save of step {step} failed: disk full: {e}") from e
        if not committer:
            return None
        cancel = (
            {"cancelled": lambda: "the run failed" if self._abandoned.is_set() else None}
            if isinstance(self.sink, StorageSink)
            else {}
        )
        try:
            result = self._retry(
                f"committing step {step}",
                lambda: self.sink.commit(
                    step, save_id, self.num_writers, metadata, self.commit_timeout, **cancel
                ),
                step,
                save_id,
            )
        except Exception as e:
            if not is_disk_full(e):  # a writer's disk-full report, or the commit's own writes
                raise
            self._remove_step(step, save_id)
            if isinstance(e, DiskFullError):
                raise
            raise DiskFullError(f"checkpoint save of step {step} failed: disk full: {e}") from e
        self.last_committed = step
        return result

    def _remove_stored(
        self, step: int, save_id: str, snapshot: list[tuple[ShardSpec, torch.Tensor]]
    ) -> None:
        """After this writer's part of a save failed with the disk full: removes the objects it
        stored of it (their space is what the disk lacks), unless the step is committed (by
        another save, whose objects they now are). Best effort. Storage of its own only: a
        checkpoint service's storage is the service's."""
        if not isinstance(self.sink, StorageSink):
            return
        root = self.sink.root
        try:
            folder = root.step_path(step)
            if is_committed(root, step):
                if committed_by(root, step, save_id) is not None:
                    return  # its objects are a checkpoint's now
                if not is_replacement(root, step, save_id):
                    return
                # a replacement's objects lie beside the checkpoint it was to replace
                folder = data_path(root, step, f"{REPLACEMENTS}/{save_id}")
            paths = [join(folder, spec.array, spec.key) for spec, _ in snapshot]
            stored = [p for p in paths if root.fs.exists(p)]
            if stored:
                root.fs.rm(stored)
        except Exception as e:  # noqa: BLE001 - the save's own error is the one raised
            log.warning(
                "could not remove what the failed save of step %d stored under %s: %r",
                step,
                root.url,
                e,
            )

    def _remove_step(self, step: int, save_id: str) -> None:
        """After a save failed with the disk full, where this is its only writer: removes the
        step's uncommitted folder (`multiwriter.abort_save`: never a committed step's). With several
        writers the others may still be writing into it: the caller removes it once they have
        all ended (`Checkpointer`). Best effort."""
        if not isinstance(self.sink, StorageSink) or self.num_writers != 1:
            return
        try:
            if abort_save(self.sink.root, step, save_id):
                log.info(
                    "removed the uncommitted folder of the failed save of step %d under %s",
                    step,
                    self.sink.root.url,
                )
        except Exception as e:  # noqa: BLE001 - the save's own error is the one raised
            log.warning(
                "could not remove the folder of the failed save of step %d under %s: %r",
                step,
                self.sink.root.url,
                e,
            )

    def _retry(
        self,
        what: str,
        fn: Callable[[], Any],
        step: int,
        save_id: str,
        done_if_committed: bool = False,
    ) -> Any:
        """`retry(fn)`; when the sink has forgotten the save (its checkpoint service restarted
        mid-save), resumes the save there and calls `fn` again: it resends this writer's boxes
        (a writer's stream carries them all) or commits again. With `done_if_committed`, a save
        the resume finds committed needs nothing more of this call (its fragment was stored).
        Resumes as often as `attempts`, or for `retry_timeout` seconds: a service restarted
        again and again fails the save."""
        start, resumes = time.monotonic(), 0
        while True:
            try:
                return retry(what, fn, self.attempts, self.backoff, self.retry_timeout)
            except SaveForgottenError as e:
                resume = getattr(self.sink, "resume_save", None)
                resumes += 1
                if (
                    resume is None
                    or self._abandoned.is_set()
                    or (resumes > self.attempts and time.monotonic() - start > self.retry_timeout)
                ):
                    raise
                log.warning("%s: %s; resuming save %s there and trying again", what, e, save_id)
                committed = retry(
                    f"resuming save {save_id} of step {step} ({what})",
                    functools.partial(resume, step, save_id, self.num_writers),
                    self.attempts,
                    self.backoff,
                    self.retry_timeout,
                )
                if committed and done_if_committed:
                    return None
