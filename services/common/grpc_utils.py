"""Shared gRPC plumbing for meshtrain's services: options, error classification, interceptors.

`ErrorInterceptor` turns a `MeshtrainError` raised by core code into a gRPC status with the
error's message (`DataError` and `ConfigError` are the caller's fault: INVALID_ARGUMENT, except
`DataUnavailableError`, a storage read that failed: UNAVAILABLE, so clients try again or
elsewhere, `DataNotFoundError`: NOT_FOUND, and `DataAccessDeniedError`, storage the worker does
not serve: PERMISSION_DENIED; other classes map through `ERROR_CODES` or a per-server table; a
server may also translate other exceptions, e.g. its storage's, into domain errors). Any other
exception is a bug: gRPC answers UNKNOWN with its own wording, which `is_permanent` recognises,
so clients do not retry it. `StreamLimit` caps a server's streams, `UndecodableRequests`
answers a request message that does not decode INVALID_ARGUMENT in one log line, and
`rewrap_handler` is what every wrapping interceptor needs; `until_idle` and `put_unless_stopped`
guard a handler's request stream. `channel_options` gives clients the matching size limits and
keepalive (`server_options` lets servers accept those pings on a stream that is paused). A
server's lifetime (`make_server`, which installs these interceptors, and `serve_forever`) is
`meshtrain.services.common.grpc_server`'s.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc

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
