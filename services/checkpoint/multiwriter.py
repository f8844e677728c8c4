"""Multi-writer saves: writers store their boxes and a fragment each; one committer commits.

Protocol for one save of step S (all writers agree on a `save_id`, e.g. rank 0 calls
`begin_save` and broadcasts the id):

1. each writer (`writer_id` of `num_writers`) stores one object per box it owns
   (`ShardWriter.write`), then `finish()` stores its fragment
   `step_S/_fragments/<save_id>/writer_<id>.json`: its boxes, their object keys, sizes, and
   the crc32 of each object, of each of its inner chunks and of its shard index;
2. one committer (`committer.commit`) waits for all `num_writers` fragments (timeout -> abort,
   nothing committed), checks that the boxes of every array tile it exactly, checks every object's
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
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import ShardSpec, encode_box
from meshtrain.services.checkpoint.nofollow import open_beneath
from meshtrain.services.checkpoint.store import (
    MANIFEST_NAME,
    Root,
    join,
    open_root,
    read_bytes,
    remove_tree,
    write_bytes_atomic,
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

    @classmethod
    def from_manifest(
        cls, root: Root, step: int, manifest: dict, manifest_bytes: int, seconds: float
    ) -> SaveResult:
        """The result a commit of `manifest` (of `manifest_bytes` bytes) reports."""
        entries = [o for a in manifest["arrays"].values() for o in a["objects"].values()]
        entries += list(manifest["objects"].values())
        return cls(
            url=root.step_url(step),
            step=step,
            num_arrays=len(manifest["arrays"]),
            num_objects=len(entries),
            bytes_written=manifest_bytes + sum(o["size"] for o in entries),
            seconds=seconds,
        )


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
    return SaveResult.from_manifest(root, step, manifest, len(data), 0.0)


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
