"""The checkpoint service's table of saves, which the servicer's RPCs share: the saves in progress
keyed by save id, and those that ended, remembered boundedly, so a late call of one is told what
happened to it (committed, refused, superseded, abandoned, given up on a writer's error) rather
than that its id is unknown. It takes up a save this replica has not seen from its marker in
storage (`multiwriter.read_begun`: begun on another replica serving the root, or before a
restart), ending any save of the step it knew whose marker is gone; it forgets saves never
committed within twice the commit timeout (their trainer died); and it reclaims the storage of a
save that failed for good: the boxes a WriteShards stream stored before it failed with the disk
full, and the objects of a save ended by a writer's error or a refused commit
(`multiwriter.abort_save`), only while the step's folder still belongs to the save, never a
committed checkpoint's nor a newer save's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.multiwriter import (
    ShardWriter,
    abort_save,
    committed_by,
    committed_by_another,
    read_begun,
)
from meshtrain.services.checkpoint.store import join, open_root
from meshtrain.services.common.errors import CheckpointError, InvalidRequestError
from meshtrain.services.common.grpc_utils import status_details
from meshtrain.services.common.sanitize import loggable

log = logging.getLogger("meshtrain.checkpoint")


@dataclass(eq=False)
class Save:
    """A save in progress that this service knows."""

    step: int
    num_writers: int
    started: float = field(default_factory=time.monotonic)
    commit_lock: threading.Lock = field(default_factory=threading.Lock)
    abort_reason: str | None = None  # AbortSave's: its commit stops waiting for writers
    adopted: bool = (
        False  # begun by another replica (or before a restart), taken up from its marker
    )


class SaveTable:
    """The saves of one checkpoint root that this service knows, and the locks guarding them.

    Args:
        root: root URL of the saves.
        commit_timeout: seconds a commit waits for writers by default; a save not committed
            within twice that is forgotten.
        max_writers: the most writers one save may have.
    """

    def __init__(self, root: str, commit_timeout: float, max_writers: int):
        self.root = root
        self.commit_timeout = commit_timeout
        self.max_writers = max_writers
        self._saves: dict[str, Save] = {}
        # Saves that ended, bounded: a retried Commit of a committed save gets its result again,
        # and a late write or commit of a save that ended otherwise a refusal naming why.
        self._committed: OrderedDict[str, Save] = OrderedDict()
        self._ended: OrderedDict[str, tuple[int, str]] = OrderedDict()  # id -> (step, why)
        self._lock = threading.Lock()
        # BeginSave and ResumeSave one at a time: a resume that checked the step's folder must
        # not register its save beside a newer BeginSave of the step clearing that folder
        self._begin_lock = threading.Lock()

    def _save(self, save_id: str, context) -> Save:
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
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"save {save_id!r} of step {committed.step} is already committed; "
                    "it takes no more writes",
                )
            if ended is not None:
                step, why = ended
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    status_details(
                        f"save {save_id!r} of step {step} {why}; its writes and commits are "
                        "refused (begin a new save)"
                    ),
                )
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                status_details(
                    f"unknown save id {save_id!r}: call BeginSave first, or ResumeSave for a "
                    "save begun before this service restarted (it forgets saves in progress)"
                ),
            )
        assert save is not None  # context.abort raised
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
        for save_id in [
            k for k, v in self._saves.items() if v.started < limit and not v.commit_lock.locked()
        ]:
            save = self._saves.pop(save_id)
            self._remember(
                self._ended,
                save_id,
                (save.step, f"was abandoned (no commit within {2 * self.commit_timeout:g} s)"),
            )
            log.warning(
                "save %s of step %d abandoned (no commit within %.0f s); forgotten",
                save_id,
                save.step,
                2 * self.commit_timeout,
            )

    def _num_writers(self, num_writers: int) -> int:
        if not 1 <= num_writers <= self.max_writers:
            raise InvalidRequestError(
                f"num_writers={num_writers} must be in [1, {self.max_writers}] "
                f"(the service's --max-writers)"
            )
        return num_writers

    def _adopt(self, save_id: str, step: int, num_writers: int | None = None) -> Save | None:
        """Takes up a save this replica has not seen (begun on another replica, or before this
        one restarted) from its marker in storage, so any replica can serve any call of a save.

        Args:
            save_id: the save.
            step: the step the caller says it saves.
            num_writers: the caller's writer count (ResumeSave's), checked against the marker's,
                or used where an older marker lacks one.

        Returns:
            The save, now in progress here; None when storage does not hold it in progress (it
            committed, its folder was cleared, or its marker predates writer counts): the call
            then answers as for an unknown save, and the client's ResumeSave learns why.

        Raises:
            CheckpointError: a save of the step that this replica knows still owns the folder.
            InvalidRequestError: `num_writers` differs from the marker's.
        """
        with self._begin_lock:
            with self._lock:
                known = self._saves.get(save_id)
                if known is not None or save_id in self._committed or save_id in self._ended:
                    return known
                others = [k for k, v in self._saves.items() if v.step == step]
            # a committed step's folder may still hold the marker (the commit died before tidying
            # up)
            marker = (
                None
                if committed_by_another(open_root(self.root), step, save_id)
                else read_begun(self.root, step, save_id)
            )
            if marker is None:
                return None
            count = marker.get("num_writers", num_writers)
            if count is None:
                return None
            if num_writers is not None and num_writers != count:
                raise InvalidRequestError(
                    f"num_writers={num_writers} differs from the {count} writers save "
                    f"{save_id!r} of step {step} was begun with"
                )
            self._num_writers(count)
            for other in others:
                if read_begun(self.root, step, other) is not None:
                    raise CheckpointError(
                        f"save {save_id} of step {step} cannot be taken up: save {other} of that "
                        "step has begun since; begin a new save"
                    )
                with self._lock:
                    if self._saves.pop(other, None) is not None:
                        self._remember(
                            self._ended,
                            other,
                            (step, "was superseded by a newer save of the same step"),
                        )
                log.warning(
                    "save %s of step %d superseded by save %s (begun elsewhere)",
                    other,
                    step,
                    save_id,
                )
            save = Save(step, count, adopted=True)
            with self._lock:
                self._saves[save_id] = save
        log.info(
            "save %s of step %d taken up from its marker in storage (%d writers)",
            save_id,
            step,
            count,
        )
        return save

    def _remove_stored(
        self, save_id: str, save: Save, writer: ShardWriter, specs: list[ShardSpec]
    ) -> None:
        """After a WriteShards stream failed with the disk full: removes the objects it stored
        of its save (their space is what the disk lacks, and a retry of the stream resends
        them all), a torn last one included, while the step's folder still belongs to the save
        and the save has not committed. Best effort: the stream's own error is the one
        answered."""
        try:
            # no BeginSave of the step clears and retakes the folder meanwhile
            with self._begin_lock:
                root = open_root(self.root)
                if not self._owns_folder(root, save_id, save.step):
                    return
                paths = {join(writer.data_path, spec.array, spec.key) for spec in specs}
                found = [path for path in sorted(paths) if root.fs.exists(path)]
                if found:
                    root.fs.rm(found)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning(
                "could not remove what the failed stream of save %s (step %d) stored: %r",
                save_id,
                save.step,
                e,
            )

    def _end_failed(self, save_id: str, save: Save, why: str) -> None:
        """A writer reported an error, so the save can never commit: it ends now (its later
        writes and its commit are refused with `why`), and its objects are removed."""
        with self._lock:
            if self._saves.pop(save_id, None) is not None:
                self._remember(self._ended, save_id, (save.step, why))
        log.warning("save %s of step %d %s", save_id, save.step, loggable(why))
        self._reclaim(save_id, save)

    def _reclaim(self, save_id: str, save: Save) -> None:
        """Removes the objects of a save that ended failed (`multiwriter.abort_save`): the step's
        folder while it still belongs to the save, or, for a save that was to replace a
        committed step, its own objects beside that checkpoint; never a committed checkpoint's
        nor a newer save's. Best effort: what stays is collected by retention."""
        try:
            # no BeginSave of the step clears and retakes the folder meanwhile
            with self._begin_lock:
                # a commit under way ends first: committed (then nothing is removed) or refused
                with save.commit_lock:
                    pass
                root = open_root(self.root)
                if self._owns_folder(root, save_id, save.step) and abort_save(
                    root, save.step, save_id
                ):
                    log.info(
                        "removed the objects of the failed save %s of step %d", save_id, save.step
                    )
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning(
                "could not remove the objects of the failed save %s of step %d: %r",
                save_id,
                save.step,
                e,
            )

    @staticmethod
    def _owns_folder(root, save_id: str, step: int) -> bool:
        """Whether the step's folder still holds save `save_id` in progress: not committed by
        it, and its marker there (a newer save of the step, begun on any replica, removed it)."""
        return (
            committed_by(root, step, save_id) is None
            and read_begun(root, step, save_id) is not None
        )
