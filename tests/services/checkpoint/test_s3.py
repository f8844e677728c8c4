"""The same checkpoints on a real S3-compatible server (SeaweedFS on loopback)."""

import json

import pytest
import torch

from meshtrain.services.checkpoint.async_save import AsyncSaver, StorageSink
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.multiwriter import ShardWriter, begin_save
from meshtrain.services.checkpoint.reader import (
    list_checkpoints,
    load_checkpoint,
    read_box,
    read_manifest,
)
from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.errors import CheckpointError
from tests.services.checkpoint.conftest import assert_same, toy_model_state


def test_round_trip_on_s3(s3_root, s3_server):
    state = toy_model_state()
    save_checkpoint(s3_root, 3, state, {"iteration": 3})
    loaded, metadata = load_checkpoint(s3_root)
    assert_same(loaded, state)
    assert metadata == {"iteration": 3} and list_checkpoints(s3_root) == [3]
    # credentials and endpoint stay in the environment, never in the checkpoint
    r = open_root(s3_root)
    for path in r.fs.find(r.path):
        data = r.fs.cat_file(path)
        assert s3_server.env()["AWS_SECRET_ACCESS_KEY"].encode() not in data, path
        assert s3_server.endpoint.encode() not in data, path


def test_two_writers_and_async_on_s3(s3_root):
    full = torch.randn(2, 8, 4)
    save_id = begin_save(s3_root, 1)
    savers = [AsyncSaver(StorageSink(s3_root), w, 2, commit_timeout=30) for w in range(2)]
    for w, saver in enumerate(savers):
        boxes = [
            (
                ShardSpec("layers.w", (2, 8, 4), "float32", (i, 4 * w, 0), (1, 4, 4)),
                full[i : i + 1, 4 * w : 4 * w + 4],
            )
            for i in range(2)
        ]
        saver.save(1, save_id, boxes, committer=(w == 0))
    savers[1].close()
    assert savers[0].wait().num_arrays == 1
    savers[0].close()
    # a resharded read that crosses the writers' boundary
    assert torch.equal(read_box(s3_root, 1, "layers.w", (1, 2, 0), (1, 4, 4)), full[1:2, 2:6])


def test_uncommitted_save_is_not_listed_on_s3(s3_root):
    save_checkpoint(s3_root, 1, {"w": torch.ones(3)})
    save_id = begin_save(s3_root, 2)
    writer = ShardWriter(s3_root, 2, save_id, 0, 2)
    writer.write(ShardSpec("w", (3,), "float32", (0,), (3,)), torch.zeros(3))
    writer.finish()
    with pytest.raises(CheckpointError, match=r"writers \[1\] did not report"):
        commit(s3_root, 2, save_id, 2, timeout=0.5)
    assert list_checkpoints(s3_root) == [1]


def test_flipped_byte_on_s3_names_array_and_object(s3_root):
    save_checkpoint(s3_root, 1, {"layers.0.w": torch.ones(4), "layers.1.w": torch.ones(4)})
    r = open_root(s3_root)
    path = r.step_path(1) + "/layers.w/c/1/0"
    data = bytearray(r.fs.cat_file(path))
    data[3] ^= 0x10
    r.fs.pipe_file(path, bytes(data))
    with pytest.raises(CheckpointError, match=r"array 'layers.w' object 'c/1/0' .* is corrupt"):
        load_checkpoint(s3_root, 1)
    assert json.loads(r.fs.cat_file(r.step_path(1) + "/manifest.json"))["step"] == 1
    assert read_manifest(s3_root, 1)["arrays"]["layers.w"]["layer_count"] == 2
