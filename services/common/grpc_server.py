"""A meshtrain gRPC server's lifetime: build, bind, serve until a signal, stop.

Every service's `rpc/server.py` builds its server with `make_server`, which adds the standard
health-checking service (`grpc.health.v1`), server reflection, raised message-size limits on
both directions (`grpc_utils.server_options`) and the interceptors of
`meshtrain.services.common.grpc_utils`: the caller's, then authentication and TLS as
`meshtrain.services.common.security.ServerSecurity` says (it refuses to bind an address beyond
loopback without authentication, serves TLS when given a certificate, and checks each call's
token against its method's scope), `StreamLimit`, `UndecodableRequests` and `ErrorInterceptor`.
A port in use or an address that cannot be bound is a `ConfigError` naming the port's flag.
`serve_forever` runs a started server until SIGTERM or SIGINT, marks it NOT_SERVING in the
health service first, and stops it with a grace period so streams in flight finish.

    server, port, health = make_server([lambda s: add_MyServicer_to_server(impl, s)],
                                       ["meshtrain.x.v1.MyService"], port=0)
    serve_forever(server, health, grace_s=5)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meshtrain.services.common.errors import ConfigError, MeshtrainError
from meshtrain.services.common.grpc_utils import (
    MAX_MESSAGE_BYTES,
    ErrorInterceptor,
    StreamLimit,
    UndecodableRequests,
    server_options,
)
from meshtrain.services.common.security import Scope, ServerSecurity
from meshtrain.services.common.signals import relayed_signals

log = logging.getLogger("meshtrain.grpc")

# Slots beyond the stream limit for unary RPCs (health checks, Describe, List, Commit): a
# server whose streams are all busy still answers its health probe.
UNARY_RESERVE = 8


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
    _check_address(security, host, port, port_flag)
    auth = security.interceptor(scopes or {})
    server = _new_server(
        max_workers,
        max_message_bytes,
        # Authentication after the caller's (metrics count refused calls too), before the stream
        # limit: a call that is refused never holds a stream slot.
        [*interceptors, *([auth] if auth else [])],
        ErrorInterceptor(error_table, translate_error),
    )
    for add in add_servicers:
        add(server)
    names = list(service_names)
    health_servicer = _add_health_and_reflection(server, names)
    bound = _bind(server, security.server_credentials(), host, port, port_flag)
    server.start()
    for name in names + [""]:  # "" is the whole server's status
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def _check_address(security: ServerSecurity, host: str, port: int, port_flag: str) -> None:
    """Refuse an address beyond loopback without authentication, and a port already in use."""
    security.check_bind(host, port)
    if port and _port_in_use(host, port):
        # Asked first: gRPC's own refusal logs a raw line and a GRPC_VERBOSITY hint to stderr.
        raise ConfigError(
            f"{host}:{port} is in use: pass another {port_flag}, or {port_flag} 0 for any free port"
        )


def _new_server(
    max_workers: int,
    max_message_bytes: int,
    outer: list[grpc.ServerInterceptor],
    errors: ErrorInterceptor,
) -> grpc.Server:
    """A server with `max_workers` stream slots besides `UNARY_RESERVE`, the size limits, and
    its interceptors: `outer` (the caller's, then authentication), the stream limit, the
    undecodable-request check and `errors`, in that order."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers + UNARY_RESERVE),
        interceptors=[
            *outer,
            StreamLimit(max_workers),
            UndecodableRequests(),
            errors,
        ],
        options=server_options(max_message_bytes),
        maximum_concurrent_rpcs=max_workers + UNARY_RESERVE,
    )


def _add_health_and_reflection(server: grpc.Server, names: list[str]) -> health.HealthServicer:
    """Add the health service to `server`, and reflection of `names`, health and reflection."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        names
        + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    return health_servicer


def _bind(
    server: grpc.Server,
    credentials: grpc.ServerCredentials | None,
    host: str,
    port: int,
    port_flag: str,
) -> int:
    """Bind `host:port` (TLS when `credentials` are given) and return the bound port."""
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
    return bound


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
