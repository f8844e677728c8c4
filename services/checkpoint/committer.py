"""The commit of a multi-writer save: step 2 of the protocol in `multiwriter`'s docstring.

`commit` waits for every writer's fragment, checks that the writers' boxes tile each array and
that every object is stored at the size its writer reported, writes the arrays' and the
group's zarr.json, and creates the step's manifest last: only if absent for a first save (two
committers racing on a step cannot both commit it), atomically over the old one for a save
that replaces a committed step. Then it removes what the manifest does not list.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import zarr
from zarr.storage import MemoryStore

from meshtrain.services.checkpoint.boxes import ArrayMeta, ShardSpec, check_tiling
from meshtrain.services.checkpoint.crc import checksum
from meshtrain.services.checkpoint.multiwriter import (
    CHECKSUM,
    CHUNK_CHECKSUMS,
    FORMAT,
    FORMAT_VERSION,
    FRAGMENTS,
    INDEX_CHECKSUM,
    MANIFEST_DIGEST,
    REPLACEMENTS,
    SaveResult,
    check_save_id,
    committed_by,
    committed_by_another,
    data_base,
    data_path,
    is_committed,
    is_replacement,
    manifest_digest,
    read_begun,
)
from meshtrain.services.checkpoint.nofollow import refuse_symlinks
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

log = logging.getLogger(__name__)


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
    fragments = _await_fragments(root, step, save_id, num_writers, timeout, poll, cancelled)
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

    arrays = _arrays_of(fragments)

    step_path = root.step_path(step)
    base = f"{REPLACEMENTS}/{save_id}" if replacing else ""
    folder = data_path(root, step, base)
    stored = _check_objects_stored(root, step, folder, arrays)

    manifest = _write_array_metadata(
        root, step, save_id, num_writers, metadata, base, folder, arrays
    )
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
    result = SaveResult.from_manifest(root, step, manifest, len(data), time.perf_counter() - start)
    log.info(
        "committed checkpoint %s: %d arrays, %d objects from %d writers, %.1f MB",
        result.url,
        result.num_arrays,
        result.num_objects,
        num_writers,
        result.bytes_written / 1e6,
    )
    return result


def _await_fragments(
    root: Root,
    step: int,
    save_id: str,
    num_writers: int,
    timeout: float,
    poll: float,
    cancelled: Callable[[], str | None] | None,
) -> dict[int, dict[str, Any]]:
    """Every writer's fragment of this save, polled for until all have reported: a
    CheckpointError when one reported an error, when `cancelled` gives a reason, when the
    timeout passes, or when a writer counted the writers differently."""
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
    return fragments


def _arrays_of(
    fragments: dict[int, dict[str, Any]],
) -> dict[str, tuple[ArrayMeta, list[ShardSpec], dict[str, dict[str, int]]]]:
    """Array name -> (its metadata, the writers' boxes, its objects' records), the boxes
    checked to tile each array exactly."""
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
    return arrays


def _check_objects_stored(root: Root, step: int, folder: str, arrays: dict) -> dict[str, int]:
    """The stored objects' sizes under the save's data folder, each array object checked to be
    there at the size its writer reported."""
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
    return stored


def _write_array_metadata(
    root: Root,
    step: int,
    save_id: str,
    num_writers: int,
    metadata: dict[str, Any],
    base: str,
    folder: str,
    arrays: dict,
) -> dict[str, Any]:
    """The group's and each array's zarr.json written (atomically), and the manifest that lists
    them with every object and its checksum, digest included: the commit writes it."""
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
    return manifest


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
