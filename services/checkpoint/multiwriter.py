"""Multi-writer saves: writers store their boxes and a fragment each; one committer commits.

Protocol for one save of step S (all writers agree on a `save_id`, e.g. rank 0 calls
`begin_save` and broadcasts the id):

1. each writer (`writer_id` of `num_writers`) stores one object per box it owns
   (`ShardWriter.write`), then `finish()` stores its fragment
   `step_S/_fragments/<save_id>/writer_<id>.json`: its boxes, their object keys, sizes, and
   the crc32 of each object, of each of its inner chunks and of its shard index;
2. one committer (`commit`) waits for all `num_writers` fragments (timeout -> abort, nothing
   committed), checks that the boxes of every array tile it exactly, checks every object's
   size against one listing of the folder, writes each array's zarr.json and the group's
   (deterministic bytes, so nobody races on them), and creates `manifest.json` last, only if
   absent (`store.write_bytes_exclusive`): the commit. Two committers racing on one step (two
   checkpoint service replicas, a retry beside its first attempt) cannot both commit it: the
   loser reads the winner's manifest and returns its result when it was the same save, else
   raises a CheckpointError naming the save that committed.

Writers never write the same object (a box is one shard), so the protocol needs no locks and
works on object stores, where a PUT is atomic and last-writer-wins. Readers only trust steps
with a manifest, so a kill at any point leaves earlier checkpoints loadable.

`begin_save(..., resumable=True)` (the checkpoint service's) also stores
`step_S/_fragments/<save_id>/begun.json`, which says in storage that the folder belongs to
that save and how many writers it has: a checkpoint service restarted mid-save has forgotten the
save id, and `resume_save` lets it take the save up again only while that marker is there (a
newer `begin_save` of the step clears the folder, marker included; the commit removes it). A
replica of the service that did not see `begin_save` adopts the save from the same marker
(`read_begun`): what a commit needs is in storage, not in one process's memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr
from zarr.storage import MemoryStore

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import ArrayMeta, ShardSpec, check_tiling, encode_box
from meshtrain.services.checkpoint.crc import checksum
from meshtrain.services.checkpoint.nofollow import open_beneath, refuse_symlinks
from meshtrain.services.checkpoint.store import (
    MANIFEST_NAME,
    Root,
    join,
    open_root,
    read_bytes,
    remove_tree,
    write_bytes_atomic,
    write_bytes_exclusive,
)
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.sanitize import loggable

FORMAT = "meshtrain-checkpoint"
# 2: shard objects also list the crc32 of each inner chunk and of the shard index, so partial
# reads fetch and verify only the chunks they need. Version 1 manifests still load (whole
# shards are fetched for them).
# 3: the manifest carries the sha256 of its own content (MANIFEST_DIGEST), so an edited or
# damaged field (the step, the iteration a resume starts from, a dtype) is refused instead of
# loaded. Versions 1 and 2 have none and still load.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
DIGEST_FROM_VERSION = 3
MANIFEST_DIGEST = "manifest_sha256"
# crc32 (zlib): the manifest guards against torn writes and bit rot, not tampering; crc32
# runs at memory speed in the stdlib and catches every burst error up to 32 bits.
CHECKSUM = "crc32"
CHUNK_CHECKSUMS = "chunk_crc32"  # per inner chunk, C order over the shard's chunk grid
INDEX_CHECKSUM = "index_crc32"  # the shard index (the object's last 16 * chunks + 4 bytes)
FRAGMENTS = "_fragments"
BEGUN = "begun.json"  # beside the fragments of a save: the step's folder is that save's
# A save that replaces a committed step (`overwrite`) writes its arrays under
# step_S/_next/<save_id>/ and leaves the committed ones alone; its manifest names that folder
# (`data`) and replaces the old manifest in one atomic write, the commit; the old arrays are
# removed after it. REPLACES beside its fragments marks the save as a replacement.
REPLACEMENTS = "_next"
REPLACES = "replaces.json"
_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_\-]{1,64}")  # fullmatch: "$" let a final newline in

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """What one committed save did.

    Attributes:
        url: URL of the committed checkpoint folder.
        step: the step saved.
        num_arrays: zarr arrays written.
        num_objects: stored objects (array metadata + shards + group metadata), manifest excluded.
        bytes_written: total size of those objects plus the manifest.
        seconds: wall time of the commit (or of the whole save, for `save_checkpoint`).
    """

    url: str
    step: int
    num_arrays: int
    num_objects: int
    bytes_written: int
    seconds: float


def check_save_id(save_id: str) -> str:
    """Returns `save_id` or raises CheckpointError: it becomes a folder name, so no '/' or '..'."""
    if not isinstance(save_id, str) or not _SAVE_ID_RE.fullmatch(save_id):
        raise CheckpointError(
            f"save id {loggable(save_id, 80)} is not allowed: use 1-64 letters, digits, '_' or '-'"
        )
    return save_id


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 (hex) of a manifest's content, its own MANIFEST_DIGEST field left out.

    Computed over canonical JSON (sorted keys, no spaces), so it does not depend on how the
    manifest file is indented; floats round-trip exactly through Python's JSON.
    """
    content = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def data_base(manifest: dict[str, Any]) -> str:
    """Where a committed step's arrays are, relative to its folder: "" (the folder itself) or
    `_next/<save_id>` (a step replaced by an overwrite save).

    Raises:
        CheckpointError: the manifest names any other place (never a path out of the step).
    """
    base = manifest.get("data", "")
    if base == "":
        return ""
    parts = base.split("/") if isinstance(base, str) else []
    if len(parts) != 2 or parts[0] != REPLACEMENTS or not _SAVE_ID_RE.fullmatch(parts[1]):
        raise CheckpointError(f"the manifest's data folder {loggable(str(base), 80)} is not one")
    return base


def data_path(root: Root, step: int, base: str = "") -> str:
    """The folder that holds the arrays of `step` (`base` from `data_base`)."""
    return join(root.step_path(step), base) if base else root.step_path(step)


def replaces_path(root: Root, step: int, save_id: str) -> str:
    """Where `begin_save(..., overwrite=True)` marks save `save_id` as replacing the step."""
    return join(root.step_path(step), FRAGMENTS, save_id, REPLACES)


def is_replacement(root: Root, step: int, save_id: str) -> bool:
    """Whether save `save_id` was begun to replace the committed `step` (and still may)."""
    path = replaces_path(root, step, save_id)
    root.fs.invalidate_cache(join(root.step_path(step), FRAGMENTS, save_id))
    return root.fs.exists(path)


def committed_by_another(root: Root, step: int, save_id: str) -> bool:
    """Whether `step` is committed by a checkpoint that save `save_id` may not replace (it was
    not begun to replace it), so the save can only be lost."""
    return is_committed(root, step) and not is_replacement(root, step, save_id)


def is_committed(root: Root, step: int) -> bool:
    """Whether `step` has a manifest (bypassing any cached listing)."""
    path = join(root.step_path(step), MANIFEST_NAME)
    root.fs.invalidate_cache(root.step_path(step))
    return root.fs.exists(path)


def begin_save(
    root: str | Root,
    step: int,
    overwrite: bool = False,
    resumable: bool = False,
    num_writers: int | None = None,
) -> str:
    """Prepares the folder of `step` for a new save and returns a fresh save id.

    Call once (e.g. on rank 0) before any writer starts, and hand the id to every writer.

    Args:
        root: root URL or opened Root.
        step: the step to save.
        overwrite: replace a committed checkpoint of this step instead of refusing.
        resumable: mark the folder as this save's, so that `resume_save` can take it up again
            (a checkpoint service restarted mid-save) and another service replica adopt it.
        num_writers: with `resumable`, the save's writer count, recorded in the marker (what a
            replica that adopts the save commits with).

    Returns:
        The save id.

    Raises:
        CheckpointError: the step is committed and not `overwrite`.
    """
    root = open_root(root) if isinstance(root, str) else root
    step_path = root.step_path(step)
    save_id = uuid.uuid4().hex
    if is_committed(root, step):
        if not overwrite:
            raise CheckpointError(
                f"checkpoint step {step} already exists under {root.url!r} (to replace it: "
                "--checkpoint.overwrite=true for a training run, overwrite=True in code)"
            )
        # The committed step stays loadable until this save commits over it (REPLACEMENTS):
        # only earlier unfinished saves' leftovers go.
        _remove_unfinished(root, step)
        marker = json.dumps({"save_id": save_id, "step": step}).encode()
        write_bytes_atomic(root, replaces_path(root, step, save_id), marker)
    else:
        # Leftovers of an uncommitted attempt would otherwise linger beside this one.
        remove_tree(root, step_path)
    if resumable:
        begun: dict[str, object] = {"save_id": save_id, "step": step}
        if num_writers is not None:
            begun["num_writers"] = num_writers
        write_bytes_atomic(root, begun_path(root, step, save_id), json.dumps(begun).encode())
    return save_id


def _remove_unfinished(root: Root, step: int, keep: str | None = None) -> None:
    """Removes what unfinished saves left in a committed step's folder: fragments and replacement
    arrays the manifest does not name (`keep`: one save's, still under way, stays)."""
    step_path = root.step_path(step)
    try:
        base = data_base(json.loads(read_bytes(root, join(step_path, MANIFEST_NAME))))
    except (OSError, ValueError, CheckpointError):
        base = None  # unreadable: nothing in it can be told apart, so no replacement goes
    for folder in (FRAGMENTS, REPLACEMENTS):
        path = join(step_path, folder)
        root.fs.invalidate_cache(path)
        try:
            names = root.fs.ls(path, detail=False)
        except FileNotFoundError:
            continue
        for name in names:
            own = name.rstrip("/").rsplit("/", 1)[-1]
            named = base is None or base == f"{REPLACEMENTS}/{own}"
            if own == keep or (folder == REPLACEMENTS and named):
                continue
            remove_tree(root, join(path, own))
        _remove_if_empty(root, path)


def _remove_if_empty(root: Root, path: str) -> None:
    """Removes a folder left empty (on disk; object stores have no empty folders)."""
    root.fs.invalidate_cache(path)
    try:
        if not root.fs.ls(path, detail=False):
            root.fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def begun_path(root: Root, step: int, save_id: str) -> str:
    """Where `begin_save(..., resumable=True)` leaves the marker of save `save_id`."""
    return join(root.step_path(step), FRAGMENTS, save_id, BEGUN)


def read_begun(root: str | Root, step: int, save_id: str) -> dict[str, Any] | None:
    """The marker of a resumable save of `step` (its `save_id`, `step` and, when recorded,
    `num_writers`), or None when the folder no longer holds that save (or never did).

    Raises:
        CheckpointError: the marker is there but is not one (not JSON, another save's or step's).
    """
    root = open_root(root) if isinstance(root, str) else root
    check_save_id(save_id)
    path = begun_path(root, step, save_id)
    root.fs.invalidate_cache(join(root.step_path(step), FRAGMENTS, save_id))
    try:
        if root.is_local:  # asked per writer and while a commit waits: no walk of the step folder
            with os.fdopen(
                open_beneath(root.path, path, os.O_RDONLY, create_dirs=False), "rb"
            ) as f:
                data = f.read()
        else:
            data = read_bytes(root, path)
        marker = json.loads(data)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise CheckpointError(f"the marker {path} of save {save_id} is not JSON: {e}") from e
    num_writers = marker.get("num_writers") if isinstance(marker, dict) else None
    if (
        not isinstance(marker, dict)
        or marker.get("save_id") != save_id
        or marker.get("step") != step
        or not (num_writers is None or (isinstance(num_writers, int) and num_writers >= 1))
    ):
        raise CheckpointError(
            f"the marker {path} does not describe save {save_id} of step {step}: "
            f"{loggable(str(marker), 200)}"
        )
    return marker


def resume_save(root: str | Root, step: int, save_id: str) -> SaveResult | None:
    """Checks that save `save_id` of `step` can be taken up again where it was left (its
    checkpoint service restarted mid-save): its writers then store their boxes and fragments
    again, or keep those they had stored, and its committer commits.

    Args:
        root: root URL or opened Root.
        step: the save's step.
        save_id: the save's id, as `begin_save` returned it.

    Returns:
        The commit's result when that save has committed already (nothing to redo), else None.

    Raises:
        CheckpointError: the step's folder no longer holds that save (a newer save of the step
            began and cleared it, retention collected it, or the step was committed by another
            save): it cannot be resumed, only begun anew.
    """
    root = open_root(root) if isinstance(root, str) else root
    check_save_id(save_id)
    done = committed_by(root, step, save_id)
    if done is not None:
        return done
    if committed_by_another(root, step, save_id):
        raise CheckpointError(
            f"save {save_id} of step {step} cannot be resumed: the step under {root.url!r} "
            "was committed by another save"
        )
    if read_begun(root, step, save_id) is None:
        raise CheckpointError(
            f"save {save_id} of step {step} cannot be resumed: {begun_path(root, step, save_id)} "
            "is gone (a newer save of the step began, or retention collected the unfinished "
            "folder); begin a new save"
        )
    return None


class ShardWriter:
    """Writes the boxes one writer owns for one save, then its fragment.

    Args:
        root: root URL or opened Root.
        step: the step being saved.
        save_id: the id every writer of this save shares.
        writer_id: this writer's number, 0 <= writer_id < num_writers.
        num_writers: how many writers the committer waits for.
    """

    def __init__(self, root: str | Root, step: int, save_id: str, writer_id: int, num_writers: int):
        self.root = open_root(root) if isinstance(root, str) else root
        self.step = step
        self.save_id = check_save_id(save_id)
        if not (isinstance(num_writers, int) and num_writers >= 1 and 0 <= writer_id < num_writers):
            raise CheckpointError(
                f"writer_id {writer_id!r} of num_writers {num_writers!r} is invalid"
            )
        self.writer_id = writer_id
        self.num_writers = num_writers
        self.step_path = self.root.step_path(step)
        self.data_path = self.step_path  # a replacement's own folder, once its first box is in
        self.boxes: dict[tuple[str, str], dict[str, Any]] = {}
        self._checked = False

    def write(self, spec: ShardSpec, data: torch.Tensor | np.ndarray) -> int:
        """Stores one box (one object); writing the same box again replaces it (a retry).

        Args:
            spec: the box.
            data: its contents, shape `spec.shape`: a tensor of dtype `spec.dtype` or a numpy
                array already in the stored dtype.

        Returns:
            Bytes stored.

        Raises:
            CheckpointError: the step is already committed, or the data does not fit the box.
        """
        if not self._checked:
            # Writing into a committed folder would corrupt a good checkpoint: a replacement
            # writes beside it, anything else is refused.
            if is_committed(self.root, self.step):
                if not is_replacement(self.root, self.step, self.save_id):
                    raise CheckpointError(
                        f"checkpoint step {self.step} under {self.root.url!r} is already "
                        "committed; call begin_save(..., overwrite=True) before writing it again"
                    )
                self.data_path = data_path(self.root, self.step, f"{REPLACEMENTS}/{self.save_id}")
            self._checked = True
        data = layout.as_stored(
            data, spec.dtype, f"box {spec.offsets}+{spec.shape} of array {spec.array!r}"
        )
        encoded = encode_box(spec, data)
        record: dict[str, Any] = {
            "array": spec.array,
            "global_shape": list(spec.global_shape),
            "dtype": spec.dtype,
            "offsets": list(spec.offsets),
            "shape": list(spec.shape),
            "grid": list(spec.grid_shape),
            "stacked": spec.is_stacked,
            "key": spec.key,
            "size": 0 if encoded is None else encoded.size,
            CHECKSUM: None if encoded is None else encoded.crc32,
        }
        if encoded is not None:
            if encoded.chunk_crc32 is not None:
                record[CHUNK_CHECKSUMS] = encoded.chunk_crc32
                record[INDEX_CHECKSUM] = encoded.index_crc32
            put_object(self.root, join(self.data_path, spec.array, spec.key), encoded.parts)
        self.boxes[(spec.array, spec.key)] = record
        return record["size"]

    def finish(self, error: str | None = None) -> None:
        """Stores this writer's fragment: the commit can proceed once all writers did this.

        Args:
            error: report a failure instead: the committer aborts the save naming it.
        """
        fragment = {
            "save_id": self.save_id,
            "step": self.step,
            "writer_id": self.writer_id,
            "num_writers": self.num_writers,
            "boxes": list(self.boxes.values()),
            "error": error,
        }
        path = fragment_path(self.root, self.step, self.save_id, self.writer_id)
        write_bytes_atomic(self.root, path, json.dumps(fragment).encode())


def fragment_path(root: Root, step: int, save_id: str, writer_id: int) -> str:
    """Where writer `writer_id` of save `save_id` leaves its fragment."""
    return join(root.step_path(step), FRAGMENTS, save_id, f"writer_{writer_id:05d}.json")


def put_object(root: Root, path: str, parts: list[bytes | memoryview]) -> None:
    """Stores one data object from consecutive parts (one PUT on object stores; plain file
    writes on disk, so the parts are never joined into one more copy there).

    Not atomic on disk: a torn object is harmless because it is either rewritten before the
    commit or, if the writer died, never committed (and the crc32 catches it anyway). On disk
    the object is fsynced before this returns, so a manifest written later never outlives the
    data it lists in a machine crash (the manifest itself is fsynced and renamed last).
    """
    if root.is_local:
        # never through a symlink below the root: one planted in the step folder led outside it
        with os.fdopen(
            open_beneath(root.path, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb"
        ) as f:
            f.writelines(parts)
            f.flush()
            os.fsync(f.fileno())
    else:
        root.fs.pipe_file(path, b"".join(parts))


def _read_fragments(root: Root, step: int, save_id: str) -> dict[int, dict[str, Any]]:
    folder = join(root.step_path(step), FRAGMENTS, save_id)
    if root.is_local:  # a fragment linked to a file elsewhere is not read
        refuse_symlinks(root.path, folder)
    root.fs.invalidate_cache(folder)
    try:
        names = root.fs.ls(folder, detail=False)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        base = name.rstrip("/").rsplit("/", 1)[-1]
        match = re.fullmatch(r"writer_(\d{5})\.json", base)
        if match:
            found[int(match.group(1))] = json.loads(read_bytes(root, name))
    return found


def commit(
    root: str | Root,
    step: int,
    save_id: str,
    num_writers: int,
    metadata: dict[str, Any] | None = None,
    timeout: float = 600.0,
    poll: float = 0.01,
    cancelled: Callable[[], str | None] | None = None,
    require_marker: bool = False,
) -> SaveResult:
    """Waits for every writer's fragment, validates the save and writes the manifest.

    Args:
        root: root URL or opened Root.
        step: the step saved.
        save_id: the save's id.
        num_writers: how many fragments to wait for.
        metadata: JSON-serializable user data stored in the manifest.
        timeout: seconds to wait for the fragments; then the save is aborted.
        poll: seconds before the second look at the fragment folder; the gap then grows
            1.5x a look to at most 1 s, so a long wait on an object store costs few LIST
            requests (a dozen in the first 2 s) while a fast local save is committed within
            about a third of its own time (a 0.05 s start cost 0.1 s saves up to 50%).
        cancelled: asked at each look at the fragment folder for a reason to stop waiting for
            writers that have not reported (the service's save was superseded, its folder about
            to be cleared; the trainer's run failed, so a dead writer never will); a reason aborts
            the save, as at the timeout. A save whose fragments are all in is still committed.
        require_marker: the save was begun resumable: refuse it (a newer save of the step cleared
            its folder) when its marker is gone before the metadata is written.

    Returns:
        A SaveResult: this commit's, or that of the same save's commit that won a race with it.

    Raises:
        CheckpointError: a writer did not report in time or reported an error, boxes overlap
            or leave holes, an object is missing or of the wrong size, or the metadata is not
            JSON, or another save committed the step first. Nothing is committed then; earlier
            checkpoints are untouched.
    """
    start = time.perf_counter()
    root = open_root(root) if isinstance(root, str) else root
    check_save_id(save_id)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):  # readers look keys up in it
        raise CheckpointError(
            f"checkpoint metadata for step {step} must be a dict, got {type(metadata).__name__}"
        )
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint metadata for step {step} is not JSON: {e}") from e
    done = committed_by(root, step, save_id)
    if done is not None:  # a retry of this very commit, whose first attempt succeeded
        log.info("checkpoint %s was already committed by save %s", done.url, save_id)
        return done
    if committed_by_another(root, step, save_id):  # by another save: no point waiting for fragments
        return _lost(root, step, save_id)
    try:
        return _commit(
            root,
            step,
            save_id,
            num_writers,
            metadata,
            timeout,
            poll,
            cancelled,
            require_marker,
            start,
        )
    except FileNotFoundError:
        # Another committer won meanwhile and cleared the fragments and objects its manifest
        # does not list, which this one was reading: its commit is the answer, not a lost file.
        if (
            committed_by_another(root, step, save_id)
            or committed_by(root, step, save_id) is not None
        ):
            return _lost(root, step, save_id)
        raise


def _commit(
    root: Root,
    step: int,
    save_id: str,
    num_writers: int,
    metadata: dict[str, Any],
    timeout: float,
    poll: float,
    cancelled: Callable[[], str | None] | None,
    require_marker: bool,
    start: float,
) -> SaveResult:
    """`commit` once its arguments are checked and the step is not committed yet."""
    deadline = time.monotonic() + timeout
    while True:
        fragments = _read_fragments(root, step, save_id)
        failed = {w: f["error"] for w, f in fragments.items() if f.get("error")}
        if failed:
            raise CheckpointError(f"save of step {step} aborted: writers reported errors {failed}")
        if len(fragments) >= num_writers:
            break
        missing = _missing(fragments, num_writers)
        reason = cancelled() if cancelled is not None else None
        if reason:
            raise CheckpointError(
                f"save {save_id} of step {step} under {root.url!r} abandoned: writers {missing} "
                f"had not reported when {reason}; nothing was committed, the previous checkpoint "
                "is intact"
            )
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"save of step {step} under {root.url!r} aborted: writers {missing} did not "
                f"report within {timeout:g} s; the previous checkpoint is intact"
            )
        time.sleep(poll)
        poll = min(poll * 1.5, 1.0)
    for writer_id, fragment in fragments.items():
        if fragment["num_writers"] != num_writers or writer_id >= num_writers:
            raise CheckpointError(
                f"save of step {step}: writer {writer_id} reported num_writers "
                f"{fragment['num_writers']}, the committer expects {num_writers}"
            )
    replacing = is_replacement(root, step, save_id)
    if is_committed(root, step) and not replacing:
        return _lost(root, step, save_id)
    if root.is_local:  # before anything in the folder is listed, read, written or deleted
        refuse_symlinks(root.path, root.step_path(step))
    if require_marker and read_begun(root, step, save_id) is None:
        raise CheckpointError(
            f"save {save_id} of step {step} under {root.url!r} was superseded: its folder "
            "no longer holds it (a newer save of the step began); nothing was committed"
        )

    # array name -> (meta, boxes, object records)
    arrays: dict[str, tuple[ArrayMeta, list[ShardSpec], dict[str, dict[str, int]]]] = {}
    for fragment in fragments.values():
        for rec in fragment["boxes"]:
            spec = ShardSpec(
                rec["array"],
                tuple(rec["global_shape"]),
                rec["dtype"],
                tuple(rec["offsets"]),
                tuple(rec["shape"]),
                tuple(rec["grid"]),
                rec["stacked"],
            )
            meta, boxes, objects = arrays.setdefault(spec.array, (ArrayMeta.of(spec), [], {}))
            boxes.append(spec)
            if rec["size"]:
                objects[rec["key"]] = {
                    k: rec[k]
                    for k in ("size", CHECKSUM, CHUNK_CHECKSUMS, INDEX_CHECKSUM)
                    if k in rec
                }
    for meta, boxes, _ in arrays.values():
        check_tiling(meta, boxes)

    step_path = root.step_path(step)
    base = f"{REPLACEMENTS}/{save_id}" if replacing else ""
    folder = data_path(root, step, base)
    stored = _sizes(root, folder)
    for name, (_, _, objects) in arrays.items():
        for key, obj in objects.items():
            size = stored.get(f"{name}/{key}")
            if size != obj["size"]:
                raise CheckpointError(
                    f"save of step {step} aborted: array {name!r} object {key!r} is "
                    f"{'missing' if size is None else f'{size} bytes'}, its writer reported "
                    f"{obj['size']} bytes"
                )

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "checksum": CHECKSUM,
        "created_unix": time.time(),
        "num_writers": num_writers,
        "save_id": save_id,
        "arrays": {},
        "objects": {},
        "metadata": metadata,
    }
    if base:
        manifest["data"] = base
    group_meta = _group_metadata(step)
    write_bytes_atomic(root, join(folder, "zarr.json"), group_meta)
    manifest["objects"]["zarr.json"] = {"size": len(group_meta), CHECKSUM: checksum(group_meta)}
    for name, (meta, _, objects) in sorted(arrays.items()):
        data = meta.metadata_bytes()
        write_bytes_atomic(root, join(folder, name, "zarr.json"), data)
        entry = meta.manifest_entry()
        entry["objects"] = {"zarr.json": {"size": len(data), CHECKSUM: checksum(data)}, **objects}
        manifest["arrays"][name] = dict(sorted(entry.items()))
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if replacing and is_committed(root, step):
        # A newer save of the step that began meanwhile removed the marker: it owns the step.
        if not is_replacement(root, step, save_id):
            raise CheckpointError(
                f"save {save_id} of step {step} under {root.url!r} was superseded by a newer "
                "save of the step; nothing was committed, the committed step is intact"
            )
        # The commit: readers see the old manifest (and arrays) or the new, never neither.
        write_bytes_atomic(root, join(step_path, MANIFEST_NAME), data)
    elif not write_bytes_exclusive(root, join(step_path, MANIFEST_NAME), data):
        return _lost(root, step, save_id)

    if base:
        _remove_replaced(root, step_path, base)
    _remove_unlisted(root, step_path, manifest, {} if base else stored)
    result = _result(root, step, manifest, len(data), time.perf_counter() - start)
    log.info(
        "committed checkpoint %s: %d arrays, %d objects from %d writers, %.1f MB",
        result.url,
        result.num_arrays,
        result.num_objects,
        num_writers,
        result.bytes_written / 1e6,
    )
    return result


def _lost(root: Root, step: int, save_id: str) -> SaveResult:
    """A commit found the step's manifest there before its own: the result of that commit when
    it was this save's (a twin committer won the race), else a CheckpointError naming the winner."""
    done = committed_by(root, step, save_id)
    if done is not None:
        log.info("checkpoint %s was committed by save %s on another committer", done.url, save_id)
        return done
    try:
        winner = json.loads(read_bytes(root, join(root.step_path(step), MANIFEST_NAME))).get(
            "save_id"
        )
    except (OSError, ValueError, AttributeError):
        winner = None
    raise CheckpointError(
        f"checkpoint step {step} under {root.url!r} is already committed, by save "
        f"{loggable(str(winner), 80)}, not by save {save_id}; this save is not committed"
    )


def _missing(fragments: dict[int, Any], num_writers: int, shown: int = 20) -> str:
    """The writers that have not reported, for a message: the first `shown` of them and how
    many there are (never a list as long as a save's writers)."""
    missing = []
    for w in range(num_writers):
        if w not in fragments:
            missing.append(w)
            if len(missing) == shown:
                break
    count = num_writers - len([w for w in fragments if 0 <= w < num_writers])
    return (
        str(missing) if count <= shown else f"{str(missing)[:-1]}, ...] ({count} of {num_writers})"
    )


def _result(
    root: Root, step: int, manifest: dict, manifest_bytes: int, seconds: float
) -> SaveResult:
    entries = [o for a in manifest["arrays"].values() for o in a["objects"].values()]
    entries += list(manifest["objects"].values())
    return SaveResult(
        url=root.step_url(step),
        step=step,
        num_arrays=len(manifest["arrays"]),
        num_objects=len(entries),
        bytes_written=manifest_bytes + sum(o["size"] for o in entries),
        seconds=seconds,
    )


def committed_by(root: str | Root, step: int, save_id: str) -> SaveResult | None:
    """The result of `step`'s commit if save `save_id` made it, else None."""
    root = open_root(root) if isinstance(root, str) else root
    if not is_committed(root, step):
        return None
    path = join(root.step_path(step), MANIFEST_NAME)
    try:
        data = root.fs.cat_file(path)
        manifest = json.loads(data)
    except (OSError, ValueError):
        return None  # unreadable: the commit below reports it
    if manifest.get("save_id") != save_id:
        return None
    return _result(root, step, manifest, len(data), 0.0)


def _sizes(root: Root, path: str) -> dict[str, int]:
    """Relative path -> size of every object under `path`, from one (uncached) listing."""
    root.fs.invalidate_cache(path)
    try:
        found = root.fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    prefix = path.rstrip("/") + "/"
    return {
        p[len(prefix) :]: int(info["size"]) for p, info in found.items() if p.startswith(prefix)
    }


def _group_metadata(step: int) -> bytes:
    # A root group makes the folder browsable with `zarr.open_group(url)`.
    store = MemoryStore()
    zarr.open_group(store, mode="w", zarr_format=3, attributes={"step": step})
    return store._store_dict["zarr.json"].to_bytes()


def _remove_unlisted(root: Root, step_path: str, manifest: dict, stored: dict[str, int]) -> None:
    """After the commit: drops fragments, leftovers of earlier crashed attempts and, after a
    replacement, the arrays it replaced (`stored`: paths relative to the step folder).

    Best effort: what stays behind is ignored by readers and collected by retention.
    """
    base = data_base(manifest)
    prefix = f"{base}/" if base else ""
    listed = {f"{prefix}zarr.json", MANIFEST_NAME}
    for name, entry in manifest["arrays"].items():
        listed.update(f"{prefix}{name}/{key}" for key in entry["objects"])
    try:
        remove_tree(root, join(step_path, FRAGMENTS))
        stale = [
            join(step_path, rel)
            for rel in stored
            if rel not in listed and not rel.startswith(FRAGMENTS + "/")
        ]
        if stale:
            root.fs.rm(stale)
    except OSError as e:
        log.warning("could not remove leftovers under %s: %s", step_path, e)


def _remove_replaced(root: Root, step_path: str, base: str) -> None:
    """After a replacement committed: removes the arrays it replaced, whole folders (the step's
    own, or an earlier replacement's). Best effort, as `_remove_unlisted`."""
    keep = {MANIFEST_NAME, REPLACEMENTS, FRAGMENTS}
    try:
        for folder, kept in (
            (step_path, keep),
            (join(step_path, REPLACEMENTS), {base.split("/", 1)[1]}),
        ):
            root.fs.invalidate_cache(folder)
            for entry in root.fs.ls(folder, detail=False):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if name not in kept and not name.startswith(f"{MANIFEST_NAME}.tmp-"):
                    remove_tree(root, join(folder, name))
    except OSError as e:
        log.warning("could not remove the replaced arrays under %s: %s", step_path, e)


def abort_save(root: str | Root, step: int, save_id: str | None = None) -> bool:
    """Removes a failed save's leftovers: an uncommitted step folder, or, given the `save_id` of
    a save that was to replace the committed step, that save's own objects. Never a committed
    checkpoint's.

    Args:
        root: root URL or opened Root.
        step: the step.
        save_id: the failed save's id (needed to reclaim a replacement's objects).

    Returns:
        True when something was removed.
    """
    root = open_root(root) if isinstance(root, str) else root
    if is_committed(root, step):
        if save_id is None or committed_by(root, step, check_save_id(save_id)) is not None:
            return False
        own = [
            join(root.step_path(step), REPLACEMENTS, save_id),
            join(root.step_path(step), FRAGMENTS, save_id),
        ]
        found = [path for path in own if root.fs.exists(path)]
        for path in found:
            remove_tree(root, path)
            _remove_if_empty(root, path.rsplit("/", 1)[0])
        return bool(found)
    if not root.fs.exists(root.step_path(step)):
        return False
    remove_tree(root, root.step_path(step))
    return True
