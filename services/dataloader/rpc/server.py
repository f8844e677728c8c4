"""Run a DataService worker: `meshtrain data serve --port P` or `python -m meshtrain.services.dataloader.rpc.server`.

A worker is stateless, so capacity grows by starting more of them (any port, any host that
sees the dataset files at the same paths) and handing all addresses to the trainer's client.
The server has the standard health service and reflection (try
`grpcurl -plaintext 127.0.0.1:P list`) and stops gracefully on SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys

from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.grpc_utils import make_server, serve_forever
from meshtrain.services.common.metrics import MetricsInterceptor, start_metrics_server
from meshtrain.services.dataloader.cli import add_serve_arguments
from meshtrain.services.dataloader.rpc.servicer import SERVICE_NAME, DataServicer

log = logging.getLogger("meshtrain.data")


def start_server(port: int = 0, host: str = "127.0.0.1", max_workers: int = 16,
                 cache_indices: bool = True, metrics: bool = False, max_index_bytes: int | None = None):
    """Start a DataService worker in this process.

    Args:
        port: TCP port; 0 picks a free one.
        host: interface to bind; 127.0.0.1 unless serving other machines.
        max_workers: concurrent streams served.
        cache_indices: cache sample indices beside the datasets.
        metrics: record Prometheus RPC metrics (served by `start_metrics_server`).
        max_index_bytes: memory sample-index builds may take, one request's and all at once
            (None: half the machine's memory; see `DataServicer`).

    Returns:
        (server, bound port, health servicer).
    """
    servicer = DataServicer(cache_indices=cache_indices, max_index_bytes=max_index_bytes)
    interceptors = [MetricsInterceptor("data", max_workers)] if metrics else []
    return make_server([lambda s: pb_grpc.add_DataServiceServicer_to_server(servicer, s)],
                       [SERVICE_NAME], port=port, host=host, max_workers=max_workers,
                       interceptors=interceptors)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM; prints `listening on HOST:PORT` once ready (tests wait for it)."""
    p = argparse.ArgumentParser(prog="meshtrain data serve")
    add_serve_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Start a worker with the parsed `serve` flags and block until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    metrics = getattr(args, "metrics_port", None) is not None
    max_index_gib = getattr(args, "max_index_gib", None)
    if max_index_gib is not None and not 0 < max_index_gib < float("inf"):
        raise ConfigError(f"--max-index-gib {max_index_gib} must be a positive number of GiB")
    server, port, health = start_server(
        args.port, args.host, args.max_streams, metrics=metrics,
        max_index_bytes=None if max_index_gib is None else int(max_index_gib * 2**30))
    if metrics:
        try:
            _, metrics_port = start_metrics_server(args.metrics_port, args.host)
        except ConfigError:
            server.stop(0)  # the gRPC port is already bound: release it before exiting
            raise
        print(f"metrics on http://{args.host}:{metrics_port}/metrics", flush=True)
    serve_forever(server, health, grace_s=args.grace,
                  on_ready=lambda: print(f"listening on {args.host}:{port}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
