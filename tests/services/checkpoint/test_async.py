"""Async saves: the snapshot is taken before save() returns, uploads run behind,
failures surface."""

import shutil
import threading

import pytest
import torch

from meshtrain.services.checkpoint.async_save import AsyncSaver, StorageSink, retry
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.multiwriter import ShardWriter, begin_save
from meshtrain.services.checkpoint.reader import list_checkpoints, read_box
from meshtrain.services.common.errors import CheckpointError


def boxes_of(t, name="layers.mlp.fc1.weight"):
    """One box per layer of a stacked (layers, rows, cols) tensor."""
    return [
        (ShardSpec(name, tuple(t.shape), "float32", (i, 0, 0), (1, *t.shape[1:])), t[i : i + 1])
        for i in range(t.shape[0])
    ]


def test_snapshot_is_taken_before_save_returns(root):
    weights = torch.randn(3, 4, 5)
    saver = AsyncSaver(StorageSink(root))
    saver.save(1, begin_save(root, 1), boxes_of(weights), committer=True, metadata={"it": 1})
    expected = weights.clone()
    weights.add_(1.0)  # training continues and mutates the parameters in place
    result = saver.wait()
    assert result.step == 1 and list_checkpoints(root) == [1]
    assert torch.equal(read_box(root, 1, "layers.mlp.fc1.weight", (0, 0, 0), (3, 4, 5)), expected)
    assert saver.last_stall_s >= 0
    saver.close()


def test_buffers_are_reused_and_saves_are_serialised(root):
    weights = torch.randn(2, 4, 5)
    saver = AsyncSaver(StorageSink(root))
    saver.save(1, begin_save(root, 1), boxes_of(weights), committer=True)
    first = dict(saver._buffers)
    weights.mul_(2)
    saver.save(2, begin_save(root, 2), boxes_of(weights), committer=True)  # waits for step 1
    assert all(saver._buffers[k] is v for k, v in first.items())  # same host memory
    saver.close()
    assert list_checkpoints(root) == [1, 2]
    assert torch.equal(read_box(root, 2, "layers.mlp.fc1.weight", (0, 0, 0), (2, 4, 5)), weights)


def test_prepared_buffers_are_the_ones_the_first_save_fills(root):
    weights = torch.randn(3, 4, 5)
    boxes = boxes_of(weights)
    saver = AsyncSaver(StorageSink(root))
    saver.prepare([spec for spec, _ in boxes[:2]])  # the third box is not announced
    saver._preparing.join()
    prepared = dict(saver._buffers)
    assert len(prepared) == 2 and saver.prepared_s is not None
    saver.save(1, begin_save(root, 1), boxes, committer=True)
    assert all(saver._buffers[k] is v for k, v in prepared.items())
    assert len(saver._buffers) == 3  # the unannounced box got its buffer at the save
    saver.close()
    assert torch.equal(read_box(root, 1, "layers.mlp.fc1.weight", (0, 0, 0), (3, 4, 5)), weights)
    with pytest.raises(CheckpointError, match="already called"):
        saver.prepare([])


def test_a_failed_prepare_leaves_the_save_to_allocate(root, caplog, monkeypatch):
    weights = torch.randn(2, 4, 5)
    boxes = boxes_of(weights)
    empty = torch.empty

    def out_of_pinned_memory(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (pinned host allocation)")

    saver = AsyncSaver(StorageSink(root))
    monkeypatch.setattr(torch, "empty", out_of_pinned_memory)
    saver.prepare([spec for spec, _ in boxes])
    saver._preparing.join()
    monkeypatch.setattr(torch, "empty", empty)
    assert saver._buffers == {}
    saver.save(1, begin_save(root, 1), boxes, committer=True)
    saver.close()
    assert "preparing the checkpoint buffers failed" in caplog.text
    assert torch.equal(read_box(root, 1, "layers.mlp.fc1.weight", (0, 0, 0), (2, 4, 5)), weights)


def test_two_async_writers_and_a_committer(root):
    full = torch.randn(2, 6, 3)
    save_id = begin_save(root, 4)
    savers = [
        AsyncSaver(StorageSink(root), writer_id=w, num_writers=2, commit_timeout=20)
        for w in range(2)
    ]
    for w, saver in enumerate(savers):
        boxes = [
            (
                ShardSpec("layers.w", (2, 6, 3), "float32", (i, 3 * w, 0), (1, 3, 3)),
                full[i : i + 1, 3 * w : 3 * w + 3],
            )
            for i in range(2)
        ]
        saver.save(4, save_id, boxes, committer=(w == 0), metadata={"w": 2})
    assert savers[1].wait() is None and savers[0].wait().num_arrays == 1
    assert torch.equal(read_box(root, 4, "layers.w", (0, 0, 0), (2, 6, 3)), full)


class FlakySink(StorageSink):
    """Storage that fails the first `failures` object writes, like a dropped connection."""

    def __init__(self, root, failures):
        super().__init__(root)
        self.failures = failures
        self.lock = threading.Lock()

    def writer(self, step, save_id, writer_id, num_writers):
        real = super().writer(step, save_id, writer_id, num_writers)
        sink = self

        class Flaky(ShardWriter):
            def __init__(self):
                self.__dict__.update(real.__dict__)

            def write(self, spec, data):
                with sink.lock:
                    if sink.failures > 0:
                        sink.failures -= 1
                        raise ConnectionError("connection reset by peer")
                return super().write(spec, data)

        return Flaky()


def test_failed_upload_is_retried(root):
    saver = AsyncSaver(FlakySink(root, failures=2), attempts=3, backoff=0.01)
    saver.save(1, begin_save(root, 1), boxes_of(torch.ones(2, 2, 2)), committer=True)
    assert saver.wait().step == 1
    saver.close()


def test_failed_upload_is_raised_on_next_call_never_dropped(root):
    saver = AsyncSaver(FlakySink(root, failures=100), attempts=2, backoff=0.01)
    saver.save(1, begin_save(root, 1), boxes_of(torch.ones(2, 2, 2)), committer=True)
    with pytest.raises(
        CheckpointError,
        match=r"storing box \(0, 0, 0\) of array "
        r"'layers.mlp.fc1.weight' \(step 1\) failed after 2 attempts",
    ):
        saver.save(2, begin_save(root, 2), boxes_of(torch.ones(2, 2, 2)), committer=True)
    assert list_checkpoints(root) == []
    saver.close()


def test_tensor_that_does_not_match_its_box_is_rejected(root):
    saver = AsyncSaver(StorageSink(root))
    spec = ShardSpec("w", (4,), "float32", (0,), (4,))
    with pytest.raises(
        CheckpointError, match=r"array 'w' \(float32\) got a tensor of shape \(3,\)"
    ):
        saver.save(1, "id", [(spec, torch.ones(3))])
    with pytest.raises(CheckpointError, match="dtype torch.float16"):
        saver.save(1, "id", [(spec, torch.ones(4, dtype=torch.float16))])
    saver.close()


@pytest.mark.parametrize(
    "error",
    [
        NotADirectoryError(20, "Not a directory", "/ckpt/step_00000001"),
        PermissionError(13, "Permission denied", "/ckpt"),
        OSError(30, "Read-only file system", "/ckpt"),
    ],
)
def test_an_error_a_retry_cannot_fix_is_tried_attempts_times_not_for_the_retry_time(error):
    # save_retry_timeout_s (60 s by default) is there to wait out a restarting service or a
    # network outage. A checkpoint root that became a file, a read-only mount or a denied
    # bucket fail the same way every time: retrying them for a minute only delayed the error
    # (and held rank 0's begin_save, which is synchronous, for that minute).
    calls = []

    def fail():
        calls.append(1)
        raise error

    with pytest.raises(CheckpointError, match="failed after 2 attempts"):
        retry("storing", fail, attempts=2, backoff=0.001, timeout=60.0)
    assert len(calls) == 2


def test_an_outage_is_retried_past_the_attempts_for_the_retry_time():
    calls = []

    def fail():
        calls.append(1)
        raise ConnectionError("connection refused")

    with pytest.raises(CheckpointError, match="failed after"):
        retry("storing", fail, attempts=2, backoff=0.001, timeout=0.3)
    assert len(calls) > 2


def test_a_save_to_a_root_that_became_a_file_fails_without_waiting_out_the_retry_time(tmp_path):
    root = str(tmp_path / "ckpt")
    saver = AsyncSaver(StorageSink(root), attempts=2, backoff=0.01, retry_timeout=3600)
    save_id = begin_save(root, 1)
    shutil.rmtree(root, ignore_errors=True)
    open(root, "w").close()
    saver.save(1, save_id, boxes_of(torch.ones(2, 2, 2)), committer=True)
    with pytest.raises(CheckpointError, match="failed after 2 attempts: NotADirectoryError"):
        saver.wait()  # an hour's retry_timeout would hold this for an hour
    saver.close()
