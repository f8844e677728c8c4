"""grpc_utils and grpc_server on a tiny generic service (raw bytes, no protos): error mapping,
health, limits."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshtrain.services.common.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DataUnavailableError,
)
from meshtrain.services.common.grpc_server import make_server
from meshtrain.services.common.grpc_utils import channel_options

SERVICE = "meshtrain.test.v1.Echo"


def _fail(request, context):
    kind = request.decode()
    raise {
        "data": DataError("dataset x is missing"),
        "config": ConfigError("key y is unknown"),
        "unavailable": DataUnavailableError("x.bin: range read of tokens [0, 9) failed (timeout)"),
        "checkpoint": CheckpointError("step 3 has no manifest"),
        "bug": RuntimeError("oops"),
        "long": DataError("/data/" + "é" * 9000 + ".idx: indexed dataset file is missing"),
        "long_bug": OSError(36, "File name too long", "/data/" + "x" * 20000),
    }[kind]


def _echo(request, context):
    return request


def _upload(request_iterator, context):
    total = sum(len(r) for r in request_iterator)
    if total > 10:
        raise CheckpointError(f"upload of {total} bytes exceeds 10")
    return str(total).encode()


def _chat(request_iterator, context):
    for r in request_iterator:
        if r == b"bad":
            raise ConfigError("chat got 'bad'")
        yield r.upper()


def _stream(request, context):
    yield b"first"
    raise DataError(f"stream broke after one message ({request.decode()})")


@pytest.fixture(scope="module")
def address():
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Fail": grpc.unary_unary_rpc_method_handler(_fail),
            "Echo": grpc.unary_unary_rpc_method_handler(_echo),
            "Stream": grpc.unary_stream_rpc_method_handler(_stream),
            "Upload": grpc.stream_unary_rpc_method_handler(_upload),
            "Chat": grpc.stream_stream_rpc_method_handler(_chat),
        },
    )
    server, port, _ = make_server(
        [lambda s: s.add_generic_rpc_handlers((handler,))], [SERVICE], port=0
    )
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize(
    "kind,code,text",
    [
        ("data", grpc.StatusCode.INVALID_ARGUMENT, "dataset x is missing"),
        # a storage read that failed is not the request's fault: UNAVAILABLE, which clients retry
        ("unavailable", grpc.StatusCode.UNAVAILABLE, "x.bin: range read of tokens [0, 9) failed"),
        ("config", grpc.StatusCode.INVALID_ARGUMENT, "key y is unknown"),
        ("checkpoint", grpc.StatusCode.FAILED_PRECONDITION, "step 3 has no manifest"),
        ("bug", grpc.StatusCode.UNKNOWN, ""),
    ],
)
def test_domain_errors_map_to_status_codes(address, kind, code, text):
    fail = grpc.insecure_channel(address).unary_unary(f"/{SERVICE}/Fail")
    with pytest.raises(grpc.RpcError) as e:
        fail(kind.encode(), timeout=10)
    assert e.value.code() == code
    assert text in (e.value.details() or "")


@pytest.mark.parametrize(
    "kind,code,tail",
    [
        ("long", grpc.StatusCode.INVALID_ARGUMENT, "é.idx: indexed dataset file is missing"),
        ("long_bug", grpc.StatusCode.UNKNOWN, "xxx'"),
    ],
)
def test_a_message_too_long_for_a_status_is_cut_not_turned_into_resource_exhausted(
    address, kind, code, tail
):
    """A status's details travel in the trailers, which gRPC caps (8 KiB soft, 16 KiB hard):
    a longer message was dropped and the call failed RESOURCE_EXHAUSTED, a code clients retry.
    Non-ASCII is percent-encoded (3 bytes per byte), the worst case for the limit."""
    fail = grpc.insecure_channel(address).unary_unary(f"/{SERVICE}/Fail")
    with pytest.raises(grpc.RpcError) as e:
        fail(kind.encode(), timeout=10)
    assert e.value.code() == code, e.value.details()
    details = e.value.details()
    assert len(details.encode()) <= 2100 and " ... " in details
    assert details.endswith(tail) and "/data/" in details


def test_stream_error_after_messages(address):
    stream = grpc.insecure_channel(address).unary_stream(f"/{SERVICE}/Stream")
    it = stream(b"req", timeout=10)
    assert next(it) == b"first"
    with pytest.raises(grpc.RpcError) as e:
        next(it)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream broke after one message (req)" in e.value.details()


def test_client_and_bidi_stream_errors(address):
    ch = grpc.insecure_channel(address)
    upload = ch.stream_unary(f"/{SERVICE}/Upload")
    assert upload(iter([b"abc", b"de"]), timeout=10) == b"5"
    with pytest.raises(grpc.RpcError) as e:
        upload(iter([b"x" * 8, b"y" * 8]), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "16 bytes" in e.value.details()
    chat = ch.stream_stream(f"/{SERVICE}/Chat")
    it = chat(iter([b"hi", b"bad"]), timeout=10)
    assert next(it) == b"HI"
    with pytest.raises(grpc.RpcError) as e:
        next(it)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'bad'" in e.value.details()


def test_messages_over_default_limit_pass_both_ways(address):
    """8 MiB is twice gRPC's 4 MiB default: both ends must have raised it."""
    echo = grpc.insecure_channel(address, options=channel_options()).unary_unary(f"/{SERVICE}/Echo")
    blob = bytes(range(256)) * (8 << 12)
    assert echo(blob, timeout=30) == blob
    small = grpc.insecure_channel(address).unary_unary(f"/{SERVICE}/Echo")
    with pytest.raises(grpc.RpcError) as e:
        small(blob, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_health_serving(address):
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    assert (
        health.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status
        == health_pb2.HealthCheckResponse.SERVING
    )


def test_port_in_use_is_a_config_error(address):
    port = int(address.rsplit(":", 1)[1])
    with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
        make_server([], [SERVICE], port=port)


def test_a_port_in_use_is_one_line_naming_the_flag_without_grpc_logs(address, capfd):
    port = int(address.rsplit(":", 1)[1])
    capfd.readouterr()
    with pytest.raises(ConfigError) as e:
        make_server([], [SERVICE], port=port, port_flag="--train.control_port")
    assert str(e.value) == (
        f"127.0.0.1:{port} is in use: pass another --train.control_port, "
        "or --train.control_port 0 for any free port"
    )
    assert capfd.readouterr().err == ""  # no raw gRPC line, no GRPC_VERBOSITY


def test_busy_streams_leave_health_checks_answered_and_one_more_stream_is_refused():
    import threading
    import time

    from meshtrain.services.common.metrics import MetricsInterceptor, _metrics

    release = threading.Event()

    def _hold(request, context):
        yield b"open"
        release.wait(30)

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Hold": grpc.unary_stream_rpc_method_handler(_hold)}
    )
    server, port, _ = make_server(
        [lambda s: s.add_generic_rpc_handlers((handler,))],
        [SERVICE],
        port=0,
        max_workers=2,
        interceptors=[MetricsInterceptor("limits-test", 2)],
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    hold = channel.unary_stream(f"/{SERVICE}/Hold")
    try:
        streams = [hold(b"") for _ in range(2)]
        assert [next(s) for s in streams] == [b"open", b"open"]  # both stream slots taken
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            next(hold(b""))
        assert (
            e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "2 stream slots" in e.value.details()
        )
        requests = _metrics()["requests"]
        assert requests.labels("limits-test", "Hold", "RESOURCE_EXHAUSTED")._value.get() == 1
        streams[0].cancel()  # a client going away is CANCELLED, not an error
        time.sleep(0.5)  # the cancellation reaches the server before its handler resumes
        release.set()
        for s in streams[1:]:
            list(s)
        deadline = time.monotonic() + 5
        while requests.labels("limits-test", "Hold", "CANCELLED")._value.get() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert requests.labels("limits-test", "Hold", "UNKNOWN")._value.get() == 0
        assert next(hold(b"")) == b"open"  # the slots came back
    finally:
        release.set()
        channel.close()
        server.stop(0)
