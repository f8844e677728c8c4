"""Looking after a checkpoint root: delete a step, retention, collecting leftovers, verifying.

Retention keeps the last `keep_last` committed steps (the highest step numbers) and every step that
is a multiple of `keep_every`, and deletes the other committed ones, except steps the caller
protects (the trainer protects its own most recent commit: in a root that also holds an earlier
run's higher steps the policy alone would delete it); it also removes step folders that never
committed (crashed or aborted saves), except those of saves still in progress. A committed step is
deleted manifest first, so a crash half-way leaves an uncommitted folder (ignored by readers,
collected next time), never a manifest pointing at missing objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from meshtrain.services.checkpoint.multiwriter import abort_save, data_base, is_committed
from meshtrain.services.checkpoint.reader import list_checkpoints, read_manifest
from meshtrain.services.checkpoint.store import (
    MANIFEST_NAME,
    join,
    open_root,
    parse_step_dirname,
    remove_tree,
)
from meshtrain.services.checkpoint.verified import fetch_verified
from meshtrain.services.common.errors import CheckpointError


def delete_checkpoint(root: str, step: int) -> bool:
    """Deletes one step folder, committed or not.

    Args:
        root: root URL.
        step: the step.

    Returns:
        True when there was something to delete.
    """
    store_root = open_root(root)
    path = store_root.step_path(step)
    if is_committed(store_root, step):
        store_root.fs.rm(join(path, MANIFEST_NAME))  # uncommit first
    if not store_root.fs.exists(path):
        return False
    remove_tree(store_root, path)
    return True


def keep_every_needs_keep_last(keep_every: int, keep_last: int | None) -> str:
    """The refusal of a retention with keep_every but no keep_last (the CLI's, the service's)."""
    return (
        f"keep_every {keep_every} needs keep_last N with N >= 1 (got "
        f"{'none' if keep_last is None else keep_last}), or the newest checkpoints would be "
        "deleted too"
    )


def retained(steps: Iterable[int], keep_last: int, keep_every: int) -> set[int]:
    """Which committed steps a retention policy keeps.

    Args:
        steps: the committed steps.
        keep_last: keep the newest this many (0: no such rule).
        keep_every: keep steps that are multiples of this (0: no such rule).

    Returns:
        The kept steps. With both rules 0 everything is kept.

    Raises:
        CheckpointError: a negative setting.
    """
    if keep_last < 0 or keep_every < 0:
        raise CheckpointError(
            f"retention keep_last={keep_last} keep_every={keep_every}: both must be >= 0"
        )
    if keep_every and not keep_last:
        # alone it would delete every step that is not a multiple of K, the newest included
        raise CheckpointError(keep_every_needs_keep_last(keep_every, keep_last))
    steps = sorted(steps)
    if keep_last == 0 and keep_every == 0:
        return set(steps)
    kept = set(steps[-keep_last:]) if keep_last else set()
    if keep_every:
        kept.update(s for s in steps if s % keep_every == 0)
    return kept


@dataclass
class RetentionResult:
    """What `apply_retention` removed.

    Attributes:
        deleted: committed steps deleted by the policy.
        collected: uncommitted step folders removed (leftovers of crashed or aborted saves).
    """

    deleted: list[int] = field(default_factory=list)
    collected: list[int] = field(default_factory=list)


def apply_retention(
    root: str,
    keep_last: int,
    keep_every: int = 0,
    in_progress: Iterable[int] = (),
    guard: Callable[[int], AbstractContextManager[bool]] | None = None,
    collect: bool = True,
    protect: Iterable[int] = (),
) -> RetentionResult:
    """Applies a retention policy and collects uncommitted leftovers.

    Args:
        root: root URL.
        keep_last: keep the newest this many committed steps (0: no such rule).
        keep_every: also keep steps that are multiples of this (0: no such rule).
        in_progress: steps being saved right now; their folders are left alone.
        guard: `guard(step)` is entered around the collection of each leftover and yields
            whether a save of that step is in progress *now* (the checkpoint service holds its
            lock there, so no save of the step begins until the folder is gone).
        collect: also remove uncommitted step folders (off when saves of other processes may
            be in progress and nothing says which).
        protect: committed steps kept whatever the policy says (a run's own latest
            checkpoint, which an earlier run's higher steps would otherwise outrank).

    Returns:
        A RetentionResult.
    """
    store_root = open_root(root)
    committed = list_checkpoints(root)
    kept = retained(committed, keep_last, keep_every) | set(protect)
    result = RetentionResult()
    for step in committed:
        if step not in kept and delete_checkpoint(root, step):
            result.deleted.append(step)
    if not collect:
        return result
    busy = set(in_progress)
    store_root.fs.invalidate_cache(store_root.path)
    try:
        entries = store_root.fs.ls(store_root.path, detail=False)
    except FileNotFoundError:
        entries = []
    for entry in entries:
        stray = parse_step_dirname(entry.rstrip("/").rsplit("/", 1)[-1])
        if stray is None or stray in busy or stray in committed:
            continue
        with guard(stray) if guard is not None else contextlib.nullcontext(False) as now_busy:
            # abort_save never removes a committed step (one may have committed meanwhile)
            if not now_busy and abort_save(store_root, stray):
                result.collected.append(stray)
    result.collected.sort()
    return result


def verify_checkpoint(root: str, step: int) -> int:
    """Reads every object a checkpoint's manifest lists and checks its size and checksums.

    Shards are checked whole and chunk by chunk (the per-chunk checksums partial reads use).

    Args:
        root: root URL.
        step: the step.

    Returns:
        The number of objects verified.

    Raises:
        CheckpointError: the step is not committed, or an object is missing or corrupt
            (naming the array and object).
    """
    store_root = open_root(root)
    manifest = read_manifest(root, step)
    listed = [("", key, manifest["objects"]) for key in manifest["objects"]]
    for name, entry in manifest["arrays"].items():
        listed += [(name, key, entry["objects"]) for key in entry["objects"]]
    base = data_base(manifest)
    for array, key, objects in listed:
        fetch_verified(store_root, step, array, objects, key, chunks=True, base=base)
    return len(listed)
