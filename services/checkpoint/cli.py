"""`meshtrain ckpt ...`: list and inspect checkpoints.

    meshtrain ckpt list ROOT
    meshtrain ckpt inspect ROOT [--step N] [--json]
"""

from __future__ import annotations

import argparse
import json

from services.common.errors import CheckpointError


def cmd_list(args: argparse.Namespace) -> int:
    from services.checkpoint.reader import list_checkpoints

    steps = list_checkpoints(args.root)
    if not steps:
        print(f"no committed checkpoint under {args.root}")
    for step in steps:
        print(step)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from services.checkpoint.reader import list_checkpoints, read_manifest

    steps = list_checkpoints(args.root)
    step = args.step if args.step is not None else (steps[-1] if steps else None)
    if step is None:
        raise CheckpointError(f"no committed checkpoint under {args.root}")
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
        print(f"    {name:<55} {array['dtype']:<9} {str(tuple(array['shape'])):<22} {size / 1e6:9.2f} MB{layers}")
    print(f"  total: {total / 1e6:.2f} MB")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `ckpt` and its subcommands to the top-level parser."""
    c = sub.add_parser("ckpt", help="inspect checkpoints")
    csub = c.add_subparsers(dest="ckpt_cmd", required=True)
    ls = csub.add_parser("list", help="committed checkpoint steps under ROOT")
    ls.add_argument("root")
    ls.set_defaults(func=cmd_list)
    ins = csub.add_parser("inspect", help="tensors, shapes, dtypes and metadata of one checkpoint")
    ins.add_argument("root")
    ins.add_argument("--step", type=int)
    ins.add_argument("--json", action="store_true", help="print the whole manifest")
    ins.set_defaults(func=cmd_inspect)
