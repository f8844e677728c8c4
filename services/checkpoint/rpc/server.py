"""Run the checkpoint service: `meshtrain ckpt serve ROOT --port P` or
`python -m meshtrain.services.checkpoint.rpc.server ROOT --port P`.

One service serves one checkpoint root (local folder, `s3://` with endpoint and credentials
from the environment, ...). It has the standard health service and reflection (try
`grpcurl -plaintext 127.0.0.1:P list`), binds 127.0.0.1 unless told otherwise, and stops
gracefully on SIGTERM: saves in flight get the grace period, and a save cut short is simply
not committed. With `--token-file` (or $MESHTRAIN_TOKEN) every call needs a token of the
method's scope (`SCOPES`: reads need read, saves write, deleting or replacing a committed step
admin); `--tls-cert/--tls-key` serve TLS and `--tls-client-ca` requires client certificates
(`meshtrain.services.common.security`). An interface other than loopback needs a token or client
certificates, or `--insecure`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc
from meshtrain.services.checkpoint.config import ServeConfig, add_serve_arguments
from meshtrain.services.checkpoint.rpc.limits import MAX_COMMIT_TIMEOUT, MAX_COMMITS, MAX_WRITERS
from meshtrain.services.checkpoint.rpc.servicer import SERVICE_NAME, CheckpointServicer
from meshtrain.services.common.errors import (
    ConfigError,
    StorageUnavailableError,
    is_lasting_storage_error,
    is_storage_error,
)
from meshtrain.services.common.grpc_server import make_server, serve_forever
from meshtrain.services.common.metrics import MetricsInterceptor, start_metrics_server
from meshtrain.services.common.security import ADMIN, READ, WRITE, ServerSecurity, method_scopes

log = logging.getLogger("meshtrain.checkpoint")


def storage_unavailable(root: str) -> Callable[[Exception], StorageUnavailableError | None]:
    """The servicer's error translation: an exception of its storage (an OSError, botocore's
    own) becomes a StorageUnavailableError naming the root and the path (UNAVAILABLE: clients
    retry it); anything else is left a bug (UNKNOWN, which clients do not retry)."""

    def translate(exc: Exception) -> StorageUnavailableError | None:
        if not is_storage_error(exc):
            return None
        return StorageUnavailableError(
            f"checkpoint storage {root} failed: {type(exc).__name__}: {exc}",
            lasting=is_lasting_storage_error(exc),
        )

    return translate


# The scope each method needs (admin implies write implies read). BeginSave replacing a committed
# step is admin's, like deleting one: a write token may add checkpoints, not destroy them.
SCOPES = method_scopes(
    SERVICE_NAME,
    {
        "List": READ,
        "Describe": READ,
        "ReadSlice": READ,
        "BeginSave": lambda request: ADMIN if request.overwrite else WRITE,
        "WriteShards": WRITE,
        "Commit": WRITE,
        "AbortSave": WRITE,
        "ResumeSave": WRITE,
        "Delete": ADMIN,
        "ApplyRetention": ADMIN,
    },
)


def start_server(
    root: str,
    port: int = 0,
    host: str = "127.0.0.1",
    max_streams: int = 16,
    commit_timeout: float = 600.0,
    max_chunk_bytes: int = 4 << 20,
    max_inflight_bytes: int = 1 << 30,
    metrics: bool = False,
    stream_idle_timeout: float = 120.0,
    max_writers: int = MAX_WRITERS,
    max_commit_timeout: float = MAX_COMMIT_TIMEOUT,
    max_commits: int = MAX_COMMITS,
    security: ServerSecurity | None = None,
):
    """Starts a CheckpointService in this process.

    Args:
        root: the checkpoint root URL it serves.
        port: TCP port; 0 picks a free one.
        host: interface to bind; 127.0.0.1 unless serving other machines.
        max_streams: concurrent RPCs (each writer stream and waiting commit holds one).
        commit_timeout: default seconds a commit waits for its writers.
        max_chunk_bytes: largest data chunk accepted.
        max_inflight_bytes: box bytes held in memory at once over all streams.
        metrics: record Prometheus RPC metrics (served by `start_metrics_server`).
        stream_idle_timeout: seconds a writer's stream may send nothing before it is aborted
            and its share of the in-flight budget freed, or a slice's reader may take nothing
            before its stream is cancelled (0: never).
        max_writers: the most writers one save may have.
        max_commit_timeout: the longest a Commit waits for its writers, whatever it asks.
        max_commits: Commits waiting at once (one more: RESOURCE_EXHAUSTED).
        security: tokens and TLS (None: none, loopback only).

    Returns:
        (server, bound port, health servicer).
    """
    servicer = CheckpointServicer(
        root,
        commit_timeout,
        max_chunk_bytes,
        max_inflight_bytes,
        stream_idle_timeout,
        max_writers=max_writers,
        max_commit_timeout=max_commit_timeout,
        max_commits=max_commits,
    )
    return make_server(
        [lambda s: pb_grpc.add_CheckpointServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        port=port,
        host=host,
        max_workers=max_streams,
        max_message_bytes=max(2 * max_chunk_bytes, 8 << 20),
        interceptors=[MetricsInterceptor("checkpoint", max_streams)] if metrics else [],
        translate_error=storage_unavailable(root),
        security=security,
        scopes=SCOPES,
    )


def run(config: ServeConfig) -> int:
    """Starts the service `config` describes and blocks until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server, port, health = start_server(
        config.root,
        config.port,
        config.host,
        config.max_streams,
        config.commit_timeout,
        int(config.max_chunk_mb * 2**20),
        int(config.max_inflight_mb * 2**20),
        metrics=config.metrics_port is not None,
        stream_idle_timeout=config.stream_idle_timeout,
        max_writers=config.max_writers,
        max_commit_timeout=config.max_commit_timeout,
        max_commits=config.max_commits,
        security=ServerSecurity.from_files(
            config.token_file,
            config.tls_cert,
            config.tls_key,
            config.tls_client_ca,
            insecure=config.insecure,
        ),
    )
    if config.metrics_port is not None:
        try:
            _, metrics_port = start_metrics_server(config.metrics_port, config.host)
        except ConfigError:
            server.stop(0)  # the gRPC port is already bound: release it before exiting
            raise
        print(f"metrics on http://{config.host}:{metrics_port}/metrics", flush=True)
    print(f"listening on {config.host}:{port}", flush=True)
    serve_forever(server, health, grace_s=config.grace)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM; prints `listening on HOST:PORT` once ready (tests wait for it)."""
    p = argparse.ArgumentParser(prog="meshtrain ckpt serve")
    add_serve_arguments(p)
    return run(ServeConfig.from_args(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
