"""Fully sharded data parallelism (FSDP2) under pipeline parallelism trains exactly as one process.

pp=2 x dp_shard=2 on gloo ranks: each stage's blocks and the stage itself are sharded over the
two dp_shard ranks of that stage, two micro-batches per step and rank (gradients accumulated
unsharded, reduce-scattered at each chunk's last backward). Compared with the single-process
run of the same job as in test_pipeline.py: every step's loss and the eval losses to 1e-6
relative, every parameter and Adam moment to 2e-5 absolute (fp32, sums in another order),
read back from the checkpoints (layout-free).
"""

import pytest

from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.parallel.test_equivalence import LLAMA
from tests.services.trainer.parallel.test_pipeline import COMMON, STEPS, _check, _reference
from tests.services.trainer.test_moe_train import DP as MOE_DP
from tests.services.trainer.test_moe_train import DP_REF, _moe_case

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # 4 ranks on a few cores: ~40 s each

PP_FSDP = {"parallel.pp": 2, "parallel.use_torch_fsdp2": True}

# name: (arch, parallel settings); world 4 (pp=2 x dp_shard=2)
CASES = {
    # tied embeddings: the first stage's shard and the last stage's copy summed over pp_ends
    "zero3-1f1b-tied": ("gpt2", PP_FSDP),
    "zero2-interleaved-v2": (
        "llama",
        {
            **PP_FSDP,
            "parallel.data_parallel_sharding_strategy": "optim_grads",
            "parallel.virtual_pipeline_model_parallel_size": 2,
        },
    ),
    # each block compiled on every stage, FSDP2's hooks between them
    "zero3-1f1b-compiled": ("gpt2", {**PP_FSDP, "train.compile": True}),
    "zero2-none": (
        "llama",
        {
            **PP_FSDP,
            "parallel.data_parallel_sharding_strategy": "optim_grads",
            "parallel.pipeline_schedule": "none",
        },
    ),
    "zero3-gpipe-recompute": (
        "llama",
        {
            **PP_FSDP,
            "parallel.pipeline_schedule": "gpipe",
            "parallel.recompute_granularity": "full",
        },
    ),
}


def _rank_train(rank, world, args):
    result = train(load_config(args))
    return {"losses": result.losses, "eval": result.eval_losses, "checkpoint": result.checkpoint}


# Mixtures of experts on both stages (test_moe_train.py's job: aux and z losses, a capacity, the
# expert bias, a gated shared expert), one micro-batch of 2 per rank and step: the aux loss is
# over the global micro-batch, which one process runs as one micro-batch of 4 (DP_REF).
MOE_CASES = {
    # ep 1: each stage's experts sharded over its dp_shard ranks with the rest of their block
    "zero3-1f1b-moe": {**PP_FSDP, **MOE_DP},
    # ep 2: each rank of a stage holds half of its experts (edp 1), dense weights sharded
    "zero2-1f1b-ep2": {
        **PP_FSDP,
        **MOE_DP,
        "parallel.data_parallel_sharding_strategy": "optim_grads",
        "parallel.ep": 2,
    },
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_pp2_fully_sharded_experts_match_single_process(
    case, corpus_cache, tmp_path, tmp_path_factory
):
    """test_moe_train.py's comparison: losses, parameters, Adam moments and router
    statistics against one process."""
    cases = {case: (4, DP_REF, MOE_CASES[case])}
    _moe_case(cases, case, corpus_cache, tmp_path, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_pp2_fully_sharded_matches_single_process(case, corpus_cache, tmp_path, tmp_path_factory):
    arch_name, extra = CASES[case]
    arch = LLAMA if arch_name == "llama" else {}
    ref, ref_tensors = _reference(corpus_cache, tmp_path_factory, arch, {})
    args = small_job_args(corpus_cache, tmp_path / "run", **COMMON, **arch, **extra)
    results = run_ranks(_rank_train, 4, args, timeout=400)
    _check(results[0], results, ref, ref_tensors)


def test_pp2_fully_sharded_checkpoint_resumes_on_one_process_and_sharded(
    corpus_cache, tmp_path, tmp_path_factory
):
    """Saved at step 3 by pp=2 x dp_shard=2 (ZeRO-3, tied embeddings: each stage's dp_shard
    ranks write their rows); resumed by one process and by pp=2 x dp_shard=2 under ZeRO-2 (each
    rank reading its rows back), steps 4..6 are the uninterrupted run's."""
    ref, _ = _reference(corpus_cache, tmp_path_factory, {}, {})
    args = small_job_args(
        corpus_cache, tmp_path / "fsdp", **COMMON, **PP_FSDP, **{"checkpoint.save_interval": 3}
    )
    root = run_ranks(_rank_train, 4, args, timeout=400)[0]["checkpoint"].rsplit("/", 1)[0]
    more = {"checkpoint.load": root, "checkpoint.load_step": 3, "checkpoint.save": f"{root}-1"}
    alone = train(load_config(small_job_args(corpus_cache, tmp_path / "alone", **COMMON, **more)))
    back = {
        **PP_FSDP,
        "parallel.data_parallel_sharding_strategy": "optim_grads",
        "checkpoint.load": root,
        "checkpoint.load_step": 3,
        "checkpoint.save": f"{root}-back",
    }
    args = small_job_args(corpus_cache, tmp_path / "back", **COMMON, **back)
    resumed = run_ranks(_rank_train, 4, args, timeout=400)[0]
    for losses in (alone.losses, resumed["losses"]):
        assert sorted(losses) == list(range(4, STEPS + 1))
        for step in range(4, STEPS + 1):
            assert losses[step] == pytest.approx(ref.losses[step], rel=1e-6, abs=1e-7), step


def _rank_reductions(rank, world, args):
    """Reduce-scatters this rank issues in one step (FSDP2's `foreach_reduce`, one per sharded
    unit whose gradients it reduces), and the number of sharded units of its stage."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from meshtrain.services.trainer.train import Trainer

    trainer = Trainer(load_config(args))
    calls = []
    reduce = _fsdp_param_group.foreach_reduce

    def counting(*a, **k):
        calls.append(1)
        return reduce(*a, **k)

    _fsdp_param_group.foreach_reduce = counting
    try:
        trainer.train_step(0)
    finally:
        _fsdp_param_group.foreach_reduce = reduce
    units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    return len(calls), units, trainer.pipeline.n_micro


def test_gradients_are_reduce_scattered_once_a_step_not_per_micro_batch(corpus_cache, tmp_path):
    """Two micro-batches per step and rank (1f1b): each sharded unit (the stage's blocks, the
    stage itself) reduce-scatters once, in its last backward, not once per micro-batch."""
    args = small_job_args(corpus_cache, tmp_path / "run", **COMMON, **PP_FSDP)
    for calls, units, n_micro in run_ranks(_rank_reductions, 4, args, timeout=400):
        assert n_micro == 2
        assert calls == units, (calls, units)
