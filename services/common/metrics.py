"""Prometheus metrics for meshtrain's gRPC services: requests, bytes, latency, queue depth.

`MetricsInterceptor` wraps every RPC of a server (all four method kinds) and records, per service
and method: requests by final status code, bytes received and sent (serialized message sizes),
latency (a stream's latency is its whole life) and the RPCs in progress. The in-progress gauge is
the queue depth that matters here: a server runs at most `max_workers` streams at once
(`meshtrain_rpc_capacity`), and a stream holds its slot until it ends, so at capacity a new stream
is refused (RESOURCE_EXHAUSTED, counted here; clients retry or fail over) while unary RPCs such as
health checks keep slots of their own. A stream the client cancels (a failover, the end of a run) or
a stopping server cuts counts as CANCELLED. `start_metrics_server` serves the process's registry as
Prometheus text on `/metrics`:

    server, port, health = make_server(..., interceptors=[MetricsInterceptor("data", 16)])
    http, metrics_port = start_metrics_server(9100)   # curl 127.0.0.1:9100/metrics
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from meshtrain.services.common.errors import ConfigError

# One set of collectors per process (the default registry refuses duplicates); servers in the
# same process are told apart by the `service` label.
_lock = threading.Lock()
_collectors: dict[str, Any] = {}  # Counter, Gauge or Histogram


def _metrics() -> dict[str, Any]:
    with _lock:
        if not _collectors:
            labels = ["service", "method"]
            _collectors.update(
                requests=Counter(
                    "meshtrain_rpc_requests", "RPCs finished, by status code", labels + ["code"]
                ),
                received=Counter("meshtrain_rpc_received_bytes", "request bytes received", labels),
                sent=Counter("meshtrain_rpc_sent_bytes", "response bytes sent", labels),
                latency=Histogram(
                    "meshtrain_rpc_latency_seconds",
                    "RPC duration (a stream: its whole life)",
                    labels,
                    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600),
                ),
                in_flight=Gauge(
                    "meshtrain_rpc_in_flight", "RPCs in progress (queue depth)", labels
                ),
                capacity=Gauge(
                    "meshtrain_rpc_capacity", "RPCs the server runs at once", ["service"]
                ),
            )
        return _collectors


def _size(message) -> int:
    return message.ByteSize() if hasattr(message, "ByteSize") else 0


class MetricsInterceptor(grpc.ServerInterceptor):
    """Records requests, bytes, latency and in-flight RPCs for one server.

    Put it before `ErrorInterceptor` (outermost) so the status codes it records include the
    ones domain errors were mapped to.
    """

    def __init__(self, service: str, capacity: int | None = None):
        """Args:
        service: the `service` label ("data", "checkpoint", "trainer").
        capacity: the server's max concurrent RPCs, exported as `meshtrain_rpc_capacity`.
        """
        self.service = service
        self.m = _metrics()
        if capacity is not None:
            self.m["capacity"].labels(service).set(capacity)

    def _observe(self, method: str, context: grpc.ServicerContext):
        """Start timing an RPC of `method`; returns `done(error)`, to call once when it ends."""
        labels = (self.service, method)
        self.m["in_flight"].labels(*labels).inc()
        start = time.perf_counter()

        def done(error: BaseException | None) -> None:
            self.m["in_flight"].labels(*labels).dec()
            self.m["latency"].labels(*labels).observe(time.perf_counter() - start)
            code = context.code() if hasattr(context, "code") else None
            if code is None:  # nothing set: OK unless the handler raised (gRPC reports UNKNOWN)
                if isinstance(error, GeneratorExit) or (error is None and not context.is_active()):
                    code = grpc.StatusCode.CANCELLED  # the client went away, or the server stopped
                else:
                    code = grpc.StatusCode.UNKNOWN if error is not None else grpc.StatusCode.OK
            name = code.name if isinstance(code, grpc.StatusCode) else str(code)
            self.m["requests"].labels(*labels, name).inc()

        return done

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        received = self.m["received"].labels(self.service, method)
        sent = self.m["sent"].labels(self.service, method)

        def count_requests(request_iterator):
            for request in request_iterator:
                received.inc(_size(request))
                yield request

        def run_unary(inner, request, context):
            done = self._observe(method, context)
            error = None
            try:
                response = inner(request, context)
                sent.inc(_size(response))
                return response
            except BaseException as e:
                error = e
                raise
            finally:
                done(error)

        def run_stream(inner, request, context):
            done = self._observe(method, context)
            error = None
            try:
                for response in inner(request, context):
                    sent.inc(_size(response))
                    yield response
            except BaseException as e:  # GeneratorExit too: the client went away
                error = e
                raise
            finally:
                done(error)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            def unary_unary(request, context):
                received.inc(_size(request))
                return run_unary(inner_uu, request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_us = handler.unary_stream

            def unary_stream(request, context):
                received.inc(_size(request))
                yield from run_stream(inner_us, request, context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            inner_su = handler.stream_unary

            def stream_unary(request_iterator, context):
                return run_unary(inner_su, count_requests(request_iterator), context)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        inner_ss = handler.stream_stream

        def stream_stream(request_iterator, context):
            yield from run_stream(inner_ss, count_requests(request_iterator), context)

        return grpc.stream_stream_rpc_method_handler(
            stream_stream, handler.request_deserializer, handler.response_serializer
        )


def start_metrics_server(port: int = 0, host: str = "127.0.0.1"):
    """Serve this process's Prometheus metrics over HTTP (`/metrics`) from a daemon thread.

    Args:
        port: TCP port; 0 picks a free one.
        host: interface to bind.

    Returns:
        (http server, bound port); `server.shutdown()` stops it.

    Raises:
        ConfigError: the port is taken or may not be bound.
    """
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as e:
        raise ConfigError(
            f"cannot serve Prometheus metrics on {host}:{port} (--metrics-port; in use or "
            f"not allowed): {e}"
        ) from None
    return server, server.server_port
