"""The DataService over real gRPC on loopback against clients that do not play fair: malformed
or oversized fields, an index for every seed a client names, streams opened and never read,
one client taking every stream slot (issue "Services that can face a network", parts 3 and 4)."""

import contextlib
import socket
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
from meshtrain.services.dataloader.index_cache import IndexCache, cached_arrays
from meshtrain.services.dataloader.rpc.server import start_server
from meshtrain.services.dataloader.rpc.servicer import DataLimits, spec_to_proto
from meshtrain.services.dataloader.spec import DatasetSpec
from tests.services.dataloader.conftest import TEST_ROOTS

from .conftest import write_dataset


@contextlib.contextmanager
def worker(tmp_path, host="127.0.0.1", max_workers=16, **limits):
    """A data worker on loopback whose indices go to tmp_path/index; its address."""
    limits = DataLimits(index_cache_dir=str(tmp_path / "index"), allow_roots=TEST_ROOTS, **limits)
    server, port, _ = start_server(0, host=host, max_workers=max_workers, limits=limits)
    try:
        yield port
    finally:
        server.stop(0)


def stub_of(address: str, options=()) -> pb_grpc.DataServiceStub:
    return pb_grpc.DataServiceStub(grpc.insecure_channel(address, options=list(options)))


def request(spec: DatasetSpec, mbs: int = 16, **kw) -> pb.StreamRequest:
    return pb.StreamRequest(
        spec=spec_to_proto(spec),
        dp_rank=0,
        dp_size=1,
        micro_batch_size=mbs,
        global_batch_size=16,
        **kw,
    )


def health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(), timeout=2)
            .status
        )


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> DatasetSpec:
    prefix = write_dataset(tmp_path_factory.mktemp("limits-data") / "small", seed=3)
    return DatasetSpec((prefix,), (1.0,), seq_length=16, num_samples=512, seed=1, split="100,0,0")


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(prefixes=["a\0b"]),
            "spec.prefixes[0] 'a\\x00b' holds the control character '\\x00' at position 1",
        ),
        (dict(prefixes=["ds\n"]), "spec.prefixes[0] 'ds\\n' holds the control character '\\n'"),
        (dict(prefixes=["p" * 100_000]), "is 100000 characters long, over the limit of 4096"),
        (dict(prefixes=[]), "spec.prefixes has 0 entries"),
        (dict(weights=[1.0, 2.0]), "spec.weights has 2 entries for 1 prefixes"),
        (
            dict(num_samples=2**32 + 1),
            "spec.num_samples=4294967297 is over this data worker's limit of 4294967296",
        ),
        (dict(split="9\n9"), "spec.split '9\\n9' holds the control character"),
        (dict(split_name="train\n"), "spec.split_name 'train\\n' is not one of"),
    ],
)
def test_bad_fields_are_invalid_argument_naming_them(tmp_path, small, change, match):
    # A NUL in a prefix failed with UNKNOWN and a traceback; "$" patterns let a final newline in.
    spec = spec_to_proto(small)
    for key, value in change.items():
        if isinstance(value, list):
            getattr(spec, key)[:] = value
        else:
            setattr(spec, key, value)
    with worker(tmp_path) as port:
        with pytest.raises(grpc.RpcError) as info:
            stub_of(f"127.0.0.1:{port}").Describe(
                pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=16),
                timeout=10,
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert match in info.value.details() and len(info.value.details()) < 1000


def test_the_sample_limit_is_the_workers_option(tmp_path, small):
    with worker(tmp_path, max_samples=100) as port:
        with pytest.raises(
            grpc.RpcError,
            match="num_samples=512 is over this data worker's limit of 100 "
            r"\(`data serve --max-samples`\)",
        ):
            stub_of(f"127.0.0.1:{port}").Describe(request(small), timeout=10)
        assert (
            stub_of(f"127.0.0.1:{port}")
            .Describe(request(replace(small, num_samples=96)))
            .num_samples
            == 96
        )


def test_the_index_cache_has_a_quota_evicts_the_least_recently_used_and_never_sits_beside_the_data(
    tmp_path, small
):
    # Every (seed, num_samples) a client named left an index beside the dataset, unbounded
    # (375 MB of memory and 102 MB of disk at 2^23 samples).
    index = tmp_path / "index"

    def stream(port, seed) -> set[str]:
        responses = stub_of(f"127.0.0.1:{port}").StreamBatches(request(replace(small, seed=seed)))
        next(responses)
        responses.cancel()
        return set(IndexCache(index, 1).entries())

    def files(key) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in index.glob(f"{key}-*.npy")}

    with worker(tmp_path, index_cache_bytes=10 << 20) as port:
        (key1,) = stream(port, 1)
    entry = IndexCache(index, 1).used_bytes()
    with worker(tmp_path, index_cache_bytes=int(2.5 * entry)) as port:
        (key2,) = stream(port, 2) - {key1}
        built = files(key2)
        time.sleep(0.01)
        stream(port, 1)  # used again: seed 2's index is now the least recently used
        time.sleep(0.01)
        keys = stream(port, 3)
        assert key2 not in keys and key1 in keys and len(keys) == 2
        assert IndexCache(index, 1).used_bytes() <= 2.5 * entry
    with worker(
        tmp_path, index_cache_bytes=int(2.5 * entry)
    ) as port:  # a worker that has not seed 2 open
        assert key2 in stream(port, 2) and files(key2) == built  # rebuilt bit for bit
    assert not (Path(small.prefixes[0]).parent / ".meshtrain-index").exists()


def test_an_index_a_live_stream_reads_is_not_evicted(tmp_path):
    cache = IndexCache(tmp_path / "index", quota_bytes=3000)

    def build(seed):
        return lambda: {"a": np.full(200, seed, dtype=np.int64)}  # 1600 bytes + header

    cached_arrays(cache, {"seed": 1}, build(1))
    (key1,) = cache.entries()
    with cache.pinned([key1]):
        kept = cached_arrays(
            cache, {"seed": 2}, build(2)
        )  # no room beside the pinned one: not stored
        assert len(cache.entries()) == 1 and cache.evicted == 0 and kept["a"][0] == 2
    cached_arrays(cache, {"seed": 3}, build(3))  # unpinned now: evicted for it
    assert key1 not in cache.entries() and cache.evicted == 1 and cache.used_bytes() <= 3000
    big = cached_arrays(cache, {"seed": 4}, lambda: {"a": np.zeros(1000, dtype=np.int64)})
    assert big["a"].size == 1000 and len(cache.entries()) == 1  # over the whole quota: memory only


@pytest.fixture(scope="module")
def long_stream(long_spec):
    """A single-prefix spec of 2000 steps of 16 kB micro-batches: far more than gRPC buffers."""
    return replace(long_spec, prefixes=long_spec.prefixes[:1], weights=(1.0,))


@pytest.mark.e2e
def test_a_stream_whose_client_does_not_read_is_reaped_and_a_slow_reader_is_not(
    tmp_path, long_stream
):
    """40 streams that never read held all 32 stream slots, with no idle timeout. How slow a
    reader may be is relative to its flow-control window: the worker waits at a message until the
    client's window opens again, and gRPC's BDP probing grows that window to megabytes on
    loopback, more than this reader drains within the test's 1 s timeout (under the default 300 s
    a reader is reaped only when it drains less than its window in 300 s). So the slow reader's
    channel keeps the default 64 KiB window, and the worker follows its pace message by message."""
    with worker(tmp_path, max_workers=1, stream_idle_timeout=1.0) as port:
        address = f"127.0.0.1:{port}"
        slow = stub_of(address, [("grpc.http2.bdp_probe", 0)]).StreamBatches(request(long_stream))
        for _ in range(40):  # far slower than it could, but reading: never idle for a second
            next(slow)
            time.sleep(0.05)
        assert sum(1 for _ in slow) == 2000 - 40  # the whole stream came
        idle = stub_of(address).StreamBatches(request(long_stream))
        next(idle)  # then never reads again
        start = time.monotonic()
        while True:  # the one stream slot comes free once the idle stream is reaped
            try:
                assert next(stub_of(address).StreamBatches(request(long_stream))).step == 0
                break
            except grpc.RpcError as e:
                assert (
                    e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - start < 8
                )
                time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as info:
            for _ in idle:
                pass
        assert info.value.code() == grpc.StatusCode.CANCELLED


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="needs IPv6 loopback for a second client host")
def test_a_clients_streams_are_capped_while_another_client_is_served(tmp_path, long_stream):
    with worker(
        tmp_path, host="localhost", max_streams_per_client=1, stream_idle_timeout=0
    ) as port:
        first = stub_of(f"127.0.0.1:{port}").StreamBatches(request(long_stream))
        next(first)
        with pytest.raises(grpc.RpcError) as info:
            next(stub_of(f"127.0.0.1:{port}").StreamBatches(request(long_stream)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "client 127.0.0.1 already holds 1 streams" in info.value.details()
        assert "--max-streams-per-client 1" in info.value.details()
        other = stub_of(f"[::1]:{port}").StreamBatches(request(long_stream))  # another host
        assert next(other).step == 0
        first.cancel()
        other.cancel()


def test_health_answers_while_every_stream_slot_is_busy(tmp_path, long_stream):
    with worker(tmp_path, max_workers=2, stream_idle_timeout=0) as port:
        address = f"127.0.0.1:{port}"
        held = [stub_of(address).StreamBatches(request(long_stream)) for _ in range(2)]
        for responses in held:
            next(responses)  # then not read: each holds its slot
        with pytest.raises(grpc.RpcError) as info:
            next(stub_of(address).StreamBatches(request(long_stream)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        start = time.monotonic()
        assert health(port) == health_pb2.HealthCheckResponse.SERVING
        assert stub_of(address).Describe(request(long_stream), timeout=5).num_steps == 2000
        assert time.monotonic() - start < 2
        for responses in held:
            responses.cancel()
