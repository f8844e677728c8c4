"""Retention racing saves, and the service's in-flight byte budget waiting on a caller that left."""

import contextlib
import threading
import time

import pytest
import torch

from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.maintenance import apply_retention
from meshtrain.services.checkpoint.multiwriter import ShardWriter, begin_save
from meshtrain.services.checkpoint.reader import list_checkpoints, read_box
from meshtrain.services.checkpoint.rpc.limits import ByteBudget
from meshtrain.services.common.errors import CheckpointError

W = ShardSpec("w", (2,), "float32", (0,), (2,))


def _write(root, step):
    save_id = begin_save(root, step)
    writer = ShardWriter(root, step, save_id, 0, 1)
    writer.write(W, torch.full((2,), float(step)))
    writer.finish()
    return save_id


def test_a_leftover_that_commits_while_retention_runs_is_not_collected(tmp_path):
    root = str(tmp_path / "ckpt")
    save_id = _write(
        root, 10
    )  # written, not yet committed: it looks like a crashed save's leftover

    @contextlib.contextmanager
    def commit_lands_now(step):  # the commit lands between retention's listing and its delete
        commit(root, step, save_id, 1, {})
        yield False

    result = apply_retention(root, keep_last=5, guard=commit_lands_now)
    assert result.collected == [] and list_checkpoints(root) == [10]
    assert read_box(root, 10, "w", (0,), (2,)).tolist() == [10.0, 10.0]


def test_retention_leaves_a_step_the_guard_says_is_being_saved(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 11)
    _write(root, 12)

    @contextlib.contextmanager
    def busy(step):
        yield step == 11  # a save of step 11 began after retention listed the folders

    assert apply_retention(root, keep_last=5, guard=busy).collected == [12]


def test_a_caller_that_goes_away_stops_waiting_for_the_budget():
    budget = ByteBudget(100)
    budget.acquire(100, "first")
    active = threading.Event()
    active.set()
    errors = []

    def second():
        try:
            budget.acquire(10, "box (0,) of array 'w'", active.is_set)
        except CheckpointError as e:
            errors.append(str(e))

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # waiting while its caller is there
    active.clear()  # cancelled / past its deadline
    waiter.join(timeout=5)
    assert not waiter.is_alive() and "caller went away" in errors[0]
    budget.release(100)
    budget.acquire(100, "after")  # nothing was leaked
    assert budget.used == 100


@pytest.mark.timeout(60)
def test_a_box_claiming_a_huge_array_fails_fast_on_its_holes(tmp_path):
    # 4 bytes of data claiming 10^9 grid cells: the commit counts the holes, it does not list them
    root = str(tmp_path / "ckpt")
    save_id = begin_save(root, 1)
    writer = ShardWriter(root, 1, save_id, 0, 1)
    writer.write(ShardSpec("w", (10**9,), "float32", (0,), (1,)), torch.ones(1))
    writer.finish()
    with pytest.raises(CheckpointError, match=r"999999999 of 1000000000 boxes"):
        commit(root, 1, save_id, 1, {})


def test_commit_is_idempotent_for_its_own_save_and_refuses_another(tmp_path):
    root = str(tmp_path / "ckpt")
    save_id = _write(root, 7)
    first = commit(root, 7, save_id, 1, {})
    again = commit(root, 7, save_id, 1, {}, timeout=1)  # a retry after the first succeeded
    assert (again.url, again.num_objects, again.bytes_written) == (
        first.url,
        first.num_objects,
        first.bytes_written,
    )
    with pytest.raises(CheckpointError, match="already committed"):
        commit(root, 7, "another-save", 1, {}, timeout=1)


def test_retention_keeps_a_protected_step_the_policy_would_delete(tmp_path):
    # An earlier run's higher steps outrank a new run's step 100 (saved with overwrite): the
    # policy alone deleted it, leaving the new run no checkpoint of its own.
    root = str(tmp_path / "ckpt")
    for step in (100, 200, 300):
        commit(root, step, _write(root, step), 1, {})
    result = apply_retention(root, keep_last=1, protect=[100])
    assert result.deleted == [200] and list_checkpoints(root) == [100, 300]
