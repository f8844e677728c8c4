"""Pipeline-parallel training equals single-process training: every schedule, with tp, dp, ZeRO-1.

Each case runs the real trainer (`train(job)`) on several gloo ranks and compares with a
single-process run of the same job (fp32): the loss of each of 6 steps and the eval losses to
1e-6 relative, and every parameter and Adam moment after the last step (read back from each
run's checkpoint: layout-free, global layer numbers) to 2e-5 absolute, as the tp/dp
equivalence tests. GPT-2 cases tie the embeddings, so the first and the last stage share the
word embedding (its gradient summed over both); Llama cases untie them.
"""

import pytest
import torch

from meshtrain.services.checkpoint.reader import load_checkpoint
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.parallel.test_equivalence import LLAMA

pytestmark = pytest.mark.dist

STEPS = 6
COMMON = {
    "train.train_iters": STEPS,
    "train.eval_interval": 3,
    "train.eval_iters": 2,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 8,
    "model.num_layers": 4,
    "parallel.ddp_bucket_size": 20000,
}


def _rank_train(rank, world, args):
    result = train(load_config(args))
    return {"losses": result.losses, "eval": result.eval_losses, "checkpoint": result.checkpoint}


_references: dict = {}


def _reference(corpus_cache, tmp_path_factory, arch: dict, shape: dict):
    """The single-process run of (arch, shape), run once per session."""
    key = (tuple(sorted(arch.items())), tuple(sorted(shape.items())))
    if key not in _references:
        run = tmp_path_factory.mktemp("pp-ref")
        result = train(
            load_config(small_job_args(corpus_cache, run, **{**COMMON, **shape}, **arch))
        )
        root = result.checkpoint.rsplit("/", 1)[0]
        _references[key] = (result, load_checkpoint(root, STEPS)[0])
    return _references[key]


def _check(got, results, ref, ref_tensors, steps=range(1, STEPS + 1), bf16=False):
    """fp32: losses to 1e-6 relative, tensors to 2e-5; bf16 (sums over dp in another order, each
    rounded to bf16 downstream): 2e-2 and 5e-3."""
    rel, atol = (2e-2, 5e-3) if bf16 else (1e-6, 2e-5)
    assert sorted(got["losses"]) == list(steps)
    for step in steps:
        assert got["losses"][step] == pytest.approx(ref.losses[step], rel=rel, abs=1e-7), (
            f"step {step}"
        )
    for step, loss in got["eval"].items():
        assert loss == pytest.approx(ref.eval_losses[step], rel=rel, abs=1e-7), f"eval step {step}"
    assert all(
        r["losses"] == got["losses"] for r in results
    )  # every rank reports the last stage's losses
    tensors, _ = load_checkpoint(got["checkpoint"].rsplit("/", 1)[0], max(steps))
    assert {n for n in tensors if not n.startswith("rng.")} == {
        n for n in ref_tensors if not n.startswith("rng.")
    }
    for name, ref_t in ref_tensors.items():
        if not name.startswith("rng."):
            torch.testing.assert_close(tensors[name], ref_t, rtol=0, atol=atol, msg=name)


# name: (world, arch, shape (changes the reference), parallel settings)
CASES = {
    "pp2-1f1b-tied": (2, "gpt2", {}, {"parallel.pp": 2}),
    "pp2-gpipe": (2, "gpt2", {}, {"parallel.pp": 2, "parallel.pipeline_schedule": "gpipe"}),
    "pp2-none": (2, "llama", {}, {"parallel.pp": 2, "parallel.pipeline_schedule": "none"}),
    "pp2-zb-h1-tied": (2, "gpt2", {}, {"parallel.pp": 2, "parallel.pipeline_schedule": "zb-h1"}),
    "pp2-interleaved-v2": (
        2,
        "llama",
        {},
        {"parallel.pp": 2, "parallel.virtual_pipeline_model_parallel_size": 2},
    ),
    "pp4-1f1b": (4, "llama", {}, {"parallel.pp": 4}),
    "pp4-interleaved-m8": (
        4,
        "gpt2",
        {"model.num_layers": 8},
        {
            "parallel.pp": 4,
            "parallel.num_layers_per_virtual_pipeline_stage": 1,
            "parallel.overlap_grad_reduce": True,
        },
    ),
    # fewer micro-batches than stages, and a count that pp does not divide
    "pp4-1f1b-m2": (4, "gpt2", {"train.global_batch_size": 4}, {"parallel.pp": 4}),
    "pp2-zb-h1-m3": (
        2,
        "llama",
        {"train.global_batch_size": 6},
        {"parallel.pp": 2, "parallel.pipeline_schedule": "zb-h1"},
    ),
    "pp2-uneven-first1": (
        2,
        "gpt2",
        {"model.num_layers": 3},
        {"parallel.pp": 2, "parallel.decoder_first_pipeline_num_layers": 1},
    ),
    "pp2-tp2-sp": (
        4,
        "llama",
        {},
        {"parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
    ),
    "pp2-tp2-zb-h1-tied": (
        4,
        "gpt2",
        {},
        {"parallel.pp": 2, "parallel.tp": 2, "parallel.pipeline_schedule": "zb-h1"},
    ),
    "pp2-dp2-zb-h1-zero1-overlap-bf16": (
        4,
        "llama",
        {"train.bf16": True},
        {
            "parallel.pp": 2,
            "parallel.pipeline_schedule": "zb-h1",
            "parallel.use_distributed_optimizer": True,
            "parallel.overlap_grad_reduce": True,
        },
    ),
    "pp2-dp2-zero1-overlap-recompute": (
        4,
        "gpt2",
        {},
        {
            "parallel.pp": 2,
            "parallel.use_distributed_optimizer": True,
            "parallel.overlap_grad_reduce": True,
            "parallel.overlap_param_gather": True,
            "parallel.recompute_granularity": "full",
        },
    ),
}
SLOW = {
    "pp2-tp2-dp2-interleaved": (
        8,
        "llama",
        {},
        {
            "parallel.pp": 2,
            "parallel.tp": 2,
            "parallel.virtual_pipeline_model_parallel_size": 2,
            "parallel.use_distributed_optimizer": True,
            "parallel.overlap_grad_reduce": True,
        },
    ),
    # torch.compile per block on every stage (Inductor's CPU code: minutes to compile on 2 cores)
    "pp2-compiled": (2, "gpt2", {}, {"parallel.pp": 2, "train.compile": True}),
}


def _run_case(case, cases, corpus_cache, tmp_path, tmp_path_factory):
    world, arch_name, shape, extra = cases[case]
    arch = LLAMA if arch_name == "llama" else {}
    ref, ref_tensors = _reference(corpus_cache, tmp_path_factory, arch, shape)
    args = small_job_args(corpus_cache, tmp_path / "run", **{**COMMON, **shape}, **arch, **extra)
    results = run_ranks(_rank_train, world, args, timeout=400)
    _check(results[0], results, ref, ref_tensors, bf16=bool(shape.get("train.bf16")))


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_training_matches_single_process(case, corpus_cache, tmp_path, tmp_path_factory):
    _run_case(case, CASES, corpus_cache, tmp_path, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_pipeline_training_matches_single_process_world8(
    case, corpus_cache, tmp_path, tmp_path_factory
):
    _run_case(case, SLOW, corpus_cache, tmp_path, tmp_path_factory)


def test_checkpoint_from_pp2_tp2_resumes_at_pp1_pp4_and_tp1(
    corpus_cache, tmp_path, tmp_path_factory
):
    """Layout independence: saved at step 3 by pp=2 x tp=2 (tied embeddings: only the first
    stage's copy is stored), resumed by one process, by pp=4 and by pp=2 x tp=1: steps 4..6
    match the uninterrupted single-process run; and the pp run's final checkpoint exports to
    Hugging Face exactly as the single-process run's does."""
    from safetensors.torch import load_file

    from meshtrain.services.checkpoint.hf.convert import export_hf

    ref, ref_tensors = _reference(corpus_cache, tmp_path_factory, {}, {})
    saved = run_ranks(
        _rank_train,
        4,
        small_job_args(
            corpus_cache,
            tmp_path / "pp2tp2",
            **COMMON,
            **{"parallel.pp": 2, "parallel.tp": 2, "checkpoint.save_interval": 3},
        ),
        timeout=400,
    )
    root = saved[0]["checkpoint"].rsplit("/", 1)[0]
    _check(saved[0], saved, ref, ref_tensors)
    for name, world, extra in [
        ("pp1", 1, {}),
        ("pp4", 4, {"parallel.pp": 4}),
        ("pp2", 2, {"parallel.pp": 2}),
    ]:
        args = small_job_args(
            corpus_cache,
            tmp_path / name,
            **COMMON,
            **extra,
            **{
                "checkpoint.load": root,
                "checkpoint.load_step": 3,
                "checkpoint.save": str(tmp_path / f"ck-{name}"),
            },
        )
        if world == 1:
            got = _rank_train(0, 1, args)
            results = [got]
        else:
            results = run_ranks(_rank_train, world, args, timeout=400)
        _check(results[0], results, ref, ref_tensors, steps=range(4, STEPS + 1))
    ref_root = ref.checkpoint.rsplit("/", 1)[0]
    export_hf(root, str(tmp_path / "hf-pp"), STEPS)
    export_hf(ref_root, str(tmp_path / "hf-ref"), STEPS)
    ours = load_file(tmp_path / "hf-pp" / "model.safetensors")
    theirs = load_file(tmp_path / "hf-ref" / "model.safetensors")
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=2e-5, msg=name)


def _rank_fails_mid_schedule(rank, world, args):
    """Rank 1's stage raises in its 7th chunk forward (inside step 2's schedule)."""
    import time

    from meshtrain.services.trainer.parallel.pipeline.stage import PipelineStage

    if rank == 1:
        calls = {"n": 0}
        forward = PipelineStage.forward_chunk

        def failing(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 7:
                raise RuntimeError("injected failure in rank 1's forward")
            return forward(self, *a, **k)

        PipelineStage.forward_chunk = failing
        return _rank_train(rank, world, args)  # raises: the process exits, as a failing rank's does
    try:
        return _rank_train(rank, world, args)
    except Exception as e:  # the peer's failure reaches rank 0 as a broken point-to-point transfer
        return {"error": f"{type(e).__name__}: {e}", "at": time.monotonic()}


def test_a_rank_failing_mid_schedule_ends_every_rank_and_its_error_comes_first(
    corpus_cache, tmp_path
):
    """No hangs: rank 1 raises in the middle of a step's schedule; rank 0, blocked on a transfer
    with it, fails too, after rank 1's error and well within the distributed timeout."""
    args = small_job_args(
        corpus_cache,
        tmp_path / "run",
        **{
            **COMMON,
            "parallel.pp": 2,
            "parallel.distributed_timeout_minutes": 1.0,
            "train.eval_interval": 0,
        },
    )
    results = run_ranks(_rank_fails_mid_schedule, 2, args, timeout=200, errors="return")
    assert "injected failure in rank 1's forward" in results[1]["error"]
    assert "error" in results[0], results[0]
    assert results[1]["at"] <= results[0]["at"] < results[1]["at"] + 50, results


def test_resume_with_dropout_at_the_same_pp_is_exact(corpus_cache, tmp_path):
    """Each stage draws dropout masks from its own generator, in its own amounts: each stage's
    state is saved (a row per stage) and restored, so a pp=2 run with dropout resumed from step
    3 repeats the uninterrupted run's losses exactly."""
    extra = {
        **COMMON,
        "parallel.pp": 2,
        "model.hidden_dropout": 0.1,
        "model.attention_dropout": 0.1,
        "train.eval_interval": 0,
        "checkpoint.save_interval": 3,
    }
    whole = run_ranks(
        _rank_train, 2, small_job_args(corpus_cache, tmp_path / "whole", **extra), timeout=400
    )[0]
    root = whole["checkpoint"].rsplit("/", 1)[0]
    resumed = run_ranks(
        _rank_train,
        2,
        small_job_args(
            corpus_cache,
            tmp_path / "resumed",
            **{
                **extra,
                "checkpoint.load": root,
                "checkpoint.load_step": 3,
                "checkpoint.save": str(tmp_path / "ck"),
            },
        ),
        timeout=400,
    )[0]
    assert sorted(resumed["losses"]) == [4, 5, 6]
    assert all(resumed["losses"][s] == whole["losses"][s] for s in (4, 5, 6)), (
        resumed["losses"],
        whole["losses"],
    )
