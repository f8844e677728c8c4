"""`meshtrain dpo reference`: compute the precomputed DPO reference column of a run's pairs.

    meshtrain dpo reference --config deploy/configs/dpo-tiny.toml --load CKPT [--section.key=value]
    torchrun --nproc-per-node 2 -m meshtrain dpo reference --config ... \\
        --tensor-model-parallel-size 2

It takes the training run's own config and overrides, so the pass runs the model the frozen
reference would be (dpo.reference_load, else checkpoint.load) on the same mesh, over every pair
of dpo.data_path and dpo.valid_data_path (services/trainer/objectives/reference_pass.py). The
config is parsed and checked before torch is imported.
"""

from __future__ import annotations

import argparse


class _OverridesParser(argparse.ArgumentParser):
    """A subparser that keeps the words it does not know (the trainer's config overrides) in
    `args.overrides`, the way `train` takes them."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.overrides = list(getattr(namespace, "overrides", None) or []) + extras
        return namespace, []


def register(sub) -> None:
    dpo = sub.add_parser("dpo", help="preference tuning tools (see docs/dpo.md)")
    tools = dpo.add_subparsers(dest="dpo_cmd", required=True)
    ref = tools.add_parser(
        "reference",
        help="write the reference log-probs that dpo.reference='precomputed' reads",
        description="Run the starting model (dpo.reference_load, else checkpoint.load) over "
        "every pair of dpo.data_path and dpo.valid_data_path and write PREFIX.ref_logps.npy "
        "beside each. Takes the training run's --config and overrides (--section.key=value, "
        "Megatron flags); several ranks: launch it with torchrun.",
    )
    ref.__class__ = _OverridesParser  # argparse builds subparsers itself; only the class changes
    ref.set_defaults(func=cmd_reference)


def cmd_reference(args: argparse.Namespace) -> int:
    from meshtrain.services.trainer.config.dpo import check_reference_job
    from meshtrain.services.trainer.config.load import load_config

    job = load_config(args.overrides)
    check_reference_job(job)
    # torch loads only for a config that is valid
    from meshtrain.services.trainer.objectives.reference_pass import compute_reference

    written = compute_reference(job)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    for w in written:
        print(f"{w.path}: {w.pairs} pairs, reference {w.model}")
    return 0
