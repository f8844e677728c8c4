"""`meshtrain rollout serve`: a rollout worker (see `rpc/server.py` and docs/rollout.md). The
flags are parsed and checked into a `ServeConfig` before torch or the model load."""

from __future__ import annotations

import argparse

from meshtrain.services.rollout.config import ServeConfig, add_serve_arguments


def register(sub: argparse._SubParsersAction) -> None:
    """Add `rollout` and its subcommands to the top-level parser."""
    r = sub.add_parser("rollout", help="serve a policy that samples completions for RL")
    rsub = r.add_subparsers(dest="rollout_cmd", required=True)
    srv = rsub.add_parser(
        "serve",
        help="run the gRPC RolloutService for a checkpoint's policy",
        description="Hold a policy (loaded from --load) on one device and sample completions "
        "with their log-probs; new weights arrive by UpdateWeights or LoadCheckpoint.",
    )
    add_serve_arguments(srv)
    srv.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    config = ServeConfig.from_args(args)
    from meshtrain.services.rollout.rpc.server import run

    return run(config)
