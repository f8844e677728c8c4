"""Run a DataService worker: `meshtrain data serve --port P` or
`python -m meshtrain.services.dataloader.rpc.server`.

A worker is stateless, so capacity grows by starting more of them (any port, any host that
sees the dataset files at the same paths) and handing all addresses to the trainer's client.
The server has the standard health service and reflection (try
`grpcurl -plaintext 127.0.0.1:P list`) and stops gracefully on SIGTERM. With `--token-file` (or
$MESHTRAIN_TOKEN) every call needs a token of scope read; `--tls-cert/--tls-key` serve TLS and
`--tls-client-ca` requires client certificates (`meshtrain.services.common.security`). An
interface other than loopback needs a token or client certificates, or `--insecure`. With
`--announce DIR` the worker writes its address into DIR once it serves and withdraws it when
SIGTERM arrives, so trainers given `dir:DIR` find it (`discovery`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.grpc_server import make_server, serve_forever
from meshtrain.services.common.metrics import MetricsInterceptor, start_metrics_server
from meshtrain.services.common.security import READ, ServerSecurity, method_scopes
from meshtrain.services.dataloader.config import ServeConfig, add_serve_arguments
from meshtrain.services.dataloader.rpc.discovery import advertised_host, announce
from meshtrain.services.dataloader.rpc.servicer import SERVICE_NAME, DataLimits, DataServicer

log = logging.getLogger("meshtrain.data")

SCOPES = method_scopes(SERVICE_NAME, {"StreamBatches": READ, "Describe": READ})


def start_server(
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 16,
    cache_indices: bool = True,
    metrics: bool = False,
    max_index_bytes: int | None = None,
    limits: DataLimits | None = None,
    security: ServerSecurity | None = None,
):
    """Start a DataService worker in this process.

    Args:
        port: TCP port; 0 picks a free one.
        host: interface to bind; 127.0.0.1 unless serving other machines.
        max_workers: concurrent streams served.
        cache_indices: cache sample indices (in `limits.index_cache_dir`).
        metrics: record Prometheus RPC metrics (served by `start_metrics_server`).
        max_index_bytes: memory sample-index builds may take, one request's and all at once
            (None: half the machine's memory; see `DataServicer`).
        limits: what clients may ask for (None: `DataLimits()`): num_samples, the index
            cache's folder and quota, stream idle timeout, streams per client.
        security: tokens and TLS (None: none, loopback only).

    Returns:
        (server, bound port, health servicer).
    """
    servicer = DataServicer(
        cache_indices=cache_indices, max_index_bytes=max_index_bytes, limits=limits
    )
    interceptors = [MetricsInterceptor("data", max_workers)] if metrics else []
    return make_server(
        [lambda s: pb_grpc.add_DataServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        port=port,
        host=host,
        max_workers=max_workers,
        interceptors=interceptors,
        security=security,
        scopes=SCOPES,
    )


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM; prints `listening on HOST:PORT` once ready (tests wait for it)."""
    p = argparse.ArgumentParser(prog="meshtrain data serve")
    add_serve_arguments(p)
    return run(ServeConfig.from_args(p.parse_args(argv)))


def run(config: ServeConfig) -> int:
    """Start a worker with `config` and block until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    metrics = config.metrics_port is not None
    server, port, health = start_server(
        config.port,
        config.host,
        config.max_streams,
        metrics=metrics,
        max_index_bytes=(
            None if config.max_index_gib is None else int(config.max_index_gib * 2**30)
        ),
        limits=DataLimits(
            max_samples=config.max_samples,
            index_cache_dir=config.index_cache_dir,
            index_cache_bytes=int(config.index_cache_gib * 2**30),
            stream_idle_timeout=config.stream_idle_timeout,
            max_streams_per_client=config.max_streams_per_client,
            allow_roots=None if config.allow_root is None else tuple(config.allow_root),
        ),
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
    announcement = contextlib.ExitStack()

    def ready() -> None:
        if config.announce:
            address = f"{config.advertise or advertised_host(config.host)}:{port}"
            path = announcement.enter_context(announce(config.announce, address))
            log.info("announced as %s in %s", address, path)
        print(f"listening on {config.host}:{port}", flush=True)

    with announcement:
        serve_forever(
            server, health, grace_s=config.grace, on_ready=ready, on_stopping=announcement.close
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
