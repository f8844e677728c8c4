"""The trainer's control endpoint: a gRPC TrainerControl service on rank 0, plus Prometheus gauges.

`train()` calls `serve_control(trainer, port)` on rank 0 when `train.control_port` is set and
`.stop()`s what it returns when the run ends. The endpoint answers Status (step, loss,
tokens/s, ETA, last checkpoint), Checkpoint (save after the current step) and Stop (save,
then end with exit status 0); `meshtrain status|stop ADDR|RUN_DIR` are its command line.
The bound address is written to RUN_DIR/control.addr with a random run token, which is how a
run directory resolves to an address (a call carrying another run's token is refused). It binds
`train.control_host` (else $MESHTRAIN_CONTROL_HOST, else 127.0.0.1; 0.0.0.0 in a container).
With `train.metrics_port` (else $MESHTRAIN_METRICS_PORT; 0: any free port, written to
RUN_DIR/metrics.addr) the trainer's step, loss and tokens/s are exported as Prometheus gauges
there, with the endpoint's RPC metrics.
Every call needs the run token; with `auth.token_file` (or $MESHTRAIN_TOKEN) a bearer token as
well, of scope read for Status and admin for Checkpoint and Stop; `auth.tls_cert_file` serves TLS
and `auth.tls_client_ca_file` requires client certificates. An interface other than loopback
needs a token or client certificates, or `auth.insecure`.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from meshtrain.protos.trainer.v1 import trainer_pb2_grpc as pb_grpc
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.grpc_server import make_server
from meshtrain.services.common.metrics import MetricsInterceptor, start_metrics_server
from meshtrain.services.common.security import (
    ADMIN,
    READ,
    TOKEN_ENV,
    AuthConfig,
    ServerSecurity,
    method_scopes,
)
from meshtrain.services.trainer.rpc.client import ADDR_FILE, write_address_file
from meshtrain.services.trainer.rpc.servicer import SERVICE_NAME, TrainerControlServicer

log = logging.getLogger("meshtrain.trainer")

METRICS_PORT_ENV = "MESHTRAIN_METRICS_PORT"
HOST_ENV = "MESHTRAIN_CONTROL_HOST"  # 0.0.0.0 in a container whose port is published
METRICS_ADDR_FILE = "metrics.addr"
SCOPES = method_scopes(SERVICE_NAME, {"Status": READ, "Checkpoint": ADMIN, "Stop": ADMIN})

_gauges: dict[str, Gauge] = {}


def _trainer_gauges(trainer) -> None:
    """Point the process's trainer gauges at `trainer.progress` (read at scrape time)."""
    docs = {
        "step": "optimizer steps completed",
        "train_iters": "steps the run is configured for",
        "loss": "training loss at the last logged step",
        "tokens_per_s": "training throughput",
        "eta_s": "seconds left at the recent step time",
    }
    for key, doc in docs.items():
        if key not in _gauges:  # the registry refuses a second gauge of the same name
            _gauges[key] = Gauge(f"meshtrain_trainer_{key}", doc)

        # NaN until the first logged step, so a dashboard shows a gap rather than a fake zero
        def value(k: str = key) -> float:
            return float("nan") if trainer.progress.get(k) is None else float(trainer.progress[k])

        _gauges[key].set_function(value)


@dataclass
class ControlEndpoint:
    """A running control endpoint; `stop()` ends the gRPC and metrics servers."""

    address: str
    server: Any  # grpc.Server
    run_dir: Path
    metrics_address: str | None = None
    _http: Any = field(default=None, repr=False)  # the metrics' HTTP server

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving and remove the address files, so a finished run does not look reachable."""
        self.server.stop(grace_s).wait()
        if self._http is not None:
            self._http.shutdown()
        for name in (ADDR_FILE, METRICS_ADDR_FILE):
            (self.run_dir / name).unlink(missing_ok=True)


def serve_control(
    trainer,
    port: int,
    host: str | None = None,
    metrics_port: int | None = None,
    auth: AuthConfig | None = None,
) -> ControlEndpoint:
    """Start the control endpoint for `trainer` (rank 0 only).

    Args:
        trainer: a `meshtrain.services.trainer.train.Trainer`.
        port: TCP port; 0 picks a free one and writes HOST:PORT to RUN_DIR/control.addr.
        host: interface to bind; None reads $MESHTRAIN_CONTROL_HOST, else 127.0.0.1.
        metrics_port: Prometheus port (0: any free one, written to RUN_DIR/metrics.addr);
            None reads $MESHTRAIN_METRICS_PORT, and without it no metrics are served.
        auth: the job's `[auth]` section: the tokens (`token_file`, else $MESHTRAIN_TOKEN) and TLS
            files the endpoint serves with, and whether it may bind beyond loopback without them.

    Returns:
        The started `ControlEndpoint`.
    """
    token = secrets.token_hex(16)  # this endpoint's run token (services/trainer/rpc/client.py)
    servicer = TrainerControlServicer(trainer, token)
    host = host or os.environ.get(HOST_ENV) or "127.0.0.1"
    if metrics_port is None and os.environ.get(METRICS_PORT_ENV):
        metrics_port = int(os.environ[METRICS_PORT_ENV])
    interceptors = [MetricsInterceptor("trainer", 4)] if metrics_port is not None else []
    auth = auth or AuthConfig()
    security = ServerSecurity.from_files(
        auth.token_file,
        auth.tls_cert_file,
        auth.tls_key_file,
        auth.tls_client_ca_file,
        auth.insecure,
        settings=(
            f"the control endpoint (train.control_host, ${HOST_ENV}) a token file "
            f"(auth.token_file, or ${TOKEN_ENV}) or mutual TLS (auth.tls_cert_file, "
            "auth.tls_key_file, auth.tls_client_ca_file)",
            "auth.insecure=true",
        ),
    )
    server, bound, _ = make_server(
        [lambda s: pb_grpc.add_TrainerControlServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        port=port,
        host=host,
        max_workers=4,
        interceptors=interceptors,
        security=security,
        scopes=SCOPES,
        port_flag="--train.control_port",
    )
    run_dir = Path(trainer.run_dir)
    endpoint = ControlEndpoint(f"{host}:{bound}", server, run_dir)
    if metrics_port is not None:  # first: a busy port must not leave a control.addr behind
        _trainer_gauges(trainer)
        try:
            endpoint._http, mport = start_metrics_server(metrics_port, host)
        except ConfigError as e:
            server.stop(0)
            raise ConfigError(
                f"cannot serve trainer metrics on {host}:{metrics_port} "
                f"(--train.metrics_port / ${METRICS_PORT_ENV}): {e}"
            ) from None
        endpoint.metrics_address = f"{host}:{mport}"
        (run_dir / METRICS_ADDR_FILE).write_text(endpoint.metrics_address + "\n")
    # Written whatever the port: a supervisor or `meshtrain status RUN_DIR` finds it the same way.
    write_address_file(run_dir, endpoint.address, token)
    log.info(
        "control endpoint on %s%s",
        endpoint.address,
        f", metrics on http://{endpoint.metrics_address}/metrics"
        if endpoint.metrics_address
        else "",
    )
    return endpoint
