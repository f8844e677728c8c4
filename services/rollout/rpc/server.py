"""Run a rollout worker: `meshtrain rollout serve --load ROOT --port P` or
`python -m meshtrain.services.rollout.rpc.server --load ROOT --port P`.

One worker holds one policy on one device, loaded from a checkpoint root; the trainer then
publishes new weights by streaming them (UpdateWeights) or by committing a checkpoint and
asking the worker to load it (LoadCheckpoint). It has the standard health service and
reflection, binds 127.0.0.1 unless told otherwise, and stops gracefully on SIGTERM. With
`--token-file` (or $MESHTRAIN_TOKEN) every call needs a token of the method's scope (`SCOPES`:
Generate and Describe need read, UpdateWeights and LoadCheckpoint write); an interface other
than loopback needs a token or client certificates, or `--insecure`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from meshtrain.protos.rollout.v1 import rollout_pb2_grpc as pb_grpc
from meshtrain.services.common.grpc_server import make_server, serve_forever
from meshtrain.services.common.security import READ, WRITE, ServerSecurity, method_scopes
from meshtrain.services.rollout.config import ServeConfig, add_serve_arguments
from meshtrain.services.rollout.rpc.servicer import SERVICE_NAME, RolloutServicer

log = logging.getLogger("meshtrain.rollout")

# Sampling reads the policy; replacing it is a write (a read token cannot change what the
# trainer's rollouts come from).
SCOPES = method_scopes(
    SERVICE_NAME,
    {"Generate": READ, "Describe": READ, "UpdateWeights": WRITE, "LoadCheckpoint": WRITE},
)


def start_server(
    engine,
    port: int = 0,
    host: str = "127.0.0.1",
    checkpoint_root: str | None = None,
    max_streams: int = 8,
    max_chunk_bytes: int = 4 << 20,
    security: ServerSecurity | None = None,
):
    """Starts a RolloutService for `engine` (a `RolloutEngine`) in this process.

    Args:
        engine: the policy it serves.
        port: TCP port; 0 picks a free one.
        host: interface to bind.
        checkpoint_root: where LoadCheckpoint reads (None: LoadCheckpoint is refused).
        max_streams: concurrent RPCs.
        max_chunk_bytes: largest weight chunk; messages may be twice that (prompts included).
        security: tokens and TLS (None: none, loopback only).

    Returns:
        (server, bound port, health servicer).
    """
    servicer = RolloutServicer(engine, checkpoint_root, max_chunk_bytes)
    return make_server(
        [lambda s: pb_grpc.add_RolloutServiceServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        port=port,
        host=host,
        max_workers=max_streams,
        max_message_bytes=max(2 * max_chunk_bytes, 8 << 20),
        security=security,
        scopes=SCOPES,
    )


def run(config: ServeConfig) -> int:
    """Loads the policy, starts the service `config` describes and blocks until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    security = ServerSecurity.from_files(
        config.token_file,
        config.tls_cert,
        config.tls_key,
        config.tls_client_ca,
        insecure=config.insecure,
    )
    security.check_bind(config.host, config.port)  # before the model loads: fail at once
    from meshtrain.services.rollout.engine import Limits, engine_from_checkpoint

    limits = Limits(
        max_prompts=config.max_prompts,
        max_prompt_tokens=config.max_prompt_tokens,
        max_group_size=config.max_group_size,
        max_new_tokens=config.max_new_tokens,
        max_completions=config.max_completions,
        max_batch_rows=config.max_batch_rows,
        max_wait_s=config.max_wait_s,
    )
    engine = engine_from_checkpoint(
        config.load,
        config.step,
        config.device,
        config.dtype,
        config.eod_id,
        limits,
        version=config.version,
        cuda_graphs=config.cuda_graphs,
    )
    log.info("policy of %s step %d on %s", config.load, engine.version, engine.describe()["device"])
    server, port, health = start_server(
        engine,
        config.port,
        config.host,
        checkpoint_root=config.checkpoint_root or config.load,
        max_streams=config.max_streams,
        max_chunk_bytes=int(config.max_chunk_mb * 2**20),
        security=security,
    )
    print(f"listening on {config.host}:{port}", flush=True)
    serve_forever(server, health, grace_s=config.grace)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM; prints `listening on HOST:PORT` once ready (tests wait for it)."""
    p = argparse.ArgumentParser(prog="meshtrain rollout serve")
    add_serve_arguments(p)
    return run(ServeConfig.from_args(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
