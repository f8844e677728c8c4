"""Saves that fill their disk, on a real small filesystem (a tmpfs; skipped where it cannot be
mounted): the failure is lasting (tried `attempts` times, not for the retry time), names the
full disk, leaves the previous commit loadable and, writing storage directly, nothing behind."""

import errno
import logging
import os
import time

import pytest
import torch

from meshtrain.services.checkpoint.async_save import AsyncSaver, StorageSink, retry
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.multiwriter import begin_save
from meshtrain.services.checkpoint.reader import list_checkpoints, read_box
from meshtrain.services.common.errors import DiskFullError, is_lasting_storage_error
from tests.services.checkpoint.rpc_helpers import running_service
from tests.small_disk import fill, free_bytes, small_disk


def boxes_of(t, name="layers.mlp.fc1.weight"):
    """One box per layer of a stacked (layers, rows, cols) tensor."""
    return [
        (ShardSpec(name, tuple(t.shape), "float32", (i, 0, 0), (1, *t.shape[1:])), t[i : i + 1])
        for i in range(t.shape[0])
    ]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_full_disk_is_lasting_tried_the_attempts_not_the_retry_time(code):
    # A full disk was an outage to wait out: a save into it was retried for
    # checkpoint.save_retry_timeout_s (60 s) and, past it, failed like any other error. Each try
    # only writes the same bytes into the same full disk again.
    calls = []

    def write():
        calls.append(1)
        raise OSError(code, os.strerror(code), "/ckpt/step_00000002/w/c/0")

    start = time.monotonic()
    with pytest.raises(
        DiskFullError, match=rf"storing failed after 3 attempts: disk full: .*{os.strerror(code)}"
    ) as info:
        retry("storing", write, attempts=3, backoff=0.001, timeout=60.0)
    assert len(calls) == 3 and time.monotonic() - start < 5
    assert is_lasting_storage_error(info.value)  # a service answering it marks it lasting likewise


def test_a_save_that_fills_the_disk_fails_at_once_and_removes_what_it_stored(tmp_path, caplog):
    with small_disk(tmp_path / "disk", 4) as disk:
        root = str(disk / "ckpt")
        first = torch.randn(2, 64, 64)
        saver = AsyncSaver(StorageSink(root), attempts=3, backoff=0.01, retry_timeout=3600)
        saver.save(1, begin_save(root, 1), boxes_of(first), committer=True, metadata={})
        saver.wait()
        before = free_bytes(disk)
        big = torch.randn(8, 256, 256)  # 2 MB: the first boxes fit, a later one fills the disk
        fill(disk, 1 << 20)
        start = time.monotonic()
        saver.save(2, begin_save(root, 2), boxes_of(big), committer=True, metadata={})
        with (
            caplog.at_level(logging.WARNING),
            pytest.raises(
                DiskFullError,
                match=r"\(step 2\) failed after 3 attempts: disk full: "
                r".*No space left on device",
            ),
        ):
            saver.wait()  # an hour's retry_timeout would hold this for an hour
        assert time.monotonic() - start < 30
        retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
        assert len(retries) == 2 and all("(step 2)" in m for m in retries), (
            retries
        )  # 3 attempts: 2 retries
        assert not os.path.exists(os.path.join(root, "step_00000002"))  # nothing of it stays behind
        (disk / "filler").unlink()
        assert free_bytes(disk) == before  # every byte of the failed save is free again
        assert list_checkpoints(root) == [1]
        assert torch.equal(
            read_box(root, 1, "layers.mlp.fc1.weight", (0, 0, 0), (2, 64, 64)), first
        )
        saver.save(3, begin_save(root, 3), boxes_of(big), committer=True, metadata={})  # room again
        assert saver.wait().step == 3
        saver.close()
        assert list_checkpoints(root) == [1, 3]


def test_a_service_whose_disk_is_full_answers_a_lasting_error_the_saver_does_not_retry(tmp_path):
    # The service answers UNAVAILABLE (storage failing), marked lasting: the trainer's saver
    # tries it its attempts, not for its retry time, and reports it as disk full. The service
    # reclaims what the failed save stored (the trainer's saver cannot: the storage is the
    # service's), so the disk is not kept full and the next save fits, with the filler still in.
    with small_disk(tmp_path / "disk", 4) as disk:
        root = str(disk / "ckpt")
        with running_service(root) as (client, _):
            saver = AsyncSaver(
                client, 0, 1, attempts=3, backoff=0.01, commit_timeout=5, retry_timeout=3600
            )
            saver.save(
                1,
                client.begin_save(1),
                boxes_of(torch.randn(2, 64, 64)),
                committer=True,
                metadata={},
            )
            saver.wait()
            fill(disk, 1 << 20)
            before = free_bytes(disk)
            start = time.monotonic()
            saver.save(
                2,
                client.begin_save(2),
                boxes_of(torch.randn(8, 256, 256)),
                committer=True,
                metadata={},
            )
            with pytest.raises(
                DiskFullError,
                match=rf"failed after 3 attempts: disk full: .*UNAVAILABLE: checkpoint "
                rf"storage {root} failed: OSError: .*No space left on device",
            ):
                saver.wait()
            assert time.monotonic() - start < 30
            assert client.list() == [1]
            assert not os.path.exists(os.path.join(root, "step_00000002"))
            assert free_bytes(disk) == before  # every byte of the failed save is free again
            saver.save(
                3,
                client.begin_save(3),
                boxes_of(torch.randn(2, 64, 64)),
                committer=True,
                metadata={},
            )
            assert saver.wait().step == 3
            saver.close()
            assert client.list() == [1, 3]
