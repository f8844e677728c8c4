"""The `meshtrain` command line.

    meshtrain train --config deploy/configs/tiny.toml [--section.key=value | --megatron-flag ...]
    meshtrain train --help-config
    meshtrain data preprocess --input 'docs/*.jsonl' --output-prefix data/docs --tokenizer byte
    meshtrain data train-tokenizer --input 'docs/*.txt' --vocab-size 8192 --output tok.json
    meshtrain ckpt list ROOT
    meshtrain ckpt inspect ROOT [--step N]

Errors a user can cause are printed as one line naming what was wrong, with exit status 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

from services.common.errors import DataError, MeshtrainError
from services.common.logging import setup_logging


def _expand(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise DataError(f"--input {pattern!r} matches no file")
        files.extend(Path(m) for m in matches if Path(m).is_file())
    return files


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from services.trainer.config import config_help, load_config
    from services.trainer.train import train

    if args.help_config:
        print(config_help())
        return 0
    job = load_config(rest)
    result = train(job)
    steps = sorted(result.losses)
    print()
    print(f"run directory : {result.run_dir}")
    print(f"config        : {result.run_dir / 'config.toml'}")
    print(f"metrics       : {result.run_dir / 'metrics.jsonl'}")
    if result.plot:
        print(f"loss curve    : {result.plot}")
    print(f"checkpoint    : {result.checkpoint}")
    if steps:
        print(f"loss          : {result.losses[steps[0]]:.4f} at step {steps[0]} -> "
              f"{result.losses[steps[-1]]:.4f} at step {steps[-1]}")
    if result.eval_losses:
        last = max(result.eval_losses)
        print(f"eval loss     : {result.eval_losses[last]:.4f} at step {last}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from services.dataloader.preprocess import preprocess_files
    from services.dataloader.tokenizers import build_tokenizer, train_bpe

    if args.data_cmd == "preprocess":
        tokenizer = build_tokenizer(args.tokenizer)
        prefix = preprocess_files(_expand(args.input), args.output_prefix, tokenizer,
                                  json_key=args.json_key, append_eod=args.append_eod)
        print(f"wrote {prefix}.bin and {prefix}.idx")
    else:
        tok = train_bpe([str(p) for p in _expand(args.input)], args.vocab_size, args.output)
        print(f"wrote {args.output} (vocabulary {tok.vocab_size})")
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from services.checkpoint.reader import list_checkpoints, read_manifest

    steps = list_checkpoints(args.root)
    if args.ckpt_cmd == "list":
        if not steps:
            print(f"no committed checkpoint under {args.root}")
        for step in steps:
            print(step)
        return 0
    step = args.step if args.step is not None else (steps[-1] if steps else None)
    if step is None:
        raise MeshtrainError(f"no committed checkpoint under {args.root}")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtrain", description="Megatron-style GPT training.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a model (overrides: --section.key=value or Megatron flags)",
                       description="Train a GPT. Every config key can be overridden as --section.key=value; "
                                   "see --help-config for the keys and the Megatron-style aliases.")
    t.add_argument("--help-config", action="store_true", help="list every config key and alias, then exit")

    d = sub.add_parser("data", help="build datasets and tokenizers")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    pre = dsub.add_parser("preprocess", help="tokenize text/JSONL files into PREFIX.bin/.idx")
    pre.add_argument("--input", nargs="+", required=True, help="files or glob patterns")
    pre.add_argument("--output-prefix", required=True)
    pre.add_argument("--tokenizer", required=True, help="'byte' or a tokenizer.json")
    pre.add_argument("--json-key", default="text")
    pre.add_argument("--append-eod", action="store_true", help="end each document with the EOD token")
    tt = dsub.add_parser("train-tokenizer", help="train a byte-level BPE on local text")
    tt.add_argument("--input", nargs="+", required=True)
    tt.add_argument("--vocab-size", type=int, required=True)
    tt.add_argument("--output", required=True, help="path of the tokenizer.json to write")

    c = sub.add_parser("ckpt", help="inspect checkpoints")
    csub = c.add_subparsers(dest="ckpt_cmd", required=True)
    ls = csub.add_parser("list", help="committed checkpoint steps under ROOT")
    ls.add_argument("root")
    ins = csub.add_parser("inspect", help="tensors, shapes, dtypes and metadata of one checkpoint")
    ins.add_argument("root")
    ins.add_argument("--step", type=int)
    ins.add_argument("--json", action="store_true", help="print the whole manifest")
    return p


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.cmd == "train":
            return cmd_train(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.cmd == "data":
            return cmd_data(args)
        return cmd_ckpt(args)
    except MeshtrainError as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        return 0
    except KeyboardInterrupt:
        print("meshtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
