"""The CheckpointService over real gRPC on loopback when something fails: a service too busy
to take a stream now, a bug in a handler, storage errors, a writer that stalls, a run that
gives its save up, a service restarted between a commit and its reply."""

import os
import re
import shutil

import grpc
import pytest
import torch

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.services.checkpoint import multiwriter
from meshtrain.services.checkpoint.async_save import AsyncSaver
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.rpc.client import CheckpointClient, box_to_pb
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.errors import CheckpointError, MeshtrainError
from tests.services.checkpoint.rpc_helpers import (
    held_slot,
    running_service,
    tp_boxes,
    written_save,
)


def test_a_restarted_service_answers_the_retry_of_a_commit_that_had_landed(tmp_path):
    """The service commits, then dies before its reply reaches the client; `meshtrain up` starts
    it again on its port, and the client's retry of Commit meets a service that forgot the save
    id. It used to answer NOT_FOUND (a permanent error: the run failed over a save that was
    committed); with the step in the request it finds the commit, made by this save id, in the
    manifest and answers with it."""
    root = str(tmp_path / "ckpt")
    full = torch.randn(3, 16, 8).to(torch.bfloat16)
    with running_service(root) as (client, _):
        save_id = client.begin_save(5)
        saver = AsyncSaver(client, 0, 1)
        saver.save(5, save_id, tp_boxes(full, 0, 1), committer=True)
        first = saver.wait()
    with running_service(root) as (restarted, _):  # the same root, nothing in memory
        again = restarted.commit(5, save_id, 1)
        assert (
            again.url,
            again.step,
            again.num_arrays,
            again.num_objects,
            again.bytes_written,
        ) == (first.url, first.step, first.num_arrays, first.num_objects, first.bytes_written)
        with pytest.raises(CheckpointError, match="NOT_FOUND: unknown save id"):
            restarted.commit(5, "0123abcd", 1)  # another save's retry: step 5 is not its commit
        with pytest.raises(CheckpointError, match="NOT_FOUND: unknown save id"):
            restarted.commit(6, save_id, 1)  # nothing committed at that step


def test_a_writer_the_service_cannot_take_now_is_retried_not_failed(tmp_path):
    # One stream slot, held by another save's slow stream: the writer gets RESOURCE_EXHAUSTED,
    # which is transient, so AsyncSaver's retry waits for the slot (it used to be a
    # CheckpointError, which is never retried, and the save failed).
    root = str(tmp_path / "ckpt")
    with running_service(root, max_streams=1, commit_timeout=10) as (client, _):
        other, mine = client.begin_save(99, num_writers=1), client.begin_save(3, num_writers=1)
        with held_slot(client, other, 1.5):
            saver = AsyncSaver(client, 0, 1, attempts=6, backoff=0.3, commit_timeout=10)
            full = torch.randn(2, 8, 4).to(torch.bfloat16)
            saver.save(3, mine, tp_boxes(full, 0, 1), committer=True, metadata={})
            assert saver.wait().step == 3


def test_a_read_the_service_cannot_take_now_is_unavailable_not_refused(tmp_path):
    # A response stream fails while it is read, past `_call`: read_box turned every failure
    # into a CheckpointError (never retried), also "all stream slots in use".
    from meshtrain.services.checkpoint.rpc.client import ServiceUnavailableError

    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 2, {"w": torch.ones(4)})
    with running_service(root, max_streams=1, commit_timeout=10) as (client, _):
        save_id = client.begin_save(3, num_writers=1)
        with (
            held_slot(client, save_id, 1.0),
            pytest.raises(ServiceUnavailableError, match="RESOURCE_EXHAUSTED: all 1 stream slots"),
        ):
            client.read_box(2, "w", (0,), (4,))
        assert torch.equal(client.read_box(2, "w", (0,), (4,)), torch.ones(4))
        with pytest.raises(CheckpointError, match="no array 'missing'"):  # still a refusal
            client.read_box(2, "missing", (0,), (1,))


def test_a_bug_in_a_handler_is_not_retried(service, monkeypatch):
    # An exception the servicer does not map (a bug) reaches the client as UNKNOWN "Exception
    # calling application"; the client retried every UNKNOWN, so the same bug ran three times
    # (three fragment writes) before the save failed. Now it fails at the first, naming the bug.
    _, client, _ = service
    calls = []

    def buggy_finish(self, error=None):
        calls.append(error)
        raise ValueError("a bug in the handler")

    monkeypatch.setattr(multiwriter.ShardWriter, "finish", buggy_finish)
    saver = AsyncSaver(client, 0, 1, attempts=3, backoff=0.01, commit_timeout=5)
    saver.save(
        1,
        client.begin_save(1),
        tp_boxes(torch.randn(2, 8, 4).to(torch.bfloat16), 0, 1),
        committer=True,
    )
    with pytest.raises(
        CheckpointError, match="UNKNOWN: Exception calling application: a bug in the handler"
    ) as info:
        saver.wait()
    assert "attempts" not in str(info.value)
    assert [c for c in calls if c is None] == [
        None
    ]  # the fragment was tried once (then the error reported)


def test_a_storage_error_is_unavailable_retried_and_named(service):
    # The step's folder is a file (as a full disk, a read-only mount or S3 failing would): the
    # OSError is storage trouble, not a bug, so the service answers UNAVAILABLE naming the path,
    # and the client retries it (it used to be UNKNOWN, which is now only for bugs).
    root, client, _ = service
    save_id = client.begin_save(2)
    os.makedirs(root, exist_ok=True)
    step_dir = os.path.join(root, "step_00000002")
    if os.path.isdir(step_dir):  # BeginSave left its begun.json there
        shutil.rmtree(step_dir)
    open(step_dir, "w").close()
    saver = AsyncSaver(client, 0, 1, attempts=3, backoff=0.01, commit_timeout=5)
    saver.save(2, save_id, tp_boxes(torch.randn(2, 8, 4).to(torch.bfloat16), 0, 1), committer=True)
    with pytest.raises(
        CheckpointError,
        match=rf"failed after 3 attempts: .*UNAVAILABLE: checkpoint storage {root} "
        rf"failed: NotADirectoryError: .*{step_dir}",
    ):
        saver.wait()


def test_a_storage_error_a_retry_cannot_fix_is_tried_the_attempts_not_the_retry_time(service):
    # As with storage of its own (test_async.py), a saver talking to a service whose storage
    # fails the same way every time (here its step folder is a file) tries `attempts` times, not
    # for `retry_timeout`, which is for outlasting a restart: the service marks the UNAVAILABLE
    # it answers as lasting in its trailing metadata. It retried for the whole retry time.
    root, client, _ = service
    save_id = client.begin_save(3)
    step_dir = os.path.join(root, "step_00000003")
    shutil.rmtree(step_dir, ignore_errors=True)
    open(step_dir, "w").close()
    saver = AsyncSaver(client, 0, 1, attempts=3, backoff=0.01, commit_timeout=5, retry_timeout=30)
    saver.save(3, save_id, tp_boxes(torch.randn(2, 8, 4).to(torch.bfloat16), 0, 1), committer=True)
    with pytest.raises(
        CheckpointError,
        match=r"failed after 3 attempts: .*UNAVAILABLE: checkpoint storage .* "
        r"failed: NotADirectoryError",
    ):
        saver.wait()


def test_a_failed_call_names_the_services_address():
    # A checkpoint service SIGSTOPped under `meshtrain up` failed the trainer's save with
    # "checkpoint service WriteShards (writer 0): UNAVAILABLE: Stream removed (ping timeout)", and
    # one SIGKILLed with "... Stream removed (recvmsg:Connection reset by peer (104))": gRPC's text
    # names no address, so a log with several services did not say which one. A listener that
    # never answers is what a stopped service is to its clients; a call's deadline then passes
    # with gRPC's "Deadline Exceeded", no address either.
    import socket

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        with (
            CheckpointClient(address) as client,
            pytest.raises(
                MeshtrainError,
                match=re.escape(f"checkpoint service {address} AbortSave: DEADLINE_EXCEEDED"),
            ),
        ):
            client.abort_save("some-save", timeout=0.5)


def test_a_stalled_writer_stream_is_aborted_and_its_budget_freed(tmp_path):
    # A live writer claims a box as large as the whole in-flight budget, sends part of it and
    # then nothing (its stream stays open): every other writer waited for that budget until the
    # stalled client disconnected. With an idle timeout its stream is aborted, naming the save,
    # the writer and the box, and the other writer stores its box at once.
    import threading
    import time

    root = str(tmp_path / "ckpt")
    with running_service(
        root,
        commit_timeout=30,
        max_chunk_bytes=1024,
        max_inflight_bytes=4096,
        stream_idle_timeout=0.5,
    ) as (client, _):
        stalled_id, other_id = client.begin_save(1), client.begin_save(2)
        spec = ShardSpec("w", (1024,), "float32", (0,), (1024,))  # 4096 bytes: the whole budget
        resume = threading.Event()

        def stalls():
            yield pb.WriteShardsRequest(header=pb.WriteHeader(save_id=stalled_id, writer_id=0))
            yield pb.WriteShardsRequest(box=box_to_pb(spec))
            yield pb.WriteShardsRequest(chunk=b"\0" * 1024)
            resume.wait(20)  # alive, sending nothing

        failures = []

        def stalled_writer():
            try:
                client.stub.WriteShards(stalls())
            except grpc.RpcError as e:
                failures.append((e.code(), e.details(), time.monotonic()))

        thread = threading.Thread(target=stalled_writer)
        thread.start()
        time.sleep(0.2)  # the stalled stream holds the budget
        start = time.monotonic()
        other = client.writer(2, other_id, 0, 1)
        other.write(spec, torch.ones(1024))
        other.finish()  # waits for the budget
        stored = time.monotonic() - start
        assert client.commit(2, other_id, 1, {}, timeout=5).step == 2
        assert failures and not resume.is_set()  # aborted while its client was still stalled
        code, details, _ = failures[0]
        assert code == grpc.StatusCode.ABORTED
        assert re.search(
            rf"save '{stalled_id}' \(step 1\): writer 0 sent nothing for 0.5 s "
            r"inside box \(0,\) of array 'w' \(1024 of 4096 bytes\)",
            details,
        ), details
        assert stored < 3, stored
        resume.set()
        thread.join(10)
        assert client.list() == [2]


def test_a_save_given_up_by_its_failing_run_stops_its_commit_at_once(tmp_path):
    # Without the service, a failing run's AsyncSaver.abandon makes the committer stop waiting
    # for a writer that never reports (a dead rank). Through the service it could not: the
    # service's Commit waited for the missing writer until its timeout. AbortSave tells it.
    import time

    root = str(tmp_path / "ckpt")
    with running_service(root, commit_timeout=600) as (client, _):
        full = torch.randn(2, 8, 4).to(torch.bfloat16)
        save_id = client.begin_save(5, num_writers=2)
        saver = AsyncSaver(client, 0, 2, commit_timeout=60)
        saver.save(5, save_id, tp_boxes(full, 0, 2), committer=True, metadata={})
        time.sleep(0.5)  # writer 0's fragment is stored; its commit waits for writer 1
        start = time.monotonic()
        saver.abandon()
        with pytest.raises(
            CheckpointError, match=r"abandoned: writers \[1\] had not reported when the run failed"
        ):
            saver.wait()
        assert time.monotonic() - start < 5
        assert client.list() == [] and not client.abort_save(save_id)  # nothing left to give up
        with pytest.raises(
            CheckpointError, match=f"save '{save_id}' of step 5 failed to commit: .*abandoned"
        ):
            client.commit(5, save_id, 2, {}, timeout=1)  # a late retry is told why
        # the step is free: a new save of it commits
        again = client.begin_save(5, num_writers=2)
        for w in range(2):
            writer = client.writer(5, again, w, 2)
            for spec, data in tp_boxes(full, w, 2):
                writer.write(spec, data)
            writer.finish()
        assert client.commit(5, again, 2, {}, timeout=5).step == 5


def test_a_save_given_up_before_its_commit_still_commits_when_every_writer_reported(service):
    # As without the service (committer.commit's `cancelled`): giving up means not waiting for
    # missing writers; a save whose writers all reported is committed, not thrown away.
    import time

    _, client, _ = service
    complete, incomplete = written_save(client, 6), client.begin_save(7, num_writers=1)
    assert client.abort_save(complete, "the run failed") and client.abort_save(
        incomplete, "the run failed"
    )
    assert client.commit(6, complete, 1, {}, timeout=30).step == 6
    start = time.monotonic()
    with pytest.raises(
        CheckpointError, match=r"writers \[0\] had not reported when the run failed"
    ):
        client.commit(7, incomplete, 1, {}, timeout=30)
    assert time.monotonic() - start < 5
    assert client.list() == [6]
    assert not client.abort_save(complete) and not client.abort_save("0" * 32)  # committed; unknown
