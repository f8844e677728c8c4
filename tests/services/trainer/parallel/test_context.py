"""Context-parallel training equals single-process training: p2p, a2a, a2a+p2p,
with tp, dp, pp, recompute.

Each case runs the real trainer (`train(job)`) on several gloo ranks and compares with a
single-process run of the same job (fp32), as the pipeline equivalence tests do (their helpers
and references are shared): the loss of each of 6 steps and the eval losses to 1e-6 relative,
and every parameter and Adam moment after the last step (read back from each run's checkpoint,
which does not depend on cp) to 2e-5 absolute. The sequence (64 tokens) is cut into 2·cp chunks,
each rank holding chunks i and 2·cp−1−i. LLAMA has 4 heads and 2 key/value groups: at a2a cp=4
(or a2a cp=2 under tp=2) the key/value heads are repeated to the all-to-all size.
"""

import pytest

from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.parallel.test_equivalence import LLAMA
from tests.services.trainer.parallel.test_pipeline import (
    COMMON,
    STEPS,
    _check,
    _rank_train,
    _reference,
)

pytestmark = pytest.mark.dist

A2A = {"parallel.cp_comm_type": "a2a"}

# name: (world, arch, shape (changes the reference), parallel settings)
CASES = {
    "cp2-p2p": (2, "llama", {}, {"parallel.cp": 2}),
    "cp2-a2a": (2, "llama", {}, {"parallel.cp": 2, **A2A}),
    "cp2-p2p-tied": (2, "gpt2", {}, {"parallel.cp": 2}),
    "cp2-a2a-tied": (2, "gpt2", {}, {"parallel.cp": 2, **A2A}),
    "cp2-recompute-full": (
        2,
        "llama",
        {},
        {"parallel.cp": 2, "parallel.recompute_granularity": "full"},
    ),
    "cp2-a2a-recompute-selective": (
        2,
        "llama",
        {},
        {"parallel.cp": 2, **A2A, "parallel.recompute_granularity": "selective"},
    ),
    "cp4-a2a-fewer-kv-heads": (4, "llama", {}, {"parallel.cp": 4, **A2A}),
    "cp4-a2a+p2p": (
        4,
        "llama",
        {},
        {
            "parallel.cp": 4,
            "parallel.cp_comm_type": "a2a+p2p",
            "parallel.hierarchical_context_parallel_sizes": "[2, 2]",
        },
    ),
    "cp2-tp2-sp-a2a": (
        4,
        "llama",
        {},
        {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True, **A2A},
    ),
    "cp2-dp2-zero1-overlap": (
        4,
        "llama",
        {},
        {
            "parallel.cp": 2,
            "parallel.use_distributed_optimizer": True,
            "parallel.overlap_grad_reduce": True,
            "parallel.overlap_param_gather": True,
        },
    ),
}
SLOW = {
    "cp4-p2p": (4, "llama", {}, {"parallel.cp": 4}),
    "cp2-tp2-sp-p2p": (
        4,
        "llama",
        {},
        {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
    ),
    "cp2-dp2-a2a-tied": (4, "gpt2", {}, {"parallel.cp": 2, **A2A}),
    "cp2-pp2": (4, "llama", {}, {"parallel.cp": 2, "parallel.pp": 2}),
}


def _run_case(case, cases, corpus_cache, tmp_path, tmp_path_factory):
    world, arch_name, shape, extra = cases[case]
    arch = LLAMA if arch_name == "llama" else {}
    ref, ref_tensors = _reference(corpus_cache, tmp_path_factory, arch, shape)
    args = small_job_args(corpus_cache, tmp_path / "run", **{**COMMON, **shape}, **arch, **extra)
    results = run_ranks(_rank_train, world, args, timeout=400)
    _check(results[0], results, ref, ref_tensors)


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_training_matches_single_process(
    case, corpus_cache, tmp_path, tmp_path_factory
):
    _run_case(case, CASES, corpus_cache, tmp_path, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_context_parallel_training_matches_single_process_slow(
    case, corpus_cache, tmp_path, tmp_path_factory
):
    _run_case(case, SLOW, corpus_cache, tmp_path, tmp_path_factory)


def test_checkpoint_from_cp2_a2a_resumes_at_cp1_and_cp4_p2p(
    corpus_cache, tmp_path, tmp_path_factory
):
    """Layout independence: saved at step 3 by cp=2 (a2a), resumed by one process and by cp=4
    (p2p): steps 4..6 match the uninterrupted single-process run."""
    ref, ref_tensors = _reference(corpus_cache, tmp_path_factory, LLAMA, {})
    saved = run_ranks(
        _rank_train,
        2,
        small_job_args(
            corpus_cache,
            tmp_path / "cp2",
            **COMMON,
            **LLAMA,
            **{"parallel.cp": 2, **A2A, "checkpoint.save_interval": 3},
        ),
        timeout=400,
    )
    root = saved[0]["checkpoint"].rsplit("/", 1)[0]
    _check(saved[0], saved, ref, ref_tensors)
    for name, world, extra in [("cp1", 1, {}), ("cp4", 4, {"parallel.cp": 4})]:
        args = small_job_args(
            corpus_cache,
            tmp_path / name,
            **COMMON,
            **LLAMA,
            **extra,
            **{
                "checkpoint.load": root,
                "checkpoint.load_step": 3,
                "checkpoint.save": str(tmp_path / f"ck-{name}"),
            },
        )
        results = (
            [_rank_train(0, 1, args)]
            if world == 1
            else run_ranks(_rank_train, world, args, timeout=400)
        )
        _check(results[0], results, ref, ref_tensors, steps=range(4, STEPS + 1))
