"""Readiness checks for the launcher: the standard gRPC health protocol and plain HTTP.

A gRPC child is ready when `grpc.health.v1.Health/Check` for the whole server ("") answers
SERVING; an HTTP child (the S3 store) when its port answers any HTTP response. Run as a
module it is the probe of compose health checks and the Slurm scripts:

    python -m meshtrain.services.launcher.health 127.0.0.1:7001 [--wait 120]  # exit 0 when SERVING
    python -m meshtrain.services.launcher.health --http http://127.0.0.1:8333/
    python -m meshtrain.services.launcher.health 127.0.0.1:7001 --tls-ca ca.pem \\
        [--tls-cert c.pem --tls-key c.key]

The health check needs no token; a server that serves TLS needs `--tls-ca` (and, with mutual
TLS, a client certificate).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from meshtrain.services.common.client_security import ClientSecurity, add_client_arguments
from meshtrain.services.launcher.topology import Child, wait_until


def grpc_serving(
    address: str, timeout_s: float = 1.0, security: ClientSecurity | None = None
) -> bool:
    """True when the server at `address` reports SERVING for "" (the whole server).

    Args:
        address: HOST:PORT.
        timeout_s: deadline of the check.
        security: TLS settings for a server that serves TLS (None: plaintext).
    """
    # Imported here: `meshtrain up` imports this module while it still only validates its
    # command line, which needs no grpc.
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with (security or ClientSecurity()).channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when `url` gives any HTTP response (an S3 gateway answers 403 without credentials)."""
    try:
        urllib.request.urlopen(url, timeout=timeout_s)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def wait_serving(timeout_s: float = 120.0, stop: threading.Event | None = None):
    """A `wait` for `Topology.start`: blocks until the child's gRPC health check says SERVING.

    Args:
        timeout_s: how long a child may take to start (importing torch is most of it).
        stop: set, it ends the wait with StopRequested (Ctrl-C during startup).
    """

    def wait(child: Child) -> None:
        address = f"127.0.0.1:{child.port}"
        wait_until(
            lambda: grpc_serving(address), timeout_s, f"serving on {address}", child, stop=stop
        )

    return wait


def wait_http(timeout_s: float = 60.0, stop: threading.Event | None = None):
    """A `wait` for `Topology.start`: blocks until http://127.0.0.1:PORT answers."""

    def wait(child: Child) -> None:
        url = f"http://127.0.0.1:{child.port}"
        wait_until(lambda: http_answers(url), timeout_s, f"answering on {url}", child, stop=stop)

    return wait


def main(argv: list[str] | None = None) -> int:
    """`python -m meshtrain.services.launcher.health HOST:PORT [--timeout S]`: exit 0 when SERVING.

    The probe of compose health checks and Slurm scripts (no grpc_health_probe binary needed).
    """
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m meshtrain.services.launcher.health",
        description="Exit 0 when a gRPC server reports SERVING, else 1.",
    )
    p.add_argument("address", nargs="?", help="HOST:PORT of a gRPC server, or with --http a URL")
    p.add_argument(
        "--from-env",
        action="store_true",
        help="probe what $MESHTRAIN_HEALTH names (HOST:PORT, or an http:// URL); healthy when it "
        "is unset (a container image's HEALTHCHECK: only services set it)",
    )
    p.add_argument("--http", action="store_true", help="check that the URL answers HTTP instead")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for the check")
    p.add_argument("--wait", type=float, default=0.0, help="keep trying this many seconds")
    add_client_arguments(p)
    args = p.parse_args(argv)
    if args.from_env:
        if args.address:
            p.error("--from-env takes no address")
        args.address = os.environ.get("MESHTRAIN_HEALTH", "").strip()
        if not args.address:
            return 0
        args.http = args.address.startswith(("http://", "https://"))
    elif not args.address:
        p.error("an address is required (or --from-env)")
    deadline = time.monotonic() + args.wait
    check: Callable[[str, float], bool]
    if args.http:
        check = http_answers
    else:
        security = ClientSecurity.from_args(args)
        check = lambda address, timeout: grpc_serving(address, timeout, security)  # noqa: E731
    while not check(args.address, args.timeout):
        if time.monotonic() >= deadline:
            print(f"{args.address}: not serving", file=sys.stderr)
            return 1
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
