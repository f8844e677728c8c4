"""The CheckpointService over real gRPC on loopback: saves, reads, retention, bad requests."""

import os
import re

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.services.checkpoint import committer, multiwriter
from meshtrain.services.checkpoint.async_save import AsyncSaver
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.multiwriter import ShardWriter
from meshtrain.services.checkpoint.reader import list_checkpoints, read_box
from meshtrain.services.checkpoint.rpc.client import box_to_pb
from meshtrain.services.checkpoint.rpc.servicer import SERVICE_NAME
from meshtrain.services.checkpoint.store import MANIFEST_NAME
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.errors import CheckpointError
from tests.services.checkpoint.rpc_helpers import (
    running_service,
    tp_boxes,
    written_save,
)


def test_two_writers_through_the_service(service):
    root, client, _ = service
    full = torch.randn(3, 16, 8).to(torch.bfloat16)
    save_id = client.begin_save(7, num_writers=2)
    savers = [AsyncSaver(client, w, 2, commit_timeout=10) for w in range(2)]
    for w, saver in enumerate(savers):
        saver.save(7, save_id, tp_boxes(full, w, 2), committer=(w == 0), metadata={"it": 7})
    assert savers[1].wait() is None
    result = savers[0].wait()
    assert result.step == 7 and result.num_arrays == 1
    assert client.list() == [7] == list_checkpoints(root)
    assert client.describe(7)["metadata"] == {"it": 7}
    got = client.read_box(7, "layers.attention.qkv.weight", (1, 4, 0), (2, 8, 8))  # > 1 chunk
    assert torch.equal(got.view(torch.int16), full[1:3, 4:12].view(torch.int16))
    assert torch.equal(
        read_box(root, 7, "layers.attention.qkv.weight", (0, 0, 0), (3, 16, 8)).view(torch.int16),
        full.view(torch.int16),
    )


def test_health_and_unknown_ids(service):
    _, client, port = service
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        status = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(CheckpointError, match="NOT_FOUND: unknown save id 'nope'"):
        client.commit(1, "nope", 1)
    with pytest.raises(CheckpointError, match="NOT_FOUND: unknown save id"):
        client.writer(1, "feedbeef", 0, 1).finish()
    with pytest.raises(CheckpointError, match="save id '../x' is not allowed"):
        client.writer(1, "../x", 0, 1).finish()
    with pytest.raises(CheckpointError, match="step 3 .*not a committed checkpoint"):
        client.describe(3)
    save_checkpoint(service[0], 1, {"w": torch.ones(2)})
    # the request's fault (SECURITY.md: a bad field is INVALID_ARGUMENT naming it)
    with pytest.raises(CheckpointError, match="INVALID_ARGUMENT: .*no array 'missing'"):
        client.read_box(1, "missing", (0,), (1,))
    # a request is checked before it is priced against the in-flight limit (64 KiB here)
    with pytest.raises(CheckpointError, match="INVALID_ARGUMENT: .*no array 'missing'"):
        client.read_box(1, "missing", (0,), (1 << 20,))
    with pytest.raises(
        CheckpointError,
        match=r"INVALID_ARGUMENT: box offsets \(0,\) shape \(1048576,\) is outside array 'w' "
        r"of shape \(2,\)",
    ):
        client.read_box(1, "w", (0,), (1 << 20,))
    with pytest.raises(CheckpointError, match=r"INVALID_ARGUMENT: box offsets \(1,\) shape \(2,\)"):
        client.read_box(1, "w", (1,), (2,))


def raw_stream(client, save_id, messages):
    head = pb.WriteShardsRequest(header=pb.WriteHeader(save_id=save_id, writer_id=0))
    return client.stub.WriteShards(iter([head, *messages]))


def test_bad_streams_are_rejected_and_nothing_commits(service):
    _root, client, _ = service
    spec = ShardSpec("w", (100,), "float32", (0,), (100,))
    save_id = client.begin_save(2)
    box = pb.WriteShardsRequest(box=box_to_pb(spec))
    cases = [
        ([box, pb.WriteShardsRequest(chunk=b"\0" * 300)], "chunk of 300 bytes .* over the limit"),
        ([box] + [pb.WriteShardsRequest(chunk=b"\0" * 256)] * 2, "got more than its 400 bytes"),
        ([box, pb.WriteShardsRequest(chunk=b"\0" * 8)], "stream ended inside box"),
        ([pb.WriteShardsRequest(chunk=b"\0")], "chunk arrived before any box"),
        ([box, pb.WriteShardsRequest(box=box_to_pb(spec))], "ended after 0 of 400 bytes"),
        (
            [pb.WriteShardsRequest(header=pb.WriteHeader(save_id=save_id))],
            "unexpected 'header' message",
        ),
    ]
    # malformed input: INVALID_ARGUMENT, as SECURITY.md promises (not FAILED_PRECONDITION)
    for messages, match in cases:
        with pytest.raises(grpc.RpcError) as info:
            raw_stream(client, save_id, messages)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert re.search(match, info.value.details()), info.value.details()
    for stream in ([], [box]):  # no header first: nothing, or a box
        with pytest.raises(grpc.RpcError) as info:
            client.stub.WriteShards(iter(stream))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "must start with a header" in info.value.details()
    # a box's size is a field the client chose: INVALID_ARGUMENT naming it and the limit
    huge = pb.WriteShardsRequest(
        box=box_to_pb(ShardSpec("w", (1 << 20,), "float32", (0,), (1 << 20,)))
    )
    with pytest.raises(grpc.RpcError) as info:
        raw_stream(client, save_id, [huge])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "over the service's in-flight limit" in info.value.details()
    bad_box = pb.Box(array="a/../b", global_shape=[1], dtype="float32", offsets=[0], shape=[1])
    with pytest.raises(grpc.RpcError, match="not allowed"):
        raw_stream(client, save_id, [pb.WriteShardsRequest(box=bad_box)])
    with pytest.raises(CheckpointError, match=r"writers \[0\] did not report within 0.2 s"):
        client.commit(2, save_id, 1, timeout=0.2)
    assert client.list() == []


def test_delete_and_retention(service):
    root, client, _ = service
    for step in range(1, 8):
        save_checkpoint(root, step, {"w": torch.full((2,), float(step))})
    save_id = client.begin_save(8)  # in progress: retention must leave it alone
    ShardWriter(root, 8, save_id, 0, 1).write(
        ShardSpec("w", (2,), "float32", (0,), (2,)), torch.ones(2)
    )
    os.makedirs(f"{root}/step_00000009/w")  # a crashed save's leftover
    result = client.apply_retention(keep_last=2, keep_every=3)
    assert result.deleted == [1, 2, 4, 5] and result.collected == [9]
    assert client.list() == [3, 6, 7]
    assert os.path.exists(f"{root}/step_00000008/w/c/0") and not os.path.exists(
        f"{root}/step_00000009"
    )
    assert client.delete(6) and not client.delete(6)
    assert client.list() == [3, 7]
    with pytest.raises(CheckpointError, match="keep_last=-1"):
        client.apply_retention(keep_last=-1)


def test_a_step_being_saved_cannot_be_deleted(service):
    _, client, _ = service
    client.begin_save(4)
    with pytest.raises(CheckpointError, match="step 4 is being saved"):
        client.delete(4)


def test_a_newer_begin_save_of_a_step_supersedes_the_older_one(service):
    root, client, _ = service
    full = torch.randn(2, 8, 4).to(torch.bfloat16)
    old = client.begin_save(5, num_writers=1)
    new = client.begin_save(5, num_writers=1)  # e.g. the trainer restarted mid-save
    stale = client.writer(5, old, 0, 1)
    for spec, data in tp_boxes(torch.zeros_like(full), 0, 1):
        stale.write(spec, data)
    with pytest.raises(CheckpointError, match=f"save '{old}' of step 5 was superseded"):
        stale.finish()
    fresh = AsyncSaver(client, 0, 1, commit_timeout=10)
    fresh.save(5, new, tp_boxes(full, 0, 1), committer=True, metadata={})
    assert fresh.wait().step == 5
    with pytest.raises(CheckpointError, match="superseded"):
        client.commit(5, old, 1, {}, timeout=1)
    assert torch.equal(
        read_box(root, 5, "layers.attention.qkv.weight", (0, 0, 0), (2, 8, 4)).view(torch.int16),
        full.view(torch.int16),
    )


def test_a_retried_commit_of_a_committed_save_gets_its_result_again(service):
    _, client, _ = service
    save_id = written_save(client, 6)
    first = client.commit(6, save_id, 1, {}, timeout=5)
    again = client.commit(6, save_id, 1, {}, timeout=5)  # the first reply was "lost"
    assert (again.step, again.url, again.num_objects) == (first.step, first.url, first.num_objects)


def test_remote_writer_refuses_data_of_another_dtype(service):
    _, client, _ = service
    save_id = client.begin_save(2, num_writers=1)
    writer = client.writer(2, save_id, 0, 1)
    spec = ShardSpec("w", (4,), "bfloat16", (0,), (4,))
    with pytest.raises(CheckpointError, match="is bfloat16 but got a torch.float16 tensor"):
        writer.write(spec, torch.ones(4, dtype=torch.float16))  # same width: would be reinterpreted
    import numpy as np

    with pytest.raises(CheckpointError, match="numpy array of float16"):
        writer.write(spec, np.ones(4, dtype=np.float16))


def test_an_error_message_without_text_still_fails_the_save(service):
    _, client, _ = service
    save_id = client.begin_save(12, num_writers=1)
    raw_stream(client, save_id, [pb.WriteShardsRequest(error="")])
    with pytest.raises(CheckpointError, match="writer 0 reported an error"):
        client.commit(12, save_id, 1, {}, timeout=2)


def test_an_abandoned_save_is_forgotten_and_its_leftovers_collected(tmp_path):
    import time

    root = str(tmp_path / "ckpt")
    with running_service(root, commit_timeout=0.2) as (client, _):
        save_id = client.begin_save(8, num_writers=1)  # its trainer dies before committing
        ShardWriter(root, 8, save_id, 0, 1).write(
            ShardSpec("w", (2,), "float32", (0,), (2,)), torch.ones(2)
        )
        assert client.apply_retention(keep_last=3).collected == []  # still in progress
        time.sleep(0.6)  # past twice the commit timeout
        assert client.apply_retention(keep_last=3).collected == [8]
        late = client.writer(8, save_id, 0, 1)
        late.write(ShardSpec("w", (2,), "float32", (0,), (2,)), torch.ones(2))
        with pytest.raises(CheckpointError, match="abandoned"):
            late.finish()


def test_two_commits_of_one_save_at_once_both_get_the_result(service):
    from concurrent.futures import ThreadPoolExecutor

    _, client, _ = service
    save_id = written_save(client, 13)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: client.commit(13, save_id, 1, {}, timeout=5), range(2)))
    assert results[0].url == results[1].url and client.list() == [13]


@pytest.mark.parametrize("manifest_landed", [False, True], ids=["write-failed", "reply-lost"])
def test_a_commit_that_fails_on_storage_is_retried_to_the_end(
    service, monkeypatch, manifest_landed
):
    # The manifest write raises OSError once: before the object landed, or after it (the PUT
    # succeeded, its reply was lost). The client retries the UNAVAILABLE status; the service must
    # still know the save, so the retry commits it, or finds its own commit, as embedded
    # mode's retry does (it used to drop the save and answer NOT_FOUND "unknown save id").
    root, client, _ = service
    real, failed = committer.write_bytes_exclusive, []

    def fails_once(root_, path, data):
        if path.endswith(MANIFEST_NAME) and not failed:
            failed.append(path)
            if manifest_landed:
                real(root_, path, data)
            raise OSError("connection reset while writing the manifest")
        return real(root_, path, data)

    monkeypatch.setattr(committer, "write_bytes_exclusive", fails_once)
    full = torch.randn(2, 8, 4).to(torch.bfloat16)
    saver = AsyncSaver(client, 0, 1, backoff=0.01, commit_timeout=5)
    saver.save(4, client.begin_save(4), tp_boxes(full, 0, 1), committer=True, metadata={})
    assert saver.wait().step == 4 and failed
    assert client.list() == [4]
    assert torch.equal(
        read_box(root, 4, "layers.attention.qkv.weight", (0, 0, 0), (2, 8, 4)).view(torch.int16),
        full.view(torch.int16),
    )


def test_calls_of_a_save_that_ended_name_what_became_of_it(service):
    _, client, _ = service
    refused = client.begin_save(9, num_writers=1)  # its writer never reports
    with pytest.raises(CheckpointError, match=r"writers \[0\] did not report"):
        client.commit(9, refused, 1, {}, timeout=0.1)
    # a retry (the first reply lost) gets the refusal's cause, not "unknown save id"
    with pytest.raises(
        CheckpointError,
        match=rf"FAILED_PRECONDITION: save '{refused}' of step 9 failed to "
        r"commit: .*writers \[0\] did not report",
    ):
        client.commit(9, refused, 1, {}, timeout=0.1)
    committed = written_save(client, 10)
    client.commit(10, committed, 1, {}, timeout=5)
    with pytest.raises(
        CheckpointError,
        match=f"FAILED_PRECONDITION: save '{committed}' of step 10 is "
        "already committed; it takes no more writes",
    ):
        client.writer(10, committed, 0, 1).finish()  # a writer retrying after its reply was lost
    assert client.list() == [10]


def test_a_later_call_of_a_save_that_failed_on_a_long_error_gets_it_cut_to_fit(service):
    # The refusal of a save is remembered and repeated to its later calls; quoting a 20 kB
    # writer error it overran gRPC's 8 KiB trailer limit, and the client got RESOURCE_EXHAUSTED
    # "Stream removed" (transient: retried) instead of the refusal.
    _, client, _ = service
    save_id = client.begin_save(14, num_writers=1)
    raw_stream(client, save_id, [pb.WriteShardsRequest(error="E" * 20000)])
    for _ in range(2):  # the commit, then a retry of it
        with pytest.raises(
            CheckpointError, match="FAILED_PRECONDITION: .*writers reported errors"
        ) as info:
            client.commit(14, save_id, 1, {}, timeout=2)
        assert len(str(info.value)) < 2500


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0])
def test_a_commit_timeout_that_never_passes_is_refused(service, timeout):
    # NaN compared false with the clock, so the commit waited forever for the missing writer
    _, client, _ = service
    save_id = client.begin_save(15, num_writers=1)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Commit(pb.CommitRequest(save_id=save_id, timeout_s=timeout), timeout=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "timeout_s must be a finite number of seconds >= 0 (0: the service's default), "
        f"got {timeout!r}" in info.value.details()
    )
    with pytest.raises(CheckpointError, match=r"writers \[0\] did not report within 0.1 s"):
        client.commit(15, save_id, 1, {}, timeout=0.1)  # the save was not ended by the bad request


def test_a_begin_save_during_a_commit_of_its_step_never_leaves_a_broken_checkpoint(service):
    # BeginSave cleared the step's folder while a commit of it was writing its arrays'
    # metadata: the commit then wrote a manifest over deleted shards, a committed checkpoint
    # that does not load. BeginSave now waits for that commit, then sees the step committed.
    import glob
    import threading
    import time

    root, client, _ = service
    save_id = client.begin_save(16, num_writers=1)
    writer = client.writer(16, save_id, 0, 1)
    for i in range(150):  # many arrays: the commit spends a while writing their zarr.json
        writer.write(ShardSpec(f"a{i}", (4,), "float32", (0,), (4,)), torch.full((4,), float(i)))
    writer.finish()
    results = {}
    committer = threading.Thread(
        target=lambda: results.setdefault("commit", client.commit(16, save_id, 1, {}, timeout=5))
    )
    committer.start()
    deadline = time.monotonic() + 10
    while not glob.glob(f"{root}/step_00000016/a*/zarr.json") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not os.path.exists(f"{root}/step_00000016/{MANIFEST_NAME}")  # still inside the commit
    with pytest.raises(CheckpointError, match="checkpoint step 16 already exists"):
        client.begin_save(16)
    committer.join()
    assert results["commit"].step == 16 and client.list() == [16]
    for i in (0, 149):
        assert torch.equal(read_box(root, 16, f"a{i}", (0,), (4,)), torch.full((4,), float(i)))


def test_a_commit_waiting_for_writers_stops_when_its_save_is_superseded(service):
    import threading
    import time

    _, client, _ = service
    old = client.begin_save(17, num_writers=2)  # writer 1 never comes
    errors = []

    def commit_old():
        try:
            client.commit(17, old, 2, {}, timeout=30)
        except CheckpointError as e:
            errors.append(e)

    committer = threading.Thread(target=commit_old)
    committer.start()
    time.sleep(0.3)
    start = time.monotonic()
    new = written_save(client, 17)  # waits for the old commit to give up, not 30 s
    committer.join()
    assert time.monotonic() - start < 5
    assert errors and re.search(
        f"save {old} of step 17 under .* abandoned: writers .* had not reported when "
        "its save was superseded",
        str(errors[0]),
    )
    assert client.commit(17, new, 1, {}, timeout=5).step == 17


@pytest.mark.parametrize(
    "metadata_json, match",
    [
        ("5", "commit metadata_json must be a JSON object, got int: '5'"),
        ("[1]", "commit metadata_json must be a JSON object, got list"),
        ("[" * 100_000, "commit metadata_json is not JSON: maximum recursion depth"),
    ],
)
def test_commit_metadata_must_be_a_json_object(service, metadata_json, match):
    # A number or list was committed as the manifest's metadata (`meshtrain ckpt inspect` and
    # the trainer's load then failed on it with a traceback); JSON nested too deep failed the
    # handler with UNKNOWN, which the client retries as transient.
    _, client, _ = service
    save_id = written_save(client, 18)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Commit(pb.CommitRequest(save_id=save_id, metadata_json=metadata_json))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in info.value.details()
    assert client.list() == []
    assert client.commit(18, save_id, 1, {"ok": 1}, timeout=5).step == 18  # the save goes on


def test_the_library_commit_refuses_metadata_that_is_not_a_dict(tmp_path):
    save_id = multiwriter.begin_save(str(tmp_path), 1)
    ShardWriter(str(tmp_path), 1, save_id, 0, 1).finish()
    with pytest.raises(CheckpointError, match="metadata for step 1 must be a dict, got list"):
        committer.commit(str(tmp_path), 1, save_id, 1, [1], timeout=1)
