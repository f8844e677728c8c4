"""`meshtrain ckpt ...`: serve, list, inspect, verify, delete, convert, import and export
checkpoints.

    meshtrain ckpt serve ROOT [--port P] [--host H] [--commit-timeout S] [--token-file F] \
        [--tls-cert C --tls-key K] ...
    meshtrain ckpt list ROOT
    meshtrain ckpt inspect ROOT [--step N] [--json]
    meshtrain ckpt verify ROOT [--step N | --all]
    meshtrain ckpt delete ROOT (--step N | --keep-last N [--keep-every K]) [--collect-leftovers]
    meshtrain ckpt export --format hf SRC DST | import --format hf SRC DST     (convert_cli.py)
    meshtrain ckpt convert SRC DST [--dtype bf16] [--drop-optimizer] \
        [--target-tensor-parallel-size N]

ROOT is a folder or URL (`file://`, `s3://bucket/prefix` with AWS_ENDPOINT_URL /
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment, `memory://`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable

from meshtrain.services.checkpoint.config import ServeConfig, add_serve_arguments
from meshtrain.services.common.errors import CheckpointError, is_storage_error


def missing_local_root(root: str) -> bool:
    """Whether `root` is a local path (plain or `file://`) that does not exist: such a root holds
    no checkpoint, which a command can tell without importing the reader (torch, zarr). Object
    store prefixes have no "exists" to ask, so they are never missing here."""
    local = root[len("file://") :] if root.startswith("file://") else root
    return "://" not in local and not os.path.exists(os.path.expanduser(local))


def _no_checkpoint(root: str) -> CheckpointError:
    """The error for a ROOT without a committed checkpoint. A local path that does not exist is
    usually a typo, so it is told apart from a real folder that holds no checkpoint; object
    store prefixes have no "exists" to ask, so they get the second message."""
    if missing_local_root(root):
        return CheckpointError(f"{root}: no such path; check the checkpoint root")
    return CheckpointError(
        f"no committed checkpoint under {root}; pass the run's checkpoint root (its --save folder)"
    )


def cmd_list(args: argparse.Namespace) -> int:
    if missing_local_root(args.root):  # nothing to list: answered before the reader loads
        if args.allow_empty:
            return 0
        raise _no_checkpoint(args.root)
    from meshtrain.services.checkpoint.reader import list_checkpoints, unreadable_manifests

    steps = list_checkpoints(args.root)
    for why in unreadable_manifests(args.root).values():
        # Not listed, since no reader takes them: said so, or a damaged newest step vanishes.
        print(f"warning: not listed: {why}", file=sys.stderr)
    if (
        not steps and not args.allow_empty
    ):  # an error, as in inspect and verify: scripts test the exit status
        raise _no_checkpoint(args.root)
    for step in steps:
        print(step)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.step is None and missing_local_root(args.root):
        raise _no_checkpoint(args.root)
    from meshtrain.services.checkpoint.reader import list_checkpoints, read_manifest

    steps = list_checkpoints(args.root)
    step = args.step if args.step is not None else (steps[-1] if steps else None)
    if step is None:
        raise _no_checkpoint(args.root)
    manifest = read_manifest(args.root, step)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    meta = manifest.get("metadata", {})
    print(f"checkpoint {args.root} step {step}")
    for key in ("iteration", "consumed_samples", "tokenizer"):
        if key in meta:
            print(f"  {key}: {meta[key]}")
    arrays = manifest.get("arrays", {})
    total = 0
    print(f"  arrays ({len(arrays)}):")
    for name, array in sorted(arrays.items()):
        size = sum(o["size"] for o in array.get("objects", {}).values())
        total += size
        layers = f"  [{array['layer_count']} layers]" if array.get("layer_count") else ""
        print(
            f"    {name:<55} {array['dtype']:<9} {tuple(array['shape'])!s:<22} "
            f"{size / 1e6:9.2f} MB{layers}"
        )
    print(f"  total: {total / 1e6:.2f} MB")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from meshtrain.services.checkpoint.rpc.server import run

    return run(ServeConfig.from_args(args))


def cmd_verify(args: argparse.Namespace) -> int:
    if args.step is None and missing_local_root(args.root):
        raise _no_checkpoint(args.root)
    from meshtrain.services.checkpoint.maintenance import verify_checkpoint
    from meshtrain.services.checkpoint.reader import list_checkpoints, unreadable_manifests

    steps = list_checkpoints(args.root)
    # Steps whose manifest is damaged look uncommitted to every reader: --all names them all,
    # the default any newer than the latest readable one (which it would verify instead).
    unreadable = {} if args.step is not None else unreadable_manifests(args.root)
    if args.step is not None:
        steps = [args.step]
    elif not args.all:
        steps = steps[-1:]
        unreadable = {s: why for s, why in unreadable.items() if not steps or s > steps[0]}
    if not steps and not unreadable:
        raise _no_checkpoint(args.root)
    for step in steps:
        count = verify_checkpoint(args.root, step)
        print(f"step {step}: {count} objects verified")
    if unreadable:
        raise CheckpointError(
            "steps whose manifest.json cannot be read (readers skip them): "
            + "; ".join(unreadable.values())
        )
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from meshtrain.services.checkpoint.maintenance import apply_retention, delete_checkpoint

    if args.step is not None:
        if args.keep_last is not None or args.keep_every:
            raise CheckpointError("ckpt delete: give either --step or --keep-last/--keep-every")
        if not delete_checkpoint(args.root, args.step):
            raise CheckpointError(f"no checkpoint step {args.step} under {args.root}")
        print(f"deleted step {args.step}")
        return 0
    if args.keep_last is None and not args.keep_every and not args.collect_leftovers:
        raise CheckpointError(
            "ckpt delete: give --step N, or --keep-last N [--keep-every K], "
            "and/or --collect-leftovers"
        )
    if args.keep_every and not args.keep_last:
        # alone it would delete every step that is not a multiple of K, the newest included
        # (as `checkpoint.keep_every` needs `checkpoint.keep_last`)
        raise CheckpointError(
            f"ckpt delete: --keep-every {args.keep_every} needs --keep-last N with N >= 1 "
            f"(got {'none' if args.keep_last is None else args.keep_last}), or the "
            "newest checkpoints would be deleted too"
        )
    # From the command line a save in progress (a live run's) is indistinguishable from a
    # crashed one's leftovers: those are removed only when asked for.
    result = apply_retention(
        args.root, args.keep_last or 0, args.keep_every, collect=args.collect_leftovers
    )
    print(
        f"deleted steps {result.deleted}"
        + (f"; removed uncommitted leftovers {result.collected}" if args.collect_leftovers else "")
    )
    return 0


def _storage_errors(
    func: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Turns what storage raises (a destination that is a file, a full disk, wrong S3 keys or
    endpoint) into a CheckpointError naming the command's paths: a user's setup error, not a
    traceback. botocore's connection errors are not OSErrors, so they are matched by module."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except BrokenPipeError:  # output piped into `head`: the top level ends quietly
            raise
        except Exception as e:
            if not is_storage_error(e):
                raise
            where = " ".join(
                str(getattr(args, k)) for k in ("root", "src", "dst") if getattr(args, k, None)
            )
            raise CheckpointError(
                f"ckpt {args.ckpt_cmd} {where}: storage failed: {type(e).__name__}: {e}"
            ) from e

    return run


def register(sub: argparse._SubParsersAction) -> None:
    """Add `ckpt` and its subcommands to the top-level parser."""
    from meshtrain.services.checkpoint.convert_cli import register_subcommands

    c = sub.add_parser(
        "ckpt", help="serve, inspect, verify, delete, convert, import and export checkpoints"
    )
    csub = c.add_subparsers(dest="ckpt_cmd", required=True)
    register_subcommands(csub)
    srv = csub.add_parser("serve", help="run the gRPC CheckpointService for ROOT")
    add_serve_arguments(srv)
    srv.set_defaults(func=cmd_serve)
    ver = csub.add_parser("verify", help="re-read every object and check its checksum")
    ver.add_argument("root")
    which = ver.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="this step (default: the latest)")
    which.add_argument("--all", action="store_true", help="every committed step")
    ver.set_defaults(func=cmd_verify)
    dele = csub.add_parser("delete", help="delete a step, or apply a retention policy")
    dele.add_argument("root")
    dele.add_argument("--step", type=int, help="delete this step")
    dele.add_argument("--keep-last", type=int, help="keep the newest N committed steps")
    dele.add_argument(
        "--keep-every", type=int, default=0, help="with --keep-last: also keep multiples of K"
    )
    dele.add_argument(
        "--collect-leftovers",
        action="store_true",
        help="also remove uncommitted step folders (crashed saves); only when no run is "
        "saving into ROOT: a save in progress looks the same",
    )
    dele.set_defaults(func=cmd_delete)
    ls = csub.add_parser("list", help="committed checkpoint steps under ROOT")
    ls.add_argument("root")
    ls.add_argument(
        "--allow-empty",
        action="store_true",
        help="a root without a committed checkpoint (or not created yet) lists nothing and exits "
        "0, for scripts that start a run there; storage that cannot be read is still an error",
    )
    ls.set_defaults(func=cmd_list)
    ins = csub.add_parser("inspect", help="tensors, shapes, dtypes and metadata of one checkpoint")
    ins.add_argument("root")
    ins.add_argument("--step", type=int)
    ins.add_argument("--json", action="store_true", help="print the whole manifest")
    ins.set_defaults(func=cmd_inspect)
    for name, parser in csub.choices.items():
        if name != "serve":  # the server maps its errors to gRPC statuses itself
            parser.set_defaults(func=_storage_errors(parser.get_default("func")))
