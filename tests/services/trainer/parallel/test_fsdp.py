"""Fully sharded data parallelism (FSDP2) trains exactly as one process, in less memory per rank.

Each case runs the real trainer on gloo ranks and compares with the single-process run of the
same job: every step's loss to 1e-6 relative, and the final parameters and Adam moments read
back from each run's checkpoint (written shard by shard, in global coordinates). Tolerances as
in test_equivalence.py (fp32, different reduction orders).
"""

from dataclasses import dataclass

import pytest
import torch

from meshtrain.services.checkpoint.reader import load_checkpoint
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.fp8.linear import Fp8Linear
from meshtrain.services.trainer.metrics import read_metrics
from meshtrain.services.trainer.train import Trainer, train
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.parallel.test_pipeline import COMMON as PIPELINE_COMMON
from tests.services.trainer.parallel.test_pipeline import _check as pipeline_check
from tests.services.trainer.parallel.test_pipeline import _reference as pipeline_reference
from tests.services.trainer.test_moe_train import DP as MOE_DP
from tests.services.trainer.test_moe_train import DP_REF, MOE_ARCH, _moe_case

pytestmark = pytest.mark.dist

COMMON = {
    "train.train_iters": 4,
    "train.eval_interval": 2,  # an evaluation between steps and before the step-2 save
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
# Unclipped: the gradient norm sums its shards in another order than one process, and a clip
# coefficient one ulp apart moves a bf16 weight across a rounding boundary sooner or later
# (test_fp8_parallel.py's pipeline case tells the story); unclipped it is only reported.
FP8 = {"train.bf16": True, "train.fp8": "hybrid", "optim.clip_grad": 0}


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


@dataclass
class Result:
    losses: dict


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
    # context parallelism: the rows split over dp_shard x cp, the cp shares summed
    "zero3-cp2": (2, "gpt2", {**FSDP, "parallel.cp": 2}),
    "zero2-cp2-dp2-a2a": (
        4,
        "llama",
        {
            "parallel.data_parallel_sharding_strategy": "optim_grads",
            "parallel.cp": 2,
            "parallel.cp_comm_type": "a2a",
        },
    ),
    "hsdp-2x1-cp2": (4, "gpt2", {**FSDP, "parallel.cp": 2, "parallel.dp_replicate": 2}),
    # each block compiled, FSDP2's gathers and reduce-scatters between them
    "zero3-dp2-compiled": (2, "gpt2", {**FSDP, "train.compile": True}),
}
# 4 ranks on a few cores: ~40 s each; Inductor's CPU code: minutes to compile on 2 cores
SLOW = {
    "zero3-tp2-dp2-sp",
    "hsdp-2x2",
    "zero3-dp2-compiled",
    "zero2-cp2-dp2-a2a",
    "hsdp-2x1-cp2",
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in CASES]
)
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


def _rank_train_fp8(rank, world, args):
    trainer = Trainer(load_config(args))
    layers = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    result = trainer.run()
    return {
        "losses": result.losses,
        "checkpoint": result.checkpoint,
        "fp8_layers": len(layers),
        "cache": trainer.fp8_weights is not None,
        # no layer keeps a cast of its gathered weight between forwards
        "held": sum(b.numel() for m in layers for b in m.buffers()),
    }


@pytest.mark.parametrize(
    "recipe, layout",
    [
        ("tensorwise", {}),
        pytest.param("delayed", {}, marks=pytest.mark.slow),
        ("tensorwise", {"parallel.cp": 2}),
        pytest.param("delayed", {"parallel.cp": 2}, marks=pytest.mark.slow),
    ],
    ids=["tensorwise-dp2", "delayed-dp2", "tensorwise-cp2", "delayed-cp2"],
)
def test_fp8_fully_sharded_matches_fp8_data_parallel(recipe, layout, corpus_cache, tmp_path):
    """FP8 linears on the weights FSDP2 gathers (fp32, cast in each layer's forward) against
    plain data parallelism's FP8 run on the same two ranks: the same weights and whole-tensor
    scales, so the same FP8 values reach every GEMM, and the same two gradients summed. Losses
    to 1e-6 relative, parameters and moments as the fp32 cases. Against one process (which casts
    once a step into `Fp8WeightCache`), bf16 rounding of gradients accumulated in another order
    drifts by step 3 (1.4e-6 measured): the 1e-4 bound of test_fp8_parallel.py's dp case.

    cp=2: the parameters split over dp_shard x cp, each cp rank on its half of every sequence
    with the amaxes reduced over cp, against the same cp=2 layout unsharded (the same scales
    and sums); against one process, test_fp8_parallel.py's cp bound (5e-4: attention's
    blockwise merge rounds otherwise in bf16, and FP8 casts amplify it)."""
    extra = {**COMMON, **FP8, "train.fp8_recipe": recipe}
    one = train(load_config(small_job_args(corpus_cache, tmp_path / "one", **extra))).losses
    extra = {**extra, **layout}
    ddp = run_ranks(
        _rank_train, 2, small_job_args(corpus_cache, tmp_path / "ddp", **extra), timeout=400
    )[0]
    ddp_tensors, _ = load_checkpoint(ddp["checkpoint"].rsplit("/", 1)[0], 4)
    args = small_job_args(corpus_cache, tmp_path / "run", **extra, **FSDP)
    results = run_ranks(_rank_train_fp8, 2, args, timeout=400)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert results[0]["fp8_layers"] == 2 * 4  # QKV, proj, fc1, fc2 of both blocks
    assert not results[0]["cache"] and results[0]["held"] == 0
    ref = Result(losses=ddp["losses"])
    assert_same_training(results[0], ref, ddp_tensors)
    worst = max(abs(results[0]["losses"][s] - one[s]) / one[s] for s in one)
    assert worst < (5e-4 if layout else 1e-4)


# Mixtures of experts, through test_moe_train.py's job (aux and z losses, capacity, expert bias,
# shared expert) and its one-process reference on the whole global micro-batch: the experts a
# unit of their own inside each block, split over the ranks holding the same experts (edp).
MOE_CASES = {
    # ep 1: the experts whole on every rank, sharded with the block as any weight
    "zero3-dp2-moe": (2, DP_REF, {**MOE_DP, **FSDP}),
    # ep 2 on 2 ranks: each rank its own experts (edp 1), the dense weights split over dp
    "zero3-dp2-ep2": (2, DP_REF, {**MOE_DP, **FSDP, "parallel.ep": 2}),
    # edp 2: the experts' rows split over the two ranks holding them
    "zero2-dp4-ep2": (
        4,
        DP_REF,
        {
            "train.global_batch_size": 4,
            "train.micro_batch_size": 1,
            "parallel.data_parallel_sharding_strategy": "optim_grads",
            "parallel.ep": 2,
        },
    ),
    # hybrid: dense weights split over dp_shard {0,1}, {2,3}; experts over edp {0,2}, {1,3}
    "hsdp-2x2-ep2": (
        4,
        DP_REF,
        {
            **FSDP,
            "train.global_batch_size": 4,
            "train.micro_batch_size": 1,
            "parallel.dp_replicate": 2,
            "parallel.ep": 2,
        },
    ),
}


@pytest.mark.slow  # MoE jobs of six steps (test_moe_train.py's): ~30 s at 2 ranks, ~60 s at 4
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_fully_sharded_experts_match_single_process(case, corpus_cache, tmp_path, tmp_path_factory):
    """test_moe_train.py's comparison (losses, parameters, moments, router statistics), and the
    gradient norm: dense shards summed over dp_shard, expert shards over dp (edp x ep)."""
    _moe_case(MOE_CASES, case, corpus_cache, tmp_path, tmp_path_factory)
    ref, _ = pipeline_reference(corpus_cache, tmp_path_factory, MOE_ARCH, MOE_CASES[case][1])
    norms = [
        [r["grad_norm"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
        for run in (ref.run_dir, tmp_path / "run")
    ]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


# Context parallelism with experts: each cp rank routes its own tokens, the router statistics
# and the aux loss taken over dp x cp (the whole micro-batch, as one process). Dropless: a
# capacity is per sequence, which cp splits (refused with cp > 1).
MOE_DROPLESS = {k: v for k, v in MOE_ARCH.items() if k != "model.moe_expert_capacity_factor"}
CP_MOE_CASES = {
    # ep 1: the experts whole per block, sharded over dp_shard x cp with the block's weights
    "zero3-cp2-moe": {**FSDP, "parallel.cp": 2},
    # ep 2 folded out of cp: each cp rank holds half of the experts (edp 1, not sharded), the
    # tokens travel to them by all-to-all across the cp ranks
    "zero3-cp2-ep2": {**FSDP, "parallel.cp": 2, "parallel.ep": 2},
}


@pytest.mark.parametrize("case", list(CP_MOE_CASES))  # ~13 s each, the reference shared
def test_fully_sharded_experts_under_context_parallelism_match_single_process(
    case, corpus_cache, tmp_path, tmp_path_factory
):
    """test_pipeline.py's comparison (losses and eval losses to 1e-6, parameters and Adam
    moments to 2e-5: fp32, sums in another order) against one process on the same
    micro-batches, and the gradient norm to 1e-5."""
    ref, ref_tensors = pipeline_reference(corpus_cache, tmp_path_factory, MOE_DROPLESS, {})
    run = tmp_path / "run"
    args = small_job_args(
        corpus_cache, run, **{**PIPELINE_COMMON, **MOE_DROPLESS, **CP_MOE_CASES[case]}
    )
    results = run_ranks(_rank_train, 2, args, timeout=400)
    pipeline_check(results[0], results, ref, ref_tensors)
    norms = [
        [r["grad_norm"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r]
        for d in (ref.run_dir, run)
    ]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


def _resume_args(corpus_cache, run, root, extra):
    more = {"checkpoint.load": root, "checkpoint.load_step": 2, "checkpoint.save": f"{run}-ck"}
    return small_job_args(corpus_cache, run, **COMMON, **extra, **more)


@pytest.mark.slow
def test_zero3_checkpoint_resumes_at_zero1_and_on_one_process(
    corpus_cache, tmp_path, tmp_path_factory
):
    """Saved by ZeRO-3 at step 2 (each rank its own rows); resumed by ZeRO-1 on 2 ranks and by
    one process, steps 3..4 are the uninterrupted run's."""
    ref, _ = reference(corpus_cache, tmp_path_factory, "gpt2")
    args = small_job_args(
        corpus_cache, tmp_path / "zero3", **COMMON, **FSDP, **{"checkpoint.save_interval": 2}
    )
    root = run_ranks(_rank_train, 2, args, timeout=400)[0]["checkpoint"].rsplit("/", 1)[0]
    zero1 = run_ranks(
        _rank_train,
        2,
        _resume_args(
            corpus_cache, tmp_path / "zero1", root, {"parallel.use_distributed_optimizer": True}
        ),
        timeout=400,
    )[0]
    alone = train(load_config(_resume_args(corpus_cache, tmp_path / "alone", root, {})))
    for losses in (zero1["losses"], alone.losses):
        assert sorted(losses) == [3, 4]
        for step in (3, 4):
            assert losses[step] == pytest.approx(ref.losses[step], rel=1e-6, abs=1e-6), step


@pytest.mark.slow
def test_zero1_checkpoint_resumes_under_zero3_with_tp(corpus_cache, tmp_path, tmp_path_factory):
    """The other direction, into tp=2 x dp_shard=2: the rows each rank reads are cut from the
    tensor-parallel boxes."""
    ref, ref_tensors = reference(corpus_cache, tmp_path_factory, "llama")
    extra = {"parallel.use_distributed_optimizer": True, "checkpoint.save_interval": 2}
    args = small_job_args(corpus_cache, tmp_path / "zero1", **COMMON, **LLAMA, **extra)
    root = run_ranks(_rank_train, 2, args, timeout=400)[0]["checkpoint"].rsplit("/", 1)[0]
    resumed = run_ranks(
        _rank_train,
        4,
        _resume_args(corpus_cache, tmp_path / "zero3", root, {**LLAMA, **FSDP, "parallel.tp": 2}),
        timeout=400,
    )[0]
    assert sorted(resumed["losses"]) == [3, 4]
    assert_same_training(resumed, ref, ref_tensors, steps=range(3, 5))


def _rank_bytes(rank, world, args):
    from meshtrain.services.trainer.parallel.fsdp import state_bytes

    trainer = Trainer(load_config(args))
    trainer.train_step(0)  # the optimizer state exists from the first step
    trainer._accumulate(trainer.data.train.micro_batches(1), None)  # and gradients, held
    if trainer.ddp is not None:
        trainer.ddp.finish_grad_sync()
    return state_bytes(trainer.model, trainer.optimizer)


@pytest.mark.slow
def test_per_rank_state_bytes_fall_as_one_over_the_shards(corpus_cache, tmp_path):
    """Parameters + gradients + Adam moments held per rank (tensor storage bytes) at dp_shard
    N = 1, 2, 4: 1/N of one process's, up to FSDP2's padding of each parameter to whole rows."""
    extra = {**COMMON, "model.hidden_size": 64, "model.seq_length": 16}
    one = _rank_bytes(0, 1, small_job_args(corpus_cache, tmp_path / "n1", **extra))
    total = {1: sum(one.values())}
    for n in (2, 4):
        args = small_job_args(corpus_cache, tmp_path / f"n{n}", **extra, **FSDP)
        per_rank = [sum(b.values()) for b in run_ranks(_rank_bytes, n, args, timeout=400)]
        total[n] = max(per_rank)
        for kind in ("parameters", "gradients", "optimizer"):
            assert one[kind] > 0
        assert total[1] / n <= total[n] <= total[1] / n * 1.05, (n, per_rank, total)
    assert total[4] < total[2] < total[1]
