"""A save that replaces a committed step (`overwrite`) never loses it.

The committed step stays loadable while the replacement is written, when it fails, is aborted
or its writer dies, and at every point of its commit a crash can stop; the replacement's
manifest, written over the old one in one atomic write, is the switch. Each test checks what a
reader sees afterwards: exactly one of the two checkpoints, whole.
"""

import pytest
import torch

from meshtrain.services.checkpoint import committer
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.maintenance import verify_checkpoint
from meshtrain.services.checkpoint.multiwriter import (
    REPLACEMENTS,
    ShardWriter,
    abort_save,
    begin_save,
)
from meshtrain.services.checkpoint.reader import list_checkpoints, load_checkpoint, read_manifest
from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.errors import CheckpointError

OLD = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2)}
NEW = {"w": torch.arange(6, dtype=torch.float32) * -1, "v": torch.zeros(3, dtype=torch.int32)}


class Killed(BaseException):
    """Stands for the process dying at that point: nothing after it runs, no handler cleans up."""


def _write(root, step, save_id, state, writer_id=0, num_writers=1):
    writer = ShardWriter(root, step, save_id, writer_id, num_writers)
    for name, tensor in state.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = tuple(tensor.shape)
        writer.write(ShardSpec(name, shape, dtype, (0,) * len(shape), shape), tensor)
    writer.finish()


def _assert_holds(root, step, state, meta):
    assert list_checkpoints(root) == [step]
    tensors, metadata = load_checkpoint(root, step)
    assert metadata == meta and set(tensors) == set(state)
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name
    assert verify_checkpoint(root, step) > 0


def _folder_names(root, step):
    """The top-level names of the objects in the step's folder (object stores, and SeaweedFS's
    filer, may list emptied folders: what counts is what holds objects)."""
    r = open_root(root)
    r.fs.invalidate_cache(r.step_path(step))
    prefix = r.step_path(step).rstrip("/") + "/"
    return sorted({p[len(prefix) :].split("/", 1)[0] for p in r.fs.find(r.step_path(step))})


@pytest.fixture
def committed(root):
    save_checkpoint(root, 1, OLD, {"v": "old"})
    return root


def test_the_committed_step_stays_while_a_replacement_is_written_and_after_it_is_aborted(
    committed,
):
    root = committed
    save_id = begin_save(root, 1, overwrite=True)
    _assert_holds(root, 1, OLD, {"v": "old"})  # begun: nothing of the old step removed
    _write(root, 1, save_id, NEW)
    _assert_holds(root, 1, OLD, {"v": "old"})  # written, not committed
    assert abort_save(root, 1, save_id)  # a failed replacement's objects are reclaimed ...
    assert _folder_names(root, 1) == sorted(["b", "manifest.json", "w", "zarr.json"])
    _assert_holds(root, 1, OLD, {"v": "old"})  # ... and the committed step is what remains
    assert not abort_save(root, 1)  # never a committed step's own


def test_a_replacement_commits_atomically_and_leaves_only_its_own_arrays(committed):
    root = committed
    save_id = begin_save(root, 1, overwrite=True)
    _write(root, 1, save_id, NEW)
    result = commit(root, 1, save_id, 1, {"v": "new"})
    assert result.step == 1 and result.num_arrays == 2
    _assert_holds(root, 1, NEW, {"v": "new"})
    manifest = read_manifest(root, 1)
    assert manifest["save_id"] == save_id and manifest["data"] == f"{REPLACEMENTS}/{save_id}"
    assert _folder_names(root, 1) == [REPLACEMENTS, "manifest.json"]  # old arrays, fragments gone
    # a retried commit of the same save answers with its result, and changes nothing
    assert commit(root, 1, save_id, 1, {"v": "new"}).step == 1
    # replaced again: the first replacement's folder goes with its arrays
    again = begin_save(root, 1, overwrite=True)
    _write(root, 1, again, OLD)
    commit(root, 1, again, 1, {"v": "third"})
    _assert_holds(root, 1, OLD, {"v": "third"})
    r = open_root(root)
    under = [p.split("/_next/", 1)[1] for p in r.fs.find(r.step_path(1)) if "/_next/" in p]
    assert {p.split("/")[0] for p in under} == {again}


def test_save_checkpoint_with_overwrite_replaces_the_step(committed):
    save_checkpoint(committed, 1, NEW, {"v": "new"}, overwrite=True)
    _assert_holds(committed, 1, NEW, {"v": "new"})


@pytest.mark.parametrize(
    "where, survivor",
    [
        ("array metadata", "old"),  # killed while writing the replacement's zarr.json files
        ("manifest", "old"),  # killed just before the manifest's atomic write
        ("cleanup", "new"),  # killed after it, before the replaced arrays were removed
    ],
)
def test_a_kill_at_any_point_of_the_commit_leaves_exactly_one_of_the_two(
    committed, monkeypatch, where, survivor
):
    root = committed
    save_id = begin_save(root, 1, overwrite=True)
    _write(root, 1, save_id, NEW)
    real_write = committer.write_bytes_atomic

    def dying_write(r, path, data):
        if where == "array metadata" and path.endswith("zarr.json"):
            raise Killed
        if where == "manifest" and path.endswith("manifest.json"):
            raise Killed
        real_write(r, path, data)

    def dying_cleanup(*args):
        raise Killed

    monkeypatch.setattr(committer, "write_bytes_atomic", dying_write)
    monkeypatch.setattr(committer, "_remove_replaced", dying_cleanup)
    with pytest.raises(Killed):
        commit(root, 1, save_id, 1, {"v": "new"})
    monkeypatch.undo()
    if survivor == "old":
        _assert_holds(root, 1, OLD, {"v": "old"})
    else:
        _assert_holds(root, 1, NEW, {"v": "new"})
    # the next save of the step, replacing whichever survived, clears what the dead one left
    later = begin_save(root, 1, overwrite=True)
    _write(root, 1, later, {"z": torch.ones(1)})
    commit(root, 1, later, 1, {"v": "later"})
    _assert_holds(root, 1, {"z": torch.ones(1)}, {"v": "later"})
    assert _folder_names(root, 1) == [REPLACEMENTS, "manifest.json"]


def test_a_newer_save_supersedes_an_unfinished_replacement(committed):
    root = committed
    first = begin_save(root, 1, overwrite=True)
    _write(root, 1, first, NEW)
    second = begin_save(root, 1, overwrite=True)  # the trainer restarted mid-save
    with pytest.raises(CheckpointError):
        commit(root, 1, first, 1, {"v": "first"}, timeout=0.2)
    _assert_holds(root, 1, OLD, {"v": "old"})
    _write(root, 1, second, NEW)
    commit(root, 1, second, 1, {"v": "second"})
    _assert_holds(root, 1, NEW, {"v": "second"})


def test_a_save_not_begun_to_replace_cannot_write_into_a_committed_step(committed):
    save_id = begin_save(committed, 2)
    with pytest.raises(CheckpointError, match="already committed"):
        _write(committed, 1, save_id, NEW)
    _assert_holds(committed, 1, OLD, {"v": "old"})


def test_an_aborted_overwrite_through_the_service_keeps_the_step(service):
    """The service's admin BeginSave(overwrite=true) used to delete the committed step at
    begin: a save then given up, or whose client died, left List empty."""
    root, client, _ = service
    save_checkpoint(root, 1, OLD, {"v": "old"})
    save_id = client.begin_save(1, num_writers=1, overwrite=True)
    assert client.list() == [1]
    writer = client.writer(1, save_id, 0, 1)
    writer.write(ShardSpec("w", (6,), "float32", (0,), (6,)), NEW["w"])
    writer.finish()
    client.abort_save(save_id, "given up")
    assert client.list() == [1]
    _assert_holds(root, 1, OLD, {"v": "old"})
    # the same through to its commit replaces the step
    save_id = client.begin_save(1, num_writers=1, overwrite=True)
    writer = client.writer(1, save_id, 0, 1)
    writer.write(ShardSpec("w", (6,), "float32", (0,), (6,)), NEW["w"])
    writer.finish()
    client.commit(1, save_id, 1, {"v": "new"})
    _assert_holds(root, 1, {"w": NEW["w"]}, {"v": "new"})


@pytest.mark.slow
def test_replacement_on_s3(s3_root):
    save_checkpoint(s3_root, 1, OLD, {"v": "old"})
    save_id = begin_save(s3_root, 1, overwrite=True)
    _write(s3_root, 1, save_id, NEW)
    _assert_holds(s3_root, 1, OLD, {"v": "old"})
    commit(s3_root, 1, save_id, 1, {"v": "new"})
    _assert_holds(s3_root, 1, NEW, {"v": "new"})
    assert _folder_names(s3_root, 1) == [REPLACEMENTS, "manifest.json"]
