"""`meshtrain up`, `meshtrain status`, `meshtrain save` and `meshtrain stop`.

    meshtrain up --config deploy/configs/tiny.toml --data-workers 2 --nproc-per-node 2 [--s3] \\
        [--rollout-workers N [--rollout-args "--device cpu --eod-id 0"]] [train overrides]
    meshtrain status RUN_DIR|HOST:PORT [--json]   # step, loss, tokens/s, ETA, last checkpoint
    meshtrain save RUN_DIR|HOST:PORT              # checkpoint after the current step, keep training
    meshtrain stop RUN_DIR|HOST:PORT              # checkpoint, then end the run (exit 0)

status, save and stop take --token-file, --tls-ca, --tls-cert, --tls-key and --tls-server-name
for an endpoint with authentication or TLS; without them, a RUN_DIR's config.toml names its files.

Building these parsers imports neither grpc nor torch; the commands import what they use.
"""

from __future__ import annotations

import argparse
import json
import shlex

from meshtrain.services.common.client_security import ClientSecurity, add_client_arguments


class _OverridesParser(argparse.ArgumentParser):
    """A subparser that keeps the words it does not know (the trainer's config overrides) in
    `args.overrides` instead of reporting them as unrecognized, the way `train` takes them."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.overrides = list(getattr(namespace, "overrides", None) or []) + extras
        return namespace, []


def cmd_up(args: argparse.Namespace) -> int:
    from meshtrain.services.launcher.up import run_up
    from meshtrain.services.launcher.up_plan import UpOptions

    options = UpOptions(
        data_workers=args.data_workers,
        nproc_per_node=args.nproc_per_node,
        checkpoint_service=not args.no_checkpoint_service,
        metrics=args.metrics,
        trainer_grace_s=args.grace,
        s3=args.s3,
        resume=not args.no_resume,
        trainer_threads=args.trainer_threads,
        rollout_workers=args.rollout_workers,
        rollout_args=shlex.split(args.rollout_args),
    )
    return run_up(options, args.overrides)


def format_status(s: dict) -> str:
    """The human-readable form of a `ControlClient.status()` dict."""

    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    eta = "-" if s["eta_s"] is None else f"{s['eta_s'] / 60:.1f} min"
    lines = [
        f"step            : {s['step']} / {s['train_iters']}",
        f"loss            : {num(s['loss'], '.4f')}",
        f"tokens/s        : {num(s['tokens_per_s'], ',.0f')}",
        f"eta             : {eta}",
        f"last checkpoint : {s['last_checkpoint'] or '-'}",
    ]
    pending = [
        name
        for name, on in (("stop", s["stop_requested"]), ("checkpoint", s["checkpoint_requested"]))
        if on
    ]
    if pending:
        lines.append(f"pending         : {', '.join(pending)} (after the current step)")
    return "\n".join(lines)


def _security(args: argparse.Namespace):
    """The token and TLS flags, or None (the run directory's own, or $MESHTRAIN_TOKEN) when none is
    given."""
    given = (args.token_file, args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    return ClientSecurity.from_args(args) if any(given) else None


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from meshtrain.services.trainer.rpc.client import ADDR_FILE, ControlClient, run_outcome

    run_dir = Path(args.target)
    if run_dir.is_dir() and not (run_dir / ADDR_FILE).exists():
        outcome = run_outcome(run_dir)
        if outcome is not None and outcome["finished"]:  # not an error: the run did its steps
            line = f"{run_dir}: the run has finished: last step {outcome['step']}"
            print(json.dumps(outcome) if args.json else f"{line}, loss {outcome['loss']:.4f}")
            return 0
    with ControlClient(args.target, security=_security(args)) as client:
        status = client.status()
    print(json.dumps(status) if args.json else format_status(status))
    return 0


def cmd_save(args: argparse.Namespace) -> int:
    from meshtrain.services.trainer.rpc.client import ControlClient

    with ControlClient(args.target, security=_security(args)) as client:
        step = client.checkpoint()
    print(f"checkpoint requested at step {step}: saved after the current step")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from meshtrain.services.trainer.rpc.client import ControlClient

    with ControlClient(args.target, security=_security(args)) as client:
        step = client.stop()
    print(
        f"stop requested at step {step}: the trainer checkpoints after the current step and exits"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `up`, `status`, `save` and `stop` to the `meshtrain` command line."""
    up = sub.add_parser(
        "up",
        help="run data workers, the checkpoint service and the trainer as local processes",
        description="Start the training topology locally: N data workers, the checkpoint "
        "service, M rollout workers and K trainer ranks, health-checked in that order, logs "
        "prefixed by process. "
        "Other arguments (--config FILE, --section.key=value, Megatron flags) go to "
        "the trainer. Ctrl-C/SIGTERM: the trainer checkpoints, then all stop; the same "
        "command with the same --log.run_dir resumes.",
    )
    up.__class__ = _OverridesParser  # argparse builds subparsers itself; only the class changes
    up.add_argument(
        "--data-workers", type=int, default=1, help="DataService workers (0: data in-process)"
    )
    up.add_argument("--nproc-per-node", type=int, default=1, help="trainer ranks")
    up.add_argument(
        "--rollout-workers",
        type=int,
        default=0,
        metavar="N",
        help="rollout workers for on-policy RL (`meshtrain rollout serve`), starting from the "
        "checkpoint the trainer starts from; their addresses go to the trainer",
    )
    up.add_argument(
        "--rollout-args",
        default="",
        metavar="FLAGS",
        help="further flags of every rollout worker, as one string "
        '(e.g. "--device cpu --eod-id 0 --max-new-tokens 512")',
    )
    up.add_argument(
        "--no-checkpoint-service",
        action="store_true",
        help="ranks write checkpoints directly instead of through the service",
    )
    up.add_argument(
        "--s3",
        action="store_true",
        help="start a local S3-compatible store (SeaweedFS, data in RUN_DIR/s3) first and "
        "checkpoint into s3://meshtrain/checkpoints",
    )
    up.add_argument(
        "--no-resume",
        action="store_true",
        help="start from scratch even if the save root holds a committed checkpoint",
    )
    up.add_argument(
        "--metrics", action="store_true", help="Prometheus metrics on every service (ports logged)"
    )
    up.add_argument(
        "--grace",
        type=float,
        default=120.0,
        help="seconds the trainer gets to checkpoint after SIGTERM before SIGKILL",
    )
    up.add_argument(
        "--trainer-threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads per trainer rank (default: OMP_NUM_THREADS if set, else the cores "
        "less one per data worker, shared by the ranks; services get one each)",
    )
    up.set_defaults(func=cmd_up, overrides=[])
    for name, func, doc in (
        ("status", cmd_status, "show a training run's progress"),
        ("save", cmd_save, "ask a training run to checkpoint after the current step"),
        ("stop", cmd_stop, "ask a training run to checkpoint and exit"),
    ):
        p = sub.add_parser(
            name, help=doc, description=f"{doc[0].upper()}{doc[1:]} through its control endpoint."
        )
        p.add_argument("target", help="the run directory (its control.addr) or HOST:PORT")
        if name == "status":
            p.add_argument("--json", action="store_true", help="one JSON object")
        add_client_arguments(p)
        p.set_defaults(func=func)
