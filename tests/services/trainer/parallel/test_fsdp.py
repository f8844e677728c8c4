"""Fully sharded data parallelism (FSDP2) trains exactly as one process, in less memory per rank.

Each case runs the real trainer on gloo ranks and compares with the single-process run of the
same job: every step's loss to 1e-6 relative, and the final parameters and Adam moments read
back from each run's checkpoint (written shard by shard, in global coordinates). Tolerances as
in test_equivalence.py (fp32, different reduction orders).
"""

import pytest
import torch

from meshtrain.services.checkpoint.reader import load_checkpoint
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args

pytestmark = pytest.mark.dist

COMMON = {
    "train.train_iters": 4,
    "train.eval_interval": 4,
    "train.eval_iters": 1,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 8,
    "model.hidden_size": 32,
    "model.num_attention_heads": 4,
    "model.seq_length": 32,
}
LLAMA = {
    "model.normalization": "rmsnorm",
    "model.activation": "swiglu",
    "model.position_embedding_type": "rope",
    "model.add_bias_linear": False,
    "model.num_query_groups": 2,
}
FSDP = {"parallel.use_torch_fsdp2": True}


def _rank_train(rank, world, args):
    result = train(load_config(args))
    return {"losses": result.losses, "eval": result.eval_losses, "checkpoint": result.checkpoint}


_reference: dict = {}


def reference(corpus_cache, tmp_path_factory, arch_name):
    if arch_name not in _reference:
        arch = LLAMA if arch_name == "llama" else {}
        run = tmp_path_factory.mktemp(f"ref-{arch_name}")
        result = train(load_config(small_job_args(corpus_cache, run, **COMMON, **arch)))
        root = result.checkpoint.rsplit("/", 1)[0]
        _reference[arch_name] = (result, load_checkpoint(root, 4)[0])
    return _reference[arch_name]


def assert_same_training(got, ref, ref_tensors, steps=range(1, 5)):
    for step in steps:
        assert got["losses"][step] == pytest.approx(ref.losses[step], rel=1e-6, abs=1e-6), step
    tensors, _ = load_checkpoint(got["checkpoint"].rsplit("/", 1)[0], max(steps))
    assert set(tensors) == set(ref_tensors)
    for name, ref_t in ref_tensors.items():
        if not name.startswith("rng."):
            torch.testing.assert_close(tensors[name], ref_t, rtol=0, atol=2e-5, msg=name)


CASES = {
    "zero3-dp2": (2, "gpt2", FSDP),
    "zero2-dp2": (
        2,
        "llama",
        {"parallel.data_parallel_sharding_strategy": "optim_grads"},
    ),
    "zero3-tp2-dp2-sp": (
        4,
        "llama",
        {**FSDP, "parallel.tp": 2, "parallel.sequence_parallel": True},
    ),
    "hsdp-2x2": (4, "gpt2", {**FSDP, "parallel.dp_replicate": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fully_sharded_training_matches_single_process(
    case, corpus_cache, tmp_path, tmp_path_factory
):
    world, arch_name, extra = CASES[case]
    arch = LLAMA if arch_name == "llama" else {}
    ref, ref_tensors = reference(corpus_cache, tmp_path_factory, arch_name)
    args = small_job_args(corpus_cache, tmp_path / "run", **COMMON, **arch, **extra)
    results = run_ranks(_rank_train, world, args, timeout=400)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert_same_training(results[0], ref, ref_tensors)
