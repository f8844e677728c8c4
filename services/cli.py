"""The `meshtrain` command line: one entry point, each service registers its own subcommands.

    meshtrain train --config deploy/configs/tiny.toml [--section.key=value | --megatron-flag ...]
    meshtrain train --nproc-per-node 4 [--grace S] ...  (local ranks: services/launcher/ranks.py)
    meshtrain train --help-config
    meshtrain data preprocess|train-tokenizer ...      (services/dataloader/cli.py)
    meshtrain ckpt list|inspect ...                    (services/checkpoint/cli.py)
    meshtrain dpo reference --config CONFIG [...]      (services/trainer/dpo_cli.py)

Errors a user can cause are printed as one line naming what was wrong, with exit status 2,
before torch's heavy modules are imported: every command parses and validates its arguments and
config first (tests/test_cli_imports.py holds them to it).
A checkpoint save whose storage kept failing through its retries (CheckpointStorageError) ends
the command with exit status 74 (STORAGE_EXIT_STATUS, sysexits' EX_IOERR) and a line saying so:
the run cannot keep its progress, and starting it again would only retrain what it loses.
"""

from __future__ import annotations

# One name per file: the folder installs under meshtrain. `python -m meshtrain.services.cli` (what
# deploy/train.sh has torchrun run) names the module `__main__`; its spec keeps the real name.
if not (__spec__.name if __spec__ is not None else __name__).startswith("meshtrain."):
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import argparse
import sys

from meshtrain.services.checkpoint import cli as ckpt_cli
from meshtrain.services.common.errors import (
    STORAGE_EXIT_STATUS,
    CheckpointStorageError,
    ConfigError,
    MeshtrainError,
)
from meshtrain.services.common.logging import setup_logging
from meshtrain.services.dataloader import cli as data_cli
from meshtrain.services.launcher import cli as launcher_cli
from meshtrain.services.launcher.ranks import FAILURE_GRACE_S
from meshtrain.services.rollout import cli as rollout_cli
from meshtrain.services.trainer import dpo_cli, generate_cli


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from meshtrain.services.trainer.config.load import config_help, load_config

    if args.help_config:
        print(config_help())
        return 0
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node needs at least 1 rank (got {args.nproc_per_node})")
    if args.nproc_per_node > 1:
        return launch_local_ranks(args.nproc_per_node, rest, args.grace)
    if args.grace is not None:
        raise ConfigError(
            "--grace applies to the ranks of --nproc-per-node N > 1 only "
            "(one process is stopped by SIGTERM directly)"
        )
    job = load_config(rest)  # validate before anything starts
    # The trainer (torch and its compiler stack: seconds, tens on a busy machine) loads only
    # for a command line that is valid, so a mistake is answered at once.
    from meshtrain.services.trainer.train import train

    result = train(job, until_exit=True)  # the process ends with the run: a late SIGTERM is logged
    if result.rank != 0:
        return 0
    steps = sorted(result.losses)
    print()
    print(f"run directory : {result.run_dir}")
    print(f"config        : {result.run_dir / 'config.toml'}")
    print(f"metrics       : {result.run_dir / 'metrics.jsonl'}")
    if result.plot:
        print(f"loss curve    : {result.plot}")
    print(f"checkpoint    : {result.checkpoint}")
    if steps:
        print(
            f"loss          : {result.losses[steps[0]]:.4f} at step {steps[0]} -> "
            f"{result.losses[steps[-1]]:.4f} at step {steps[-1]}"
        )
    if result.eval_losses:
        last = max(result.eval_losses)
        print(f"eval loss     : {result.eval_losses[last]:.4f} at step {last}")
    return 0


def launch_local_ranks(nproc: int, rest: list[str], grace_s: float | None = None) -> int:
    """Run `meshtrain train` on `nproc` local ranks, each our own child process
    (`services/launcher/ranks.py`).

    Args:
        nproc: how many ranks.
        rest: the trainer's arguments.
        grace_s: seconds the ranks get to checkpoint after a stop before SIGKILL (None: no limit).
    """
    from meshtrain.services.launcher.ranks import run_local_ranks
    from meshtrain.services.trainer.config.load import load_config

    if grace_s is not None and not grace_s > 0:
        raise ConfigError(f"--grace must be a positive number of seconds, got {grace_s}")
    load_config(rest)  # fail fast here, not once per rank
    return run_local_ranks(nproc, rest, grace_s)


# The options a new user needs first (the trainer parses them; --help-config lists them all).
TRAIN_FIRST_OPTIONS = """the options most runs set first (--help-config lists every key and alias):
  --config FILE                  a TOML job config, e.g. deploy/configs/tiny.toml
  --data-path PREFIX [...]       preprocessed dataset prefix(es), '0.7 A 0.3 B' to blend
                                 (default: the embedded corpus)
  --tokenizer SPEC               the tokenizer the data was preprocessed with
  --split 90,10,0                train/valid/test shares of the documents
  --train-iters N                optimizer steps in all
  --micro-batch-size N           samples per forward/backward on one rank
  --global-batch-size N          samples per optimizer step over all ranks
  --lr LR                        peak learning rate
  --bf16                         bf16 autocast (fp32 master weights)
  --tensor-model-parallel-size N
  --sequence-parallel
  --use-distributed-optimizer    ZeRO-1 over the data-parallel ranks
  --save ROOT / --load ROOT      checkpoint root to write / to resume from
  --save-interval N              steps between checkpoints
  --run-dir DIR                  where config.toml and metrics.jsonl go (default: runs/<time>)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtrain", description="Megatron-style GPT training.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser(
        "train",
        help="train a model (overrides: --section.key=value or Megatron flags)",
        description="Train a GPT. Every config key can be overridden as --section.key=value; "
        "see --help-config for the keys and the Megatron-style aliases.",
        epilog=TRAIN_FIRST_OPTIONS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument(
        "--help-config", action="store_true", help="list every config key and alias, then exit"
    )
    t.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="run this many local ranks, each a child process with torchrun's environment; "
        "SIGINT/SIGTERM/SIGHUP reach each rank once as SIGTERM (checkpoint, exit 0), a "
        f"rank that fails stops the others (SIGKILL after {FAILURE_GRACE_S:.0f} s); exit 0 "
        "only if every rank exited 0. Plain torchrun works too",
    )
    t.add_argument(
        "--grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --nproc-per-node: seconds the ranks get to checkpoint and exit after a stop "
        "signal before SIGKILL (default: no limit; a second signal stops them at once)",
    )
    data_cli.register(sub)
    ckpt_cli.register(sub)
    launcher_cli.register(sub)
    rollout_cli.register(sub)
    generate_cli.register(sub)
    dpo_cli.register(sub)
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
        return args.func(args)
    except CheckpointStorageError as e:
        print(
            f"meshtrain: error: checkpoint storage failed: {e}; "
            f"stopping with exit status {STORAGE_EXIT_STATUS}, as a run that cannot save "
            "would only train again what it loses",
            file=sys.stderr,
        )
        return STORAGE_EXIT_STATUS
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
