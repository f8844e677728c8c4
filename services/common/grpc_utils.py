"""Shared gRPC plumbing for meshtrain's services: server lifetime, health, errors, limits.

Every service's `rpc/server.py` builds its server with `make_server`, which adds the standard
health-checking service (`grpc.health.v1`), server reflection, raised message-size limits on
both directions and `ErrorInterceptor`, which turns a `MeshtrainError` raised by core code
into a gRPC status with the error's message (`DataError` and `ConfigError` are the caller's
fault: INVALID_ARGUMENT, except `DataUnavailableError`, a storage read that failed: UNAVAILABLE,
so clients try again or elsewhere, `DataNotFoundError`: NOT_FOUND, and `DataAccessDeniedError`,
storage the worker does not serve: PERMISSION_DENIED; other classes map through `ERROR_CODES` or a
per-server table; a server may also translate other exceptions, e.g. its storage's, into domain
errors). Any other exception is a bug: gRPC answers UNKNOWN with its own wording, which
`is_permanent` recognises, so clients do not retry it.
`serve_forever` runs a started server until SIGTERM or SIGINT, marks it NOT_SERVING in the
health service first, and stops it with a grace period so streams in flight finish.
`channel_options` gives clients the matching size limits and keepalive (`server_options`
lets servers accept those pings on a stream that is paused). Authentication and TLS
(`meshtrain.services.common.security.ServerSecurity`) are `make_server`'s too: it refuses to bind
an address beyond loopback without authentication, serves TLS when given a certificate, and
checks each call's token against its method's scope. `UndecodableRequests`, also installed by
`make_server`, answers a request message that does not decode INVALID_ARGUMENT in one log line.

    server, port = make_server([lambda s: add_MyServicer_to_server(impl, s)],
                               ["meshtrain.x.v1.MyService"], port=0)
    serve_forever(server, grace_s=5)
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meshtrain.services.common.errors import (
    LASTING_METADATA,
    CheckpointError,
    ConfigError,
    DataAccessDeniedError,
    DataError,
    DataNotFoundError,
    DataUnavailableError,
    InvalidRequestError,
    MeshtrainError,
    StorageUnavailableError,
)
from meshtrain.services.common.sanitize import LOG_LIMIT, Undecodable, loggable
from meshtrain.services.common.security import Scope, ServerSecurity
from meshtrain.services.common.signals import relayed_signals

log = logging.getLogger("meshtrain.grpc")

MAX_MESSAGE_BYTES = 64 << 20  # both ends raise gRPC's 4 MiB default to this

# Most specific class first; the first isinstance match wins.
ERROR_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (DataUnavailableError, grpc.StatusCode.UNAVAILABLE),  # storage, not the request: try again
    (DataNotFoundError, grpc.StatusCode.NOT_FOUND),
    (DataAccessDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (StorageUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (DataError, grpc.StatusCode.INVALID_ARGUMENT),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
    (MeshtrainError, grpc.StatusCode.FAILED_PRECONDITION),
]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for clients and servers: message limits and keepalive for long-lived streams.

    Args:
        max_message_bytes: largest message sent or received.

    Returns:
        A list for `grpc.insecure_channel(..., options=...)` / `grpc.server(options=...)`.
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # pings notice a dead peer on an idle stream (e.g. a SIGKILLed worker behind NAT)
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """`channel_options` plus a ping policy that accepts the clients' keepalive.

    gRPC servers by default allow one ping per 5 minutes while they send no data and answer a
    third early ping with GOAWAY "too_many_pings". A stream whose reader pauses (a trainer
    saving a checkpoint or evaluating with its prefetch queue full) sends no data, so its
    client's 10 s pings got it cut off after ~30 s, and every rank reconnected at once.
    """
    return channel_options(max_message_bytes) + [
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # below the clients' 10 s
        ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging
        ("grpc.so_reuseport", 0),  # without this, a second server on a busy port silently shares it
    ]


# Codes meaning "this server cannot do it now": worth retrying, or trying another server.
# Anything else is the request's fault (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, ...).
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)

# How gRPC's server words the UNKNOWN it sends when a handler raised an exception that nothing
# mapped to a status (a bug, or a request nothing validated).
HANDLER_RAISED = ("Exception calling application", "Exception iterating responses")


def is_lasting(e: grpc.RpcError) -> bool:
    """Whether the server marked its answer as failing the same way on every try
    (LASTING_METADATA: its storage's cause lasts), though the code is one worth retrying."""
    try:
        return LASTING_METADATA in tuple(e.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 -- an RpcError that is not a call (no metadata): not marked
        return False


def is_permanent(e: grpc.RpcError) -> bool:
    """Whether a failed call is the request's fault or a server bug (raise it at once) rather
    than worth another try, on this server or another.

    UNKNOWN is both: a server answers it when its handler raised something it does not map (a
    bug, or a request nothing validated), and the same code on the same request fails again, so
    retrying only delays the error (and repeats the handler's side effects); but gRPC's
    transport reports some failures as UNKNOWN too ("Stream removed" when a peer dies or a proxy
    cuts the stream), and those a retry may not meet. Only the first kind, recognised by gRPC's
    wording of it, is permanent.
    """
    code = e.code()
    if code == grpc.StatusCode.UNKNOWN:
        return (e.details() or "").startswith(HANDLER_RAISED)
    return code not in TRANSIENT_CODES


# Bytes of an error message sent as a status's details. Details travel percent-encoded in the
# trailers, which gRPC caps at 8 KiB (a soft limit): a longer message (a 15 kB backend error,
# a request naming a very long path) was dropped and the status became RESOURCE_EXHAUSTED,
# which clients retry, instead of the error.
MAX_DETAILS_BYTES = 2000


def status_details(message: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """`message` cut in the middle to at most `limit` UTF-8 bytes, so it fits a status; both
    ends are kept (a message names the path first and says what is wrong with it last)."""
    raw = message.encode()
    if len(raw) <= limit:
        return message
    half = (limit - 5) // 2
    return raw[:half].decode(errors="ignore") + " ... " + raw[-half:].decode(errors="ignore")


def status_for(exc: BaseException, table=None) -> grpc.StatusCode | None:
    """The status code for a domain error, or None if `exc` is not one."""
    for cls, code in (table or []) + ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return None


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps `MeshtrainError` subclasses raised by servicer methods to gRPC status codes.

    Works for all four method kinds: for a response stream the error may surface while
    iterating, so the response iterator is wrapped too. Other exceptions that `translate` does
    not turn into a domain error propagate and gRPC reports them as UNKNOWN (and logs them):
    they are bugs, not bad requests. Either way the message is cut to `MAX_DETAILS_BYTES`.
    """

    def __init__(
        self,
        table: list[tuple[type[BaseException], grpc.StatusCode]] | None = None,
        translate: Callable[[Exception], MeshtrainError | None] | None = None,
    ):
        """Args:
        table: extra (exception class, status) pairs checked before `ERROR_CODES`.
        translate: the domain error for another exception (e.g. a storage OSError: a
            `StorageUnavailableError` naming the path), or None: a bug.
        """
        self.table = table or []
        self.translate = translate

    def _other(self, context: grpc.ServicerContext, exc: Exception):
        """An exception that is not a MeshtrainError: translated and mapped, or re-raised."""
        domain = self.translate(exc) if self.translate is not None else None
        if domain is None:
            _raise_fitting(exc)
        self._abort(context, domain)

    def _abort(self, context: grpc.ServicerContext, exc: BaseException):
        code = status_for(exc, self.table)
        if code is None:
            raise exc
        log.info(
            "rpc error %s: %s", code.name, status_details(str(exc), 500)
        )  # may quote a client's strings
        if getattr(exc, "lasting", False) is True:
            context.set_trailing_metadata((LASTING_METADATA,))
        context.abort(code, status_details(str(exc)))

    def _guard(self, inner, streams_responses: bool):
        """`inner` with domain errors mapped, for a method returning a response or a stream."""
        if streams_responses:

            def guarded_stream(request, context):
                try:
                    yield from inner(request, context)
                except MeshtrainError as e:
                    self._abort(context, e)
                except Exception as e:  # noqa: BLE001 -- mapped or re-raised (cut to fit)
                    self._other(context, e)

            return guarded_stream

        def guarded(request, context):
            try:
                return inner(request, context)
            except MeshtrainError as e:
                self._abort(context, e)
            except Exception as e:  # noqa: BLE001 -- mapped or re-raised (cut to fit)
                self._other(context, e)

        return guarded

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        return None if handler is None else rewrap_handler(handler, self._guard)


def _raise_fitting(exc: Exception) -> NoReturn:
    """Re-raise a bug's exception for gRPC to report as UNKNOWN, its message cut to fit a status
    (a longer one, e.g. an OSError naming a 20 kB path, became RESOURCE_EXHAUSTED, retried)."""
    if len(str(exc).encode()) <= MAX_DETAILS_BYTES:
        raise exc
    raise RuntimeError(status_details(f"{type(exc).__name__}: {exc}")) from exc


def put_unless_stopped(q: queue.Queue, item, stop: threading.Event, poll_s: float = 0.1) -> bool:
    """Put `item` into the bounded queue `q`, waiting for room until `stop` is set (looked at
    every `poll_s` seconds): True once it is in, False when the consumer stopped first (a
    stream's reader thread must not block forever on a handler or trainer that went away)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=poll_s)
            return True
        except queue.Full:
            pass
    return False


class StreamIdleError(Exception):
    """No message arrived on a client stream for `idle_s` seconds (see `until_idle`)."""

    def __init__(self, idle_s: float):
        super().__init__(f"no message for {idle_s:g} s")
        self.idle_s = idle_s


def until_idle(requests: Iterator, idle_s: float | None) -> Iterator:
    """`requests` (a handler's request iterator), raising StreamIdleError in the handler when
    no message arrives for `idle_s` seconds (None or 0: wait forever, as gRPC does).

    A live client that stops sending keeps its stream open indefinitely (keepalive pings still
    answer), holding its handler thread and whatever the handler reserved for it. gRPC's
    request iterator blocks without a timeout, so a reader thread pulls the messages and hands
    them over one at a time (at most two beyond gRPC's own buffers: flow control still holds
    the client back); the handler waits for each with the timeout. The reader ends with the
    call: once the handler has returned or aborted, gRPC ends the iterator.
    """
    if not idle_s:
        yield from requests
        return
    handover: queue.Queue = queue.Queue(maxsize=1)
    done = threading.Event()  # the handler stopped reading

    def hand(item) -> bool:
        return put_unless_stopped(handover, item, done, poll_s=0.5)

    def pump() -> None:
        try:
            for message in requests:
                if not hand(("message", message)):
                    return
            hand(("end", None))
        except BaseException as e:  # noqa: BLE001 -- raised in the handler's thread
            hand(("error", e))

    threading.Thread(target=pump, name="stream-reader", daemon=True).start()
    try:
        while True:
            try:
                kind, value = handover.get(timeout=idle_s)
            except queue.Empty:
                raise StreamIdleError(idle_s) from None
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        done.set()


def rewrap_handler(handler: grpc.RpcMethodHandler, around: Callable) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by `around(behaviour, streams_responses)`, same
    kind (any of the four) and serializers: the plumbing every wrapping interceptor needs."""
    for kind, make, streams in (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
    ):
        inner = getattr(handler, kind)
        if inner is not None:
            return make(
                around(inner, streams), handler.request_deserializer, handler.response_serializer
            )
    return handler


# Slots beyond the stream limit for unary RPCs (health checks, Describe, List, Commit): a
# server whose streams are all busy still answers its health probe.
UNARY_RESERVE = 8


class StreamLimit(grpc.ServerInterceptor):
    """At most `max_streams` streaming RPCs at once; one more is refused with RESOURCE_EXHAUSTED
    (which clients retry or fail over on) instead of taking the slots unary RPCs need."""

    def __init__(self, max_streams: int):
        self.max_streams = max_streams
        self._slots = threading.BoundedSemaphore(max_streams)

    def _take(self, context) -> None:
        if not self._slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"all {self.max_streams} stream slots of this server are in use",
            )

    def _limited(self, inner, streams_responses: bool):
        if streams_responses:

            def streaming(request, context):
                self._take(context)
                try:
                    yield from inner(request, context)
                finally:
                    self._slots.release()

            return streaming

        def client_streaming(request_iterator, context):
            self._take(context)
            try:
                return inner(request_iterator, context)
            finally:
                self._slots.release()

        return client_streaming

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        return rewrap_handler(handler, self._limited)


def _tolerant(deserializer):
    """`deserializer`, returning an `Undecodable` instead of raising (gRPC answered a raising
    one with INTERNAL "Exception deserializing request!" and logged a traceback)."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 -- any decoding error is the request's fault
            return Undecodable(e)

    return deserialize


class UndecodableRequests(grpc.ServerInterceptor):
    """Answers a request message that does not decode with INVALID_ARGUMENT naming the method
    and the error, and logs it as one line (a client's fault, not the server's: gRPC itself
    answered INTERNAL and logged a traceback for each).

    Every later interceptor's handler keeps the tolerant deserializer (`rewrap_handler`
    passes it on), and the check runs where the handler receives the message: before the call for
    one request, as each arrives for a request stream.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def refuse(context, bad: Undecodable):
            log.warning(
                "refused a request to %s that does not decode as its message type: %s: %s",
                method,
                type(bad.exc).__name__,
                loggable(str(bad.exc)),
            )
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request to {method} does not decode as its message type: "
                f"{type(bad.exc).__name__}: {str(bad.exc)[:LOG_LIMIT]}",
            )

        def checked(requests, context):
            for request in requests:
                if isinstance(request, Undecodable):
                    refuse(context, request)
                yield request

        for kind, make in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        ):
            inner = getattr(handler, kind)
            if inner is None:
                continue
            if handler.request_streaming:

                def behaviour(requests, context, inner=inner):
                    return inner(checked(requests, context), context)
            else:

                def behaviour(request, context, inner=inner):
                    if isinstance(request, Undecodable):
                        refuse(context, request)
                    return inner(request, context)

            return make(
                behaviour, _tolerant(handler.request_deserializer), handler.response_serializer
            )
        return handler


def make_server(
    add_servicers: Iterable[Callable[[grpc.Server], None]],
    service_names: Iterable[str],
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 16,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    error_table: list | None = None,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
    translate_error: Callable[[Exception], MeshtrainError | None] | None = None,
    security: ServerSecurity | None = None,
    scopes: dict[str, Scope] | None = None,
    port_flag: str = "--port",
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build and start a server with health, reflection, size limits, error mapping and, as
    `security` says, TLS and token or client-certificate checks.

    Args:
        add_servicers: callables that register servicers on the server.
        service_names: full names of those services (for health and reflection).
        port: TCP port; 0 picks a free one.
        host: interface to bind ("127.0.0.1" by default; "0.0.0.0" to serve the network, which
            needs `security` to authenticate callers or to be `insecure`).
        max_workers: streams served at once (each holds a thread); one more is refused with
            RESOURCE_EXHAUSTED. Unary RPCs (health checks) get `UNARY_RESERVE` slots besides.
        max_message_bytes: message limit in both directions.
        error_table: extra (exception class, status code) pairs for `ErrorInterceptor`.
        interceptors: run before `ErrorInterceptor` (outermost first), e.g. a
            `meshtrain.services.common.metrics.MetricsInterceptor`, which then sees mapped status
            codes.
        translate_error: `ErrorInterceptor`'s `translate` (e.g. storage errors -> UNAVAILABLE).
        security: tokens, TLS files, insecure; None: no authentication, plaintext, loopback only.
        scopes: full method name -> scope it needs (`security.method_scopes`); a method missing
            from it needs admin, except the health check and reflection.
        port_flag: the flag that sets `port`, which a port in use names.

    Returns:
        (server, bound port, health servicer); the server is started and SERVING.

    Raises:
        ConfigError: the address cannot be bound, or is beyond loopback without authentication.
    """
    security = security or ServerSecurity()
    security.check_bind(host, port)
    if port and _port_in_use(host, port):
        # Asked first: gRPC's own refusal logs a raw line and a GRPC_VERBOSITY hint to stderr.
        raise ConfigError(
            f"{host}:{port} is in use: pass another {port_flag}, or {port_flag} 0 for any free port"
        )
    auth = security.interceptor(scopes or {})
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers + UNARY_RESERVE),
        # After the caller's (metrics count refused calls too), before the stream limit: a call
        # that is refused never holds a stream slot.
        interceptors=[
            *interceptors,
            *([auth] if auth else []),
            StreamLimit(max_workers),
            UndecodableRequests(),
            ErrorInterceptor(error_table, translate_error),
        ],
        options=server_options(max_message_bytes),
        maximum_concurrent_rpcs=max_workers + UNARY_RESERVE,
    )
    for add in add_servicers:
        add(server)
    names = list(service_names)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        names
        + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    credentials = security.server_credentials()
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:  # grpc raises a bare RuntimeError (naming GRPC_VERBOSITY) when bind fails
        bound = 0
    if bound == 0:
        raise ConfigError(
            f"cannot bind {host}:{port} (in use or not allowed): pass another {port_flag}, "
            f"or {port_flag} 0 for any free port"
        )
    server.start()
    for name in names + [""]:  # "" is the whole server's status
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def _port_in_use(host: str, port: int) -> bool:
    """Whether a listener holds TCP `port` on an address of `host` (as gRPC binds it:
    SO_REUSEADDR, so a port a closed server left in TIME_WAIT counts as free)."""
    import errno
    import socket

    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False  # gRPC reports a name it cannot resolve
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def serve_forever(
    server: grpc.Server,
    health_servicer: health.HealthServicer | None = None,
    grace_s: float = 5.0,
    on_ready: Callable[[], None] | None = None,
    exit_process: bool = True,
    on_stopping: Callable[[], None] | None = None,
) -> None:
    """Block until SIGTERM/SIGINT, then stop gracefully.

    Health turns NOT_SERVING first so load balancers stop routing new streams here, then
    `server.stop(grace_s)` lets streams in flight run for up to `grace_s` seconds.

    Args:
        server: a started server.
        health_servicer: its health service, if any.
        grace_s: seconds granted to RPCs in flight.
        on_ready: called once the signal handlers are in place, e.g. to announce the port:
            a supervisor that sends SIGTERM right after the announcement then gets a clean stop.
        on_stopping: called when the signal arrives, before the grace period, e.g. to withdraw
            an announcement so that clients stop choosing this server.
        exit_process: once stopped, make sure the process can exit: a handler thread still
            blocked in a stream that gRPC cancelled (seen: a data stream waiting on flow
            control) would otherwise keep the interpreter alive at exit, joining it forever.
    """
    stop = threading.Event()

    def on_signal(
        sig: signal.Signals,
    ) -> None:  # on the relay thread (a handler must not set an Event)
        log.info("%s: stopping gRPC server (grace %.1fs)", sig.name, grace_s)
        stop.set()

    with relayed_signals(
        (signal.SIGTERM, signal.SIGINT), on_signal, name="grpc-stop-relay"
    ) as installed:
        if not installed:
            raise RuntimeError(
                "serve_forever waits for SIGTERM or SIGINT, which only the main thread can handle"
            )
        if on_ready is not None:
            on_ready()
        stop.wait()
        if on_stopping is not None:
            on_stopping()
        if health_servicer is not None:
            health_servicer.enter_graceful_shutdown()
        server.stop(grace_s).wait(grace_s + 5.0)
    if exit_process:
        _exit_when_stuck(timeout_s=10.0)


def _exit_when_stuck(timeout_s: float) -> None:
    """If the interpreter has not exited `timeout_s` after this returns, exit it anyway.

    At exit Python joins every non-daemon thread, gRPC's handler threads included; one still
    blocked in a cancelled stream would hang the process forever. A daemon watchdog keeps
    running while those joins happen, so a normal exit wins and a stuck one is cut short.
    """

    def watchdog() -> None:
        time.sleep(timeout_s)
        log.warning(
            "still running %.0f s after the server stopped (a handler thread is stuck); exiting",
            timeout_s,
        )
        logging.shutdown()
        os._exit(0)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
