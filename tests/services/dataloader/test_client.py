"""ServiceBatchSource against misbehaving workers: a stream that stalls or ends early, a paused
reader, closing while a stream opens, and arguments it must refuse. Real gRPC on loopback."""

import errno
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
from meshtrain.services.common.errors import DataError
from meshtrain.services.common.grpc_server import make_server
from meshtrain.services.dataloader.loader import BatchOptions, LocalBatchSource
from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.rpc.server import start_server
from meshtrain.services.dataloader.rpc.servicer import SERVICE_NAME, DataServicer, spec_to_proto
from meshtrain.services.dataloader.spec import DatasetSpec, open_dataset
from tests.services.dataloader.conftest import served_limits

from .conftest import batch_hash


class _Held(DataServicer):
    """A worker that hangs somewhere until the test sets `release`."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()


class _Stuck(_Held):
    """Accepts the stream, then sends nothing (a hung handler; keepalive pings still answered)."""

    def StreamBatches(self, request, context):
        self.release.wait(60)
        yield from ()


class _Short(DataServicer):
    """Sends the first two micro-batches, then ends the stream cleanly (cut by a proxy or bug)."""

    def StreamBatches(self, request, context):
        for i, msg in enumerate(super().StreamBatches(request, context)):
            if i == 2:
                return
            yield msg


class _Buggy(DataServicer):
    """Raises an exception it does not map (a bug, or a request nothing validated): UNKNOWN."""

    def Describe(self, request, context):
        raise ValueError(f"cannot handle prefix {request.spec.prefixes[0]!r}")


@pytest.fixture
def stuck():
    servicer = _Stuck()
    srv, port, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(servicer, s)], [SERVICE_NAME]
    )
    yield f"127.0.0.1:{port}"
    servicer.release.set()
    srv.stop(0)


@pytest.fixture(scope="module")
def good():
    srv, port, _ = start_server(0, limits=served_limits())
    yield f"127.0.0.1:{port}"
    srv.stop(0)


def _first_tried_last(bad: str, good: str, dp_rank: int) -> list[str]:
    """Addresses ordered so that rank `dp_rank` of an even dp size tries `bad` first (a client
    streams from worker `slot mod count`, its slot being its dp rank)."""
    return [bad, good] if dp_rank % 2 == 0 else [good, bad]


def _hashes(batches):
    return [batch_hash(b) for b in batches]


def test_a_worker_that_sends_nothing_is_dropped_after_stall_s(stuck, good, blend_spec):
    local = LocalBatchSource(open_dataset(blend_spec), 2, 16, 0, 2)
    t0 = time.monotonic()
    with ServiceBatchSource(
        _first_tried_last(stuck, good, 0), blend_spec, 2, 16, 0, 2, stall_s=1.0, give_up_s=30
    ) as remote:
        got = [_hashes(remote.micro_batches(step)) for step in range(3)]
        assert remote.reconnects >= 1 and remote.current_address == good
    assert got == [_hashes(local.micro_batches(step)) for step in range(3)]
    assert time.monotonic() - t0 < 15


@pytest.mark.e2e
def test_no_worker_sending_anything_for_give_up_s_is_a_clear_error(stuck, blend_spec):
    t0 = time.monotonic()
    with (
        ServiceBatchSource(
            [stuck], blend_spec, 2, 16, 0, 2, stall_s=0.5, give_up_s=2.0, backoff_s=(0.05, 0.2)
        ) as remote,
        pytest.raises(
            DataError, match=r"no data worker of .* served anything for 2s; .*sent nothing for 0s"
        ),
    ):
        remote.micro_batches(0)
    assert time.monotonic() - t0 < 15


def test_a_stream_that_ends_before_the_dataset_is_a_failure_not_the_end(good, blend_spec):
    servicer = _Short()
    srv, port, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(servicer, s)], [SERVICE_NAME]
    )
    try:
        local = LocalBatchSource(open_dataset(blend_spec), 2, 16, 1, 2)
        with ServiceBatchSource(
            _first_tried_last(f"127.0.0.1:{port}", good, 1),
            blend_spec,
            2,
            16,
            1,
            2,
            backoff_s=(0.01, 0.05),
        ) as remote:
            got = [_hashes(remote.micro_batches(step)) for step in range(4)]
            assert remote.reconnects >= 1
        assert got == [_hashes(local.micro_batches(step)) for step in range(4)]
    finally:
        srv.stop(0)


def test_close_while_the_stream_opens_is_prompt_and_leaves_no_thread(stuck, blend_spec):
    remote = ServiceBatchSource([stuck], blend_spec, 2, 16, 0, 2)
    errors = []

    def consume():
        try:
            remote.micro_batches(0)
        except DataError as e:
            errors.append(str(e))

    reader = threading.Thread(target=consume)
    reader.start()
    t0 = time.monotonic()
    remote.close()
    assert time.monotonic() - t0 < 5
    reader.join(timeout=10)
    assert not reader.is_alive() and errors and "closed" in errors[0]
    deadline = time.monotonic() + 5
    while (
        any(t.name.startswith("data-client") for t in threading.enumerate())
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("data-client")]


@pytest.mark.e2e
def test_a_paused_reader_is_not_cut_off_for_its_keepalive_pings(good, blend_spec):
    # A client pinging every second (10 s in production, where a ~30 s pause did the same): the
    # server used to allow one ping per 5 min while it sent nothing, and answered the third
    # early one with GOAWAY "too_many_pings" (UNAVAILABLE here).
    # 64 MB of micro-batches: far more than the flow-control windows, so the server stays blocked
    spec = replace(blend_spec, seq_length=1023, num_samples=2000 * 16)
    channel = grpc.insecure_channel(
        good,
        options=[
            ("grpc.keepalive_time_ms", 1000),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    stream = pb_grpc.DataServiceStub(channel).StreamBatches(
        pb.StreamRequest(
            spec=spec_to_proto(spec),
            dp_rank=0,
            dp_size=1,
            micro_batch_size=16,
            global_batch_size=16,
        )
    )
    assert next(stream).step == 0
    time.sleep(5)  # the reader pauses; flow control stops the server: no data, only pings
    assert [m.step for m in stream] == list(range(1, 2000))
    channel.close()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"global_batch_size": 0}, "positive multiple"),
        ({"global_batch_size": -16}, "positive multiple"),
        ({"prefetch": 0}, "prefetch=0"),
        ({"stall_s": 0.0}, "stall_s=0.0"),
        ({"cp_rank": 2, "cp_size": 2}, r"cp_rank=2 is outside \[0, cp_size=2\)"),
        ({"cp_size": 3}, r"seq_length=32 .* 2 x cp_size=3"),
        (
            {"cp_size": 2, "options": BatchOptions(eod_id=0, document_ids=True)},
            "document ids and positions .* are not served from the data service under context",
        ),
    ],
)
def test_arguments_it_cannot_work_with_are_refused(blend_spec, kw, match):
    args = {"micro_batch_size": 2, "global_batch_size": 16, "dp_rank": 0, "dp_size": 2, **kw}
    with pytest.raises(DataError, match=match):
        ServiceBatchSource(["127.0.0.1:1"], blend_spec, **args)


def test_get_before_any_stream_is_an_error_not_a_hang(blend_spec):
    with (
        ServiceBatchSource(["127.0.0.1:1"], blend_spec, 2, 16, 0, 2) as remote,
        pytest.raises(DataError, match="micro_batches"),
    ):
        remote.get()


@pytest.mark.e2e
def test_a_worker_slow_to_open_the_dataset_is_waited_for_not_dropped(good, blend_spec):
    class SlowOpen(DataServicer):  # building the sample indices of a large blend takes minutes
        def Describe(self, request, context):
            time.sleep(3)
            return super().Describe(request, context)

    srv, port, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(SlowOpen(), s)], [SERVICE_NAME]
    )
    try:
        local = LocalBatchSource(open_dataset(blend_spec), 2, 16, 0, 2)
        with ServiceBatchSource(
            [f"127.0.0.1:{port}"], blend_spec, 2, 16, 0, 2, stall_s=2.5, give_up_s=2.5
        ) as remote:  # both shorter than the 3 s open
            assert _hashes(remote.micro_batches(0)) == _hashes(local.micro_batches(0))
            assert remote.reconnects == 0
        with (
            ServiceBatchSource(
                [f"127.0.0.1:{port}"],
                blend_spec,
                2,
                16,
                0,
                2,
                open_timeout_s=1.0,
                give_up_s=2.5,
                backoff_s=(0.05, 0.1),
            ) as remote,
            pytest.raises(DataError, match="DEADLINE_EXCEEDED"),
        ):
            remote.micro_batches(0)
    finally:
        srv.stop(0)


def test_a_failed_storage_read_on_a_worker_is_retried_not_the_end_of_the_run(tmp_path, monkeypatch):
    """One range read of an object-store dataset times out on the worker: the stream fails over
    and resumes exactly where it was. It used to reach the trainer as INVALID_ARGUMENT (the
    request's fault), which ends the run."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from .conftest import write_dataset

    local_prefix = write_dataset(tmp_path / "ds", seed=3, n_docs=200)
    fs = fsspec.filesystem("memory")
    for ext in (".bin", ".idx"):
        fs.pipe(f"/flaky-stream/ds{ext}", Path(local_prefix + ext).read_bytes())
    spec = DatasetSpec(("memory://flaky-stream/ds",), (1.0,), seq_length=16, num_samples=64, seed=1)
    local = LocalBatchSource(open_dataset(spec, cache=False), 2, 4, 0, 1)
    want = [_hashes(local.micro_batches(step)) for step in range(3)]

    real_cat, failed = MemoryFileSystem.cat_file, []

    def fails_once(self, path, start=None, end=None, **kw):
        if path.endswith(".bin") and start is not None and not failed:
            failed.append(path)
            raise OSError(errno.ETIMEDOUT, "simulated S3 read timeout")
        return real_cat(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", fails_once)
    srv, port, _ = start_server(0, cache_indices=False, limits=served_limits())
    try:
        with ServiceBatchSource(
            [f"127.0.0.1:{port}"], spec, 2, 4, 0, 1, backoff_s=(0.01, 0.05)
        ) as remote:
            assert [_hashes(remote.micro_batches(step)) for step in range(3)] == want
            assert failed and remote.reconnects == 1
    finally:
        srv.stop(0)


class _OpensForever(_Held):
    """Describe never returns (a build far longer than the client's open_timeout_s)."""

    def Describe(self, request, context):
        self.release.wait(60)
        return super().Describe(request, context)


class _HangsAfter3(_Stuck):
    """Sends three micro-batches, then keeps the stream open and sends nothing more."""

    def StreamBatches(self, request, context):
        for i, msg in enumerate(DataServicer.StreamBatches(self, request, context)):
            if i == 3:
                self.release.wait(60)
                return
            yield msg


def _serve(servicer):
    srv, port, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(servicer, s)], [SERVICE_NAME]
    )
    return srv, f"127.0.0.1:{port}"


@pytest.mark.e2e
def test_a_worker_that_times_out_opening_is_left_for_the_next_not_the_end_of_the_run(
    good, blend_spec
):
    # give_up_s < open_timeout_s: the failed open used to count toward give-up, so the run ended
    # with DEADLINE_EXCEEDED before the healthy worker was ever tried
    servicer = _OpensForever()
    srv, slow = _serve(servicer)
    try:
        local = LocalBatchSource(open_dataset(blend_spec), 2, 16, 0, 2)
        with ServiceBatchSource(
            _first_tried_last(slow, good, 0),
            blend_spec,
            2,
            16,
            0,
            2,
            open_timeout_s=2.0,
            give_up_s=1.0,
            backoff_s=(0.01, 0.05),
        ) as remote:
            assert _hashes(remote.micro_batches(0)) == _hashes(local.micro_batches(0))
            assert remote.reconnects >= 1 and remote.current_address == good
    finally:
        servicer.release.set()
        srv.stop(0)


def test_time_the_trainer_computes_on_prefetched_batches_is_not_time_without_data(good, blend_spec):
    # The worker hangs after 3 micro-batches while the trainer computes for longer than
    # give_up_s; the stall is noticed when the trainer next waits. The give-up clock used to
    # start at the last micro-batch received, so it fired at once instead of failing over.
    servicer = _HangsAfter3()
    srv, hangs = _serve(servicer)
    try:
        local = LocalBatchSource(open_dataset(blend_spec), 2, 2, 0, 1)
        with ServiceBatchSource(
            _first_tried_last(hangs, good, 0),
            blend_spec,
            2,
            2,
            0,
            1,
            prefetch=2,
            stall_s=1.0,
            give_up_s=1.5,
            backoff_s=(0.01, 0.05),
        ) as remote:
            got = []
            for step in range(6):
                got.append(_hashes(remote.micro_batches(step)))
                if step < 3:
                    time.sleep(0.6)  # the trainer's step: 1.8 s in all, longer than give_up_s
            assert remote.reconnects >= 1 and remote.current_address == good
        assert got == [_hashes(local.micro_batches(step)) for step in range(6)]
    finally:
        servicer.release.set()
        srv.stop(0)


class _Recording(DataServicer):
    """Records which RPCs reach it, as (worker name, method)."""

    def __init__(self, name, calls):
        super().__init__()
        self.name, self.calls = name, calls

    def Describe(self, request, context):
        self.calls.append((self.name, "Describe"))
        return super().Describe(request, context)

    def StreamBatches(self, request, context):
        self.calls.append((self.name, "StreamBatches"))
        yield from super().StreamBatches(request, context)


@pytest.fixture
def two_named_workers(monkeypatch):
    """Workers A (127.0.0.1:P) and B (127.0.0.2:P), one port, and a name `data-workers.test`
    that the OS resolver answers with whatever `names` holds (no name here resolves to two
    addresses, and the client resolves names through the OS, so this is where one is made)."""
    calls = []
    srv_a, port, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(_Recording("A", calls), s)],
        [SERVICE_NAME],
    )
    srv_b, _, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(_Recording("B", calls), s)],
        [SERVICE_NAME],
        port=port,
        host="127.0.0.2",
    )
    names = {"data-workers.test": ["127.0.0.1", "127.0.0.2"]}
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kw):
        if host in names:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in names[host]]
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield {"A": srv_a, "B": srv_b}, port, calls, names
    srv_a.stop(0)
    srv_b.stop(0)


def test_a_dns_target_opens_and_streams_on_one_worker_and_spreads_ranks(
    two_named_workers, blend_spec
):
    # round-robin over the name's addresses sent each Describe to one worker and the stream
    # after it to the next, which then built its indices inside the stream, under stall_s
    _, port, calls, _ = two_named_workers
    for rank in (0, 1):  # slot mod count: rank 0 on the first worker (sorted), rank 1 on the second
        local = LocalBatchSource(open_dataset(blend_spec), 2, 16, rank, 2)
        with ServiceBatchSource(
            [f"dns:///data-workers.test:{port}"], blend_spec, 2, 16, rank, 2, give_up_s=10
        ) as remote:
            assert [_hashes(remote.micro_batches(s)) for s in range(2)] == [
                _hashes(local.micro_batches(s)) for s in range(2)
            ]
            assert remote.reconnects == 0
    assert calls == [
        ("A", "Describe"),
        ("A", "StreamBatches"),
        ("B", "Describe"),
        ("B", "StreamBatches"),
    ]


def test_a_dns_target_is_resolved_again_when_a_worker_goes(two_named_workers, long_spec):
    servers, port, calls, names = two_named_workers
    local = LocalBatchSource(open_dataset(long_spec), 2, 16, 0, 2)
    # long_spec: a stream far longer than the flow-control windows, so stopping A breaks it
    with ServiceBatchSource(
        [f"dns:///data-workers.test:{port}"],
        long_spec,
        2,
        16,
        0,
        2,
        prefetch=1,
        backoff_s=(0.01, 0.05),
        give_up_s=10,
    ) as remote:
        got = [_hashes(remote.micro_batches(0))]
        assert remote.current_address == f"127.0.0.1:{port}"
        names["data-workers.test"] = ["127.0.0.2"]  # the service was scaled down to B
        servers["A"].stop(0)
        # what A sent before it stopped (socket buffers, flow-control windows) is still read
        # first: step on until the client has moved to B, then two steps from B
        while remote.reconnects == 0 and len(got) < remote.num_steps - 2:
            got.append(_hashes(remote.micro_batches(len(got))))
        got += [_hashes(remote.micro_batches(len(got) + i)) for i in range(2)]
        assert remote.reconnects >= 1 and remote.current_address == f"127.0.0.2:{port}"
    assert got == [_hashes(local.micro_batches(s)) for s in range(len(got))]
    assert ("A", "Describe") not in calls[2:]  # A was no longer named, so never tried again


def test_a_malformed_dns_target_is_refused_naming_it(blend_spec):
    with pytest.raises(DataError, match="'dns:///no-port' must be dns:///name:port"):
        ServiceBatchSource(["dns:///no-port"], blend_spec, 2, 16, 0, 2)


def test_the_trainer_passes_the_data_config_timeouts_to_the_client(good, tmp_path):
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.data import build_data

    job = load_config(
        [
            "--config",
            "deploy/configs/tiny.toml",
            "--data-service-addresses",
            good,
            "--data.service_stall_s=7",
            "--data.service_give_up_s=50",
            "--data.service_open_timeout_s=60",
            f"--data.cache_dir={tmp_path}",
        ]
    )
    data = build_data(job)
    try:
        assert (data.train.stall_s, data.train.give_up_s, data.train.open_timeout_s) == (7, 50, 60)
    finally:
        data.train.close()
        if data.valid is not None:
            data.valid.close()
    with pytest.raises(Exception, match="service_stall_s=0"):
        load_config(["--config", "deploy/configs/tiny.toml", "--data.service_stall_s=0"])


def test_an_error_the_worker_does_not_map_ends_the_run_with_its_message_not_retried(blend_spec):
    """UNKNOWN is what a worker answers when its handler raised something unmapped; every worker
    runs the same code on the same request, so the client's retries (it treated UNKNOWN as
    transient) only hid the error for give_up_s behind "no data worker served anything"."""
    servicer = _Buggy()
    srv, port, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(servicer, s)], [SERVICE_NAME]
    )
    try:
        started = time.monotonic()
        with ServiceBatchSource(
            [f"127.0.0.1:{port}"], blend_spec, 2, 16, 0, 2, give_up_s=20, backoff_s=(0.01, 0.05)
        ) as remote:
            with pytest.raises(DataError, match=r"UNKNOWN: .*cannot handle prefix '/") as e:
                remote.micro_batches(0)
            assert remote.reconnects == 0
        assert time.monotonic() - started < 10, e.value
        assert f"127.0.0.1:{port}" in str(e.value)
    finally:
        srv.stop(0)


class _Status(grpc.RpcError):
    """A received status, as the client sees one (only its code and details matter here)."""

    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_unknown_from_the_transport_is_retried_unknown_from_a_handler_is_not():
    # gRPC reports some transport failures as UNKNOWN ("Stream removed": a peer died, a proxy cut
    # the stream); those must fail over like UNAVAILABLE, not end the run.
    from meshtrain.services.dataloader.rpc.client import is_permanent

    unknown = grpc.StatusCode.UNKNOWN
    assert not is_permanent(_Status(unknown, "Stream removed"))
    assert not is_permanent(_Status(unknown, None))
    assert is_permanent(_Status(unknown, "Exception calling application: boom"))
    assert is_permanent(_Status(unknown, "Exception iterating responses: boom"))
    assert not is_permanent(
        _Status(grpc.StatusCode.UNAVAILABLE, "Exception calling application: x")
    )
    assert is_permanent(_Status(grpc.StatusCode.INVALID_ARGUMENT, "bad"))


class _Malformed(DataServicer):
    """Streams real micro-batches with one field spoiled (a worker of another version, or a bug)."""

    def __init__(self, spoil):
        super().__init__()
        self.spoil = spoil

    def StreamBatches(self, request, context):
        for msg in super().StreamBatches(request, context):
            self.spoil(msg)
            yield msg


@pytest.mark.parametrize(
    "spoil,match",
    [
        (
            lambda m: m.shape.__setitem__(slice(None), [3, 11]),
            r"of shape \(3, 11\), expected \(2, 33\)",
        ),
        (
            lambda m: setattr(m, "samples", m.samples[:-1]),
            r"with 131 bytes, expected 132 for \(2, 33\) uint16",
        ),
        (lambda m: setattr(m, "dtype", "object"), r"as dtype 'object', not a token dtype"),
        # the same bytes read as float16 made garbage tokens that trained silently
        (lambda m: setattr(m, "dtype", "float16"), r"as dtype 'float16', not a token dtype"),
    ],
)
def test_a_malformed_micro_batch_is_a_clear_error_naming_the_worker(blend_spec, spoil, match):
    """numpy's bare ValueError ('cannot reshape array of size ...') reached the trainer without
    naming the worker or the batch, and a wrong dtype name was not noticed at all."""
    servicer = _Malformed(spoil)
    srv, port, _ = make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(servicer, s)], [SERVICE_NAME]
    )
    try:
        with (
            ServiceBatchSource([f"127.0.0.1:{port}"], blend_spec, 2, 16, 0, 2) as remote,
            pytest.raises(
                DataError, match=f"worker 127.0.0.1:{port} sent step 0 micro-batch 0 {match}"
            ),
        ):
            remote.micro_batches(0)
    finally:
        srv.stop(0)


class _PredatesCp(DataServicer):
    """A worker of the version before context parallelism: it does not know the cp fields and
    streams whole samples whatever they say."""

    def StreamBatches(self, request, context):
        old = pb.StreamRequest()
        old.CopyFrom(request)
        old.ClearField("cp_rank")
        old.ClearField("cp_size")
        return super().StreamBatches(old, context)


def test_whole_samples_from_a_worker_that_ignores_cp_are_a_clear_error_not_wrong_positions(
    blend_spec,
):
    srv, address = _serve(_PredatesCp())
    try:
        with (
            ServiceBatchSource([address], blend_spec, 2, 16, 0, 2, cp_rank=1, cp_size=2) as remote,
            pytest.raises(
                DataError,
                match=rf"worker {address} sent step 0 micro-batch 0 of shape "
                rf"\(2, 33\), expected \(2, 2, 9\) \(the chunks of cp_rank=1 of "
                rf"cp_size=2; a worker that predates context parallelism",
            ),
        ):
            remote.micro_batches(0)
    finally:
        srv.stop(0)
