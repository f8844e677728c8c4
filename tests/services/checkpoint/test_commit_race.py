"""The commit is decided by storage: the manifest is created only if absent, so of committers
racing on one step (threads, processes; local disk, memory://, S3 on a real SeaweedFS) exactly
one commits, a twin committer of the same save returns the winner's result, and a committer of
another save gets a CheckpointError naming the save that won."""

import json
import threading
import uuid

import pytest
import torch

from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.multiwriter import ShardWriter, begin_save
from meshtrain.services.checkpoint.reader import load_checkpoint, read_manifest
from meshtrain.services.checkpoint.store import join, open_root, write_bytes_exclusive
from meshtrain.services.common.errors import CheckpointError
from tests.dist_utils import forkserver_context

RACERS = 6


def _race(fn, n: int) -> list:
    """Runs fn(i) on n threads released together; returns each result or exception."""
    barrier = threading.Barrier(n)
    out: list = [None] * n

    def run(i):
        barrier.wait()
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 -- the test inspects it
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _stage(root: str, step: int, save_id: str, value: float) -> None:
    """Stores one writer's box and fragment of save `save_id`: everything but the commit."""
    writer = ShardWriter(root, step, save_id, 0, 1)
    writer.write(ShardSpec("w", (4,), "float32", (0,), (4,)), torch.full((4,), value))
    writer.finish()


def test_exclusive_create_has_one_winner(root):
    r = open_root(root)
    for attempt in range(5):
        path = join(r.path, f"race_{attempt}", "manifest.json")
        won = _race(
            lambda i, path=path: write_bytes_exclusive(r, path, f"writer {i}".encode()), RACERS
        )
        assert sum(w is True for w in won) == 1, won
        assert all(w is False for w in won if w is not True), won
        assert r.fs.cat_file(path) == f"writer {won.index(True)}".encode()
    # no temporary file stays behind on disk
    assert sorted(p.rsplit("/", 1)[-1] for p in r.fs.find(r.path)) == ["manifest.json"] * 5


def test_two_saves_committing_one_step(root):
    # Two save ids of step 3 with all their fragments in (as two coordinators that each began
    # the step would have): racing commits, one wins, the other is told which save won.
    first = begin_save(root, 3)
    second = uuid.uuid4().hex
    _stage(root, 3, first, 1.0)
    _stage(root, 3, second, 1.0)
    ids = [first, second] * (RACERS // 2)
    results = _race(lambda i: commit(root, 3, ids[i], 1, {"by": ids[i]}, timeout=30), RACERS)
    manifest = read_manifest(root, 3)
    winner = manifest["save_id"]
    assert manifest["metadata"] == {"by": winner}
    for save_id, result in zip(ids, results):
        if save_id == winner:
            assert not isinstance(result, Exception), result
            assert result.step == 3
        else:
            assert isinstance(result, CheckpointError), result
            assert winner in str(result)
    state, _ = load_checkpoint(root, 3)
    assert torch.equal(state["w"], torch.ones(4))


def test_twin_committers_of_one_save_both_succeed(root):
    save_id = begin_save(root, 5)
    _stage(root, 5, save_id, 2.0)
    results = _race(lambda i: commit(root, 5, save_id, 1, {"n": 1}, timeout=30), RACERS)
    assert all(not isinstance(r, Exception) for r in results), results
    assert {r.url for r in results} == {open_root(root).step_url(5)}
    assert read_manifest(root, 5)["save_id"] == save_id
    assert torch.equal(load_checkpoint(root, 5)[0]["w"], torch.full((4,), 2.0))


def _commit_in_process(root: str, env: dict, save_id: str, start, queue) -> None:
    import os

    os.environ.update(env)
    start.wait()
    try:
        commit(root, 7, save_id, 1, {"by": save_id}, timeout=30)
        queue.put((save_id, "committed"))
    except CheckpointError as e:
        queue.put((save_id, f"refused: {e}"))
    except Exception as e:  # noqa: BLE001 -- shown by the test's assertion, not lost with the process
        queue.put((save_id, f"failed: {e!r}"))


def _process_race(root: str, env: dict) -> None:
    ids = [uuid.uuid4().hex for _ in range(4)]
    begin_save(root, 7)
    for save_id in ids:
        _stage(root, 7, save_id, 3.0)
    ctx = forkserver_context()  # forked with torch imported: a start is not a torch import
    start, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_commit_in_process, args=(root, env, s, start, queue)) for s in ids]
    for p in procs:
        p.start()
    start.set()
    outcomes = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    winner = read_manifest(root, 7)["save_id"]
    assert outcomes[winner] == "committed"
    losers = {s: o for s, o in outcomes.items() if s != winner}
    assert len(losers) == 3 and all(
        o.startswith("refused") and winner in o for o in losers.values()
    ), outcomes


@pytest.mark.dist
def test_processes_race_on_local_disk(tmp_path):
    _process_race(str(tmp_path / "ckpt"), {})


@pytest.mark.dist
def test_processes_race_on_s3(s3_root, s3_server):
    _process_race(s3_root, s3_server.env())


def test_threads_race_on_s3(s3_root):
    test_exclusive_create_has_one_winner(s3_root)
    test_two_saves_committing_one_step(s3_root)


def test_a_filesystem_without_atomic_create_is_refused(tmp_path):
    # A filesystem with no known create-if-absent (here: an fsspec "dir" wrapper) is refused,
    # naming the root, instead of committing with a race.
    root = f"dir::file://{tmp_path}/ckpt"
    r = open_root(root)
    with pytest.raises(CheckpointError, match="create-if-absent"):
        write_bytes_exclusive(r, join(r.path, "manifest.json"), json.dumps({}).encode())


def test_a_loser_whose_files_the_winner_cleared_is_told_the_winner(tmp_path, monkeypatch):
    """The race seen on S3 under load: a committer past its first look at the manifest reads
    fragments the winner's commit has just removed. It gets the winner named, not the
    FileNotFoundError of a fragment that is gone."""
    from meshtrain.services.checkpoint import committer, multiwriter

    root = str(tmp_path / "ckpt")
    winner, loser = begin_save(root, 9), uuid.uuid4().hex
    _stage(root, 9, winner, 1.0)
    _stage(root, 9, loser, 2.0)
    commit(root, 9, winner, 1, timeout=30)
    real, read = multiwriter.is_committed, []

    def is_committed(r, s):  # the loser's looks before its read came before the winner's manifest
        return bool(read) and real(r, s)

    def gone(*args):
        read.append(args)
        raise FileNotFoundError("fragment removed by the winner's commit")

    for module in (multiwriter, committer):  # the commit's own look, and `committed_by`'s
        monkeypatch.setattr(module, "is_committed", is_committed)
    monkeypatch.setattr(committer, "_read_fragments", gone)
    with pytest.raises(
        CheckpointError, match=f"already committed, by save '{winner}', not by save {loser}"
    ):
        commit(root, 9, loser, 1, timeout=30)
