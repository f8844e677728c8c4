"""The CheckpointService over real gRPC on loopback against clients that do not play fair: sizes
that would take the service's memory or time, waits whose client left, malformed fields, long
strings in its log, undecodable messages, a symlink planted in a step folder, a retention that
would delete every step (issue "Services that can face a network", parts 3 and 4)."""

import logging
import math
import os
import re
import time
import tracemalloc

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.services.checkpoint.boxes import ArrayMeta, ShardSpec, inner_chunks
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.errors import CheckpointError
from tests.services.checkpoint.rpc_helpers import held_slot, running_service, written_save


def raw_stream(client, save_id, messages, writer_id=0):
    header = pb.WriteShardsRequest(header=pb.WriteHeader(save_id=save_id, writer_id=writer_id))
    return client.stub.WriteShards(iter([header, *messages]), timeout=10)


def invalid(call, *args, **kwargs) -> str:
    """The details of the INVALID_ARGUMENT `call` must answer."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


def health_status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status


def test_a_huge_num_writers_is_refused_before_anything_is_allocated(service):
    # BeginSave(num_writers=2**31-1) was accepted and its Commit raised MemoryError building
    # set(range(num_writers)).
    _, client, _ = service
    tracemalloc.start()
    try:
        start = time.monotonic()
        details = invalid(client.stub.BeginSave, pb.BeginSaveRequest(step=1, num_writers=2**31 - 1))
        assert time.monotonic() - start < 1
        assert tracemalloc.get_traced_memory()[1] < 20 << 20
    finally:
        tracemalloc.stop()
    assert "num_writers=2147483647 must be in [1, 65536]" in details and "--max-writers" in details
    assert "num_writers=0" in invalid(
        client.stub.BeginSave, pb.BeginSaveRequest(step=1, num_writers=0)
    )
    assert "step=-1" in invalid(client.stub.BeginSave, pb.BeginSaveRequest(step=-1, num_writers=1))
    assert client.list() == []


def test_the_writer_limit_is_the_servers_option(tmp_path):
    with running_service(str(tmp_path / "ckpt"), max_writers=4) as (client, _):
        assert "must be in [1, 4]" in invalid(
            client.stub.BeginSave, pb.BeginSaveRequest(step=1, num_writers=5)
        )
        assert "must be in [1, 4]" in invalid(
            client.stub.ResumeSave, pb.ResumeSaveRequest(save_id="0123abcd", step=1, num_writers=5)
        )
        assert client.begin_save(1, num_writers=4)


@pytest.mark.parametrize(
    "box, match",
    [
        # a 40-byte box claiming a shard grid of 2^44: held a handler for 120 s at 3.7 GB
        (
            pb.Box(
                array="w",
                global_shape=[2**44 + 1],
                dtype="float32",
                offsets=[2**44],
                shape=[1],
                grid=[2**44],
            ),
            r"box.grid \(17592186044416,\) of array 'w' makes 70368744177664-byte shards",
        ),
        (
            pb.Box(array="w", global_shape=[2**44], dtype="float32", offsets=[0], shape=[2**44]),
            "makes 70368744177664-byte shards",
        ),
        # a prime grid: seconds of trial division choosing its chunks
        (
            pb.Box(
                array="w",
                global_shape=[2**61],
                dtype="uint8",
                offsets=[2**61 - 1],
                shape=[1],
                grid=[2**61 - 1],
            ),
            "makes 2305843009213693951-byte shards",
        ),
        (
            pb.Box(array="w", global_shape=[5], dtype="float32", offsets=[0], shape=[5], grid=[8]),
            "shard size 8 of dim 0 is larger than the array's 5",
        ),
        (
            pb.Box(array="w", global_shape=[4], dtype="float32", offsets=[4], shape=[0]),
            "at the end of the array",
        ),
        (
            pb.Box(array="w", global_shape=[-4], dtype="float32", offsets=[0], shape=[1]),
            "sizes >= 0",
        ),
        (
            pb.Box(
                array="w",
                global_shape=[2**40] * 2,
                dtype="float32",
                offsets=[0, 0],
                shape=[1, 1],
                grid=[1, 1],
            ),
            "at most 4611686018427387904 elements",
        ),
        (
            pb.Box(
                array="w", global_shape=[1] * 33, dtype="float32", offsets=[0] * 33, shape=[1] * 33
            ),
            "33 dims, over the limit of 32",
        ),
        (
            pb.Box(array="w", global_shape=[1], dtype="float128", offsets=[0], shape=[1]),
            "dtype 'float128'",
        ),
        (
            pb.Box(array="w\n", global_shape=[1], dtype="float32", offsets=[0], shape=[1]),
            "control character",
        ),
        (
            pb.Box(array="w" * 300, global_shape=[1], dtype="float32", offsets=[0], shape=[1]),
            "over the limit of 255",
        ),
    ],
)
def test_a_box_is_checked_against_its_array_within_a_second(service, box, match):
    _, client, _ = service
    save_id = client.begin_save(1)
    start = time.monotonic()
    details = invalid(raw_stream, client, save_id, [pb.WriteShardsRequest(box=box)])
    assert time.monotonic() - start < 1
    assert re.search(match, details), details
    assert len(details) < 600


def test_a_prime_shard_size_costs_no_trial_division():
    start = time.monotonic()
    (chunk,) = inner_chunks((2**61 - 1,), 1)  # no factor below 2^16: cut as a prime, to 1
    assert (2**61 - 1) % chunk == 0
    meta = ArrayMeta.of(ShardSpec("w", (2**61,), "uint8", (2**61 - 1,), (1,), grid=(2**61 - 1,)))
    assert (2**61 - 1) % meta.chunks[0] == 0
    assert inner_chunks((65521 * 65537, 8), 4) == inner_chunks(
        (65521 * 65537, 8), 4
    )  # below 2^32: exact
    assert time.monotonic() - start < 0.5


def test_a_commit_whose_client_left_frees_its_slot_and_its_save_stays(tmp_path):
    # 24 Commit(timeout_s=1e9) of clients that had gone held every RPC slot, health included.
    root = str(tmp_path / "ckpt")
    with running_service(root, max_commits=1, commit_timeout=5) as (client, port):
        save_id = client.begin_save(3, num_writers=2)
        client.writer(3, save_id, 0, 2).finish()  # writer 1 never reports
        waiting = client.stub.Commit.future(
            pb.CommitRequest(save_id=save_id, timeout_s=1e9, step=3)
        )
        time.sleep(0.5)
        assert health_status(port) == health_pb2.HealthCheckResponse.SERVING
        other = written_save(client, 4)
        with pytest.raises(grpc.RpcError) as info:  # the one commit slot is taken
            client.stub.Commit(pb.CommitRequest(save_id=other, step=4), timeout=5)
        assert (
            info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "--max-commits" in info.value.details()
        )
        waiting.cancel()
        deadline = time.monotonic() + 3
        while True:  # the handler sees its client gone within a second and gives the slot back
            try:
                assert (
                    client.stub.Commit(pb.CommitRequest(save_id=other, step=4), timeout=5).step == 4
                )
                break
            except grpc.RpcError as e:
                assert (
                    e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                )
                time.sleep(0.1)
        client.writer(3, save_id, 1, 2).finish()  # the save was not ended by its client leaving
        assert client.commit(3, save_id, 2, timeout=5).step == 3
        assert client.list() == [3, 4]


def test_a_huge_commit_timeout_is_capped(tmp_path):
    with running_service(str(tmp_path / "ckpt"), max_commit_timeout=0.5) as (client, _):
        save_id = client.begin_save(3, num_writers=2)
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=r"writers \[0, 1\] did not report within 0.5 s"):
            client.commit(3, save_id, 2, timeout=1e9)
        assert time.monotonic() - start < 3


def test_health_answers_while_every_stream_and_commit_slot_is_taken(tmp_path):
    with running_service(str(tmp_path / "ckpt"), max_streams=1, max_commits=1) as (client, port):
        save_id = client.begin_save(5, num_writers=2)
        waiting = client.stub.Commit.future(pb.CommitRequest(save_id=save_id, timeout_s=30))
        with held_slot(client, client.begin_save(6), 2.0):
            start = time.monotonic()
            assert health_status(port) == health_pb2.HealthCheckResponse.SERVING
            assert client.list() == []
            assert time.monotonic() - start < 1
        waiting.cancel()


@pytest.mark.parametrize(
    "call, request_, match",
    [
        ("Commit", pb.CommitRequest(save_id="abc\n"), "save id 'abc\\n' is not allowed"),
        ("Commit", pb.CommitRequest(save_id="x" * 100_000), "100000 characters"),
        ("AbortSave", pb.AbortSaveRequest(save_id="a/../b"), "is not allowed"),
        (
            "ResumeSave",
            pb.ResumeSaveRequest(save_id="abc", step=-3, num_writers=1),
            "step=-3 must be >= 0",
        ),
        ("Describe", pb.DescribeRequest(step=-1), "step=-1"),
        ("Delete", pb.DeleteRequest(step=-1), "step=-1"),
        ("ApplyRetention", pb.RetentionRequest(keep_last=-1), "keep_last=-1"),
    ],
)
def test_a_bad_field_is_invalid_argument_naming_it(service, call, request_, match):
    _, client, _ = service
    assert match in invalid(getattr(client.stub, call), request_)


def test_bad_commit_and_slice_fields_are_invalid_argument(service):
    _, client, _ = service
    save_id = written_save(client, 2)
    assert "timeout_s" in invalid(
        client.stub.Commit, pb.CommitRequest(save_id=save_id, timeout_s=math.nan)
    )
    assert "metadata_json is 2000000 characters" in invalid(
        client.stub.Commit, pb.CommitRequest(save_id=save_id, metadata_json=" " * 2_000_000)
    )
    assert "writer_id=3 is outside [0, 1)" in invalid(raw_stream, client, save_id, [], writer_id=3)
    assert "control character '\\x00'" in invalid(
        lambda: list(
            client.stub.ReadSlice(pb.ReadSliceRequest(step=2, array="w\0x", offsets=[0], shape=[1]))
        )
    )
    assert client.commit(2, save_id, 1, timeout=5).step == 2  # the save went on


def test_retention_refuses_keep_every_without_keep_last(service):
    # The service accepted keep_last=0, keep_every=7 and deleted every committed step.
    root, client, _ = service
    for step in (1, 2, 3):
        save_checkpoint(root, step, {"w": torch.ones(2)})
    details = invalid(client.stub.ApplyRetention, pb.RetentionRequest(keep_last=0, keep_every=7))
    assert details == (
        "keep_every 7 needs keep_last N with N >= 1 (got 0), or the newest checkpoints would be "
        "deleted too"
    )
    assert client.list() == [1, 2, 3]


def test_client_strings_are_cut_in_the_log(service, caplog):
    _, client, _ = service
    save_id = client.begin_save(7)
    caplog.set_level(logging.INFO)
    assert client.abort_save(save_id, reason="r" * 100_000)
    invalid(
        raw_stream,
        client,
        save_id,
        [
            pb.WriteShardsRequest(
                box=pb.Box(
                    array="a" * 100_000, global_shape=[1], dtype="float32", offsets=[0], shape=[1]
                )
            )
        ],
    )
    records = [r for r in caplog.records if r.name.startswith("meshtrain")]
    assert any("given up" in r.getMessage() for r in records)
    assert all(len(r.getMessage()) < 1000 for r in records), max(
        len(r.getMessage()) for r in records
    )


def test_an_undecodable_message_is_invalid_argument_and_one_log_line(service, caplog):
    # gRPC answered INTERNAL and logged a traceback for every request that did not decode.
    _, client, port = service
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        begin = channel.unary_unary("/meshtrain.checkpoint.v1.CheckpointService/BeginSave")
        with pytest.raises(grpc.RpcError) as info:
            begin(b"\xff\xff\xff\xff", timeout=5)
        write = channel.stream_unary("/meshtrain.checkpoint.v1.CheckpointService/WriteShards")
        with pytest.raises(grpc.RpcError) as streamed:
            write(iter([b"\xff\xff"]), timeout=5)
    for e in (info.value, streamed.value):
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        assert "does not decode as its message type: DecodeError" in e.details()
    lines = [
        r
        for r in caplog.records
        if "does not decode" in r.getMessage() or r.name.startswith("grpc")
    ]
    assert len(lines) == 2 and all(r.exc_info is None and r.exc_text is None for r in lines)
    assert not any("\n" in r.getMessage() or "Traceback" in r.getMessage() for r in lines)
    assert client.list() == []  # and the service goes on


def test_a_symlink_planted_in_a_step_folder_is_not_followed(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the service's")
    with running_service(str(root)) as (client, _):
        save_id = client.begin_save(3)
        os.symlink(outside, root / "step_00000003" / "w")  # planted during the save
        with pytest.raises(
            CheckpointError, match="step_00000003/w is a symlink inside the checkpoint root"
        ):
            writer = client.writer(3, save_id, 0, 1)
            writer.write(ShardSpec("w", (2,), "float32", (0,), (2,)), torch.ones(2))
            writer.finish()
        assert sorted(os.listdir(outside)) == ["keep"]

        save_id = written_save(client, 4)  # written, then a link planted before the commit
        os.symlink(outside / "keep", root / "step_00000004" / "w" / "stale")
        with pytest.raises(CheckpointError, match="stale is a symlink inside the checkpoint root"):
            client.commit(4, save_id, 1, timeout=5)
        assert (outside / "keep").read_text() == "not the service's"  # the commit deletes strays

        save_checkpoint(str(root), 5, {"w": torch.ones(2)})
        os.rename(root / "step_00000005" / "w", tmp_path / "moved")
        os.symlink(tmp_path / "moved", root / "step_00000005" / "w")
        with pytest.raises(CheckpointError, match="is a symlink inside the checkpoint root"):
            client.read_box(5, "w", (0,), (2,))
        assert sorted(os.listdir(outside)) == ["keep"]
