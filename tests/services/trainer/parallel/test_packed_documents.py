"""Packed documents under tp (+sp), pp, dp (ZeRO-1) and cp (ring, all-to-all, both) equal one
process.

The real trainer runs on a dataset of short documents (4..40 tokens, so every 64-token sample
packs several) with data.reset_attention_mask and data.reset_position_ids, on 2 gloo ranks,
and its losses over a few steps and final parameters (from the checkpoint) must match the
single-process run of the same job, as in test_equivalence.py. The reference itself must differ
from the same job without the resets: the documents are really masked.
"""

import numpy as np
import pytest
import torch

from meshtrain.services.checkpoint.reader import load_checkpoint
from meshtrain.services.dataloader.indexed import IndexedDatasetWriter
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args

pytestmark = pytest.mark.dist

ITERS = 3
LLAMA = {
    "model.normalization": "rmsnorm",
    "model.activation": "swiglu",
    "model.position_embedding_type": "rope",
    "model.add_bias_linear": False,
    "model.untie_embeddings_and_output_weights": True,
    "model.num_query_groups": 2,
}
PACKED = {"data.reset_attention_mask": True, "data.reset_position_ids": True}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A byte-tokenized dataset of 4..40-token documents, each ended by EOD (256)."""
    prefix = tmp_path_factory.mktemp("packed") / "short"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix) as w:
        for _ in range(1500):
            w.add_document(np.append(rng.integers(0, 256, int(rng.integers(4, 40))), 256))
    return prefix


def _args(corpus_cache, short_documents, run, arch, **extra):
    common = {
        "train.train_iters": ITERS,
        "train.eval_interval": 0,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 8,
        "model.num_attention_heads": 4,
        "data.data_path": f'["{short_documents}"]',
        "data.eod_mask_loss": True,
    }
    return small_job_args(corpus_cache, run, **common, **arch, **extra)


def _rank_train(rank, world, args):
    result = train(load_config(args))
    return {"losses": result.losses, "checkpoint": result.checkpoint}


_references: dict = {}


def _reference(corpus_cache, short_documents, tmp_path_factory, arch_name):
    if arch_name not in _references:
        arch = LLAMA if arch_name == "llama" else {}
        run = tmp_path_factory.mktemp(f"packed-ref-{arch_name}")
        result = train(load_config(_args(corpus_cache, short_documents, run, arch, **PACKED)))
        tensors = load_checkpoint(result.checkpoint.rsplit("/", 1)[0], ITERS)[0]
        _references[arch_name] = (result.losses, tensors)
    return _references[arch_name]


CASES = {
    "tp2-sp-llama": ("llama", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "pp2-gpt2": ("gpt2", {"parallel.pp": 2}),
    "pp2-llama-recompute": (
        "llama",
        {"parallel.pp": 2, "parallel.recompute_granularity": "full"},
    ),
    "dp2-zero1-selective-gpt2": (
        "gpt2",
        {
            "parallel.use_distributed_optimizer": True,
            "parallel.recompute_granularity": "selective",
        },
    ),
    "cp2-a2a-llama": ("llama", {"parallel.cp": 2, "parallel.cp_comm_type": "a2a"}),
    "cp2-p2p-llama": ("llama", {"parallel.cp": 2}),
    "cp2-p2p-gpt2-recompute": (
        "gpt2",
        {"parallel.cp": 2, "parallel.recompute_granularity": "full"},
    ),
}
SLOW = {  # 4 ranks
    "cp4-a2a+p2p-llama": (
        "llama",
        {
            "parallel.cp": 4,
            "parallel.cp_comm_type": "a2a+p2p",
            "parallel.hierarchical_context_parallel_sizes": "[2, 2]",
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_training_matches_single_process(
    case, corpus_cache, short_documents, tmp_path, tmp_path_factory
):
    _run_case(CASES[case], 2, corpus_cache, short_documents, tmp_path, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_packed_training_on_4_ranks_matches_single_process(
    case, corpus_cache, short_documents, tmp_path, tmp_path_factory
):
    _run_case(SLOW[case], 4, corpus_cache, short_documents, tmp_path, tmp_path_factory)


def _run_case(case, world, corpus_cache, short_documents, tmp_path, tmp_path_factory):
    arch_name, extra = case
    arch = LLAMA if arch_name == "llama" else {}
    ref_losses, ref_tensors = _reference(corpus_cache, short_documents, tmp_path_factory, arch_name)
    args = _args(corpus_cache, short_documents, tmp_path / "run", arch, **PACKED, **extra)
    results = run_ranks(_rank_train, world, args, timeout=400)
    got = results[0]
    assert sorted(got["losses"]) == list(range(1, ITERS + 1))
    for step, loss in ref_losses.items():
        assert got["losses"][step] == pytest.approx(loss, rel=2e-6, abs=2e-6), f"step {step}"
    tensors, _ = load_checkpoint(got["checkpoint"].rsplit("/", 1)[0], ITERS)
    for name, ref_t in ref_tensors.items():
        if name.startswith("rng."):
            continue
        torch.testing.assert_close(tensors[name], ref_t, rtol=0, atol=2e-5, msg=name)


def test_the_reference_depends_on_the_resets(
    corpus_cache, short_documents, tmp_path, tmp_path_factory
):
    """Without the resets the same job trains differently: the cases above test masking."""
    ref_losses, _ = _reference(corpus_cache, short_documents, tmp_path_factory, "llama")
    plain = train(load_config(_args(corpus_cache, short_documents, tmp_path / "plain", LLAMA)))
    # at initialization the model is near uniform; by the last step the gap is far beyond the
    # 2e-6 the cases above allow
    gap = max(abs(plain.losses[s] - ref_losses[s]) for s in ref_losses)
    assert gap > 5e-5, (plain.losses, ref_losses)
