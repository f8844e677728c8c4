"""Training a mixture of experts: Megatron's MoE flags, the config checks, the loop's statistics,
MFU, recompute and pipeline parallelism against one process, and the CLI end to end."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.flags import parse_layer_freq
from meshtrain.services.trainer.config.load import config_help, load_config
from meshtrain.services.trainer.metrics import model_size, read_metrics
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.model.moe import moe_layers
from meshtrain.services.trainer.train import Trainer, train
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.parallel.test_equivalence import LLAMA
from tests.services.trainer.parallel.test_pipeline import COMMON, STEPS, _check, _reference

REPO = Path(__file__).resolve().parents[3]

# ----------------------------------------------------------------------------- flags and config


def test_megatron_moe_flags_map_to_the_model_keys():
    job = load_config(
        [
            "--num-layers",
            "4",
            "--num-experts",
            "8",
            "--moe-router-topk",
            "1",
            "--moe-ffn-hidden-size",
            "96",
            "--moe-layer-freq",
            "([1]*1+[0])*2",
            "--moe-shared-expert-intermediate-size",
            "64",
            "--moe-shared-expert-gate",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-topk-scaling-factor",
            "2.5",
            "--moe-aux-loss-coeff",
            "1e-2",
            "--moe-z-loss-coeff",
            "1e-3",
            "--moe-expert-capacity-factor",
            "1.25",
            "--moe-token-drop-policy",
            "position",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "1e-4",
            "--moe-grouped-gemm",
            "--moe-router-load-balancing-type",
            "aux_loss",
            "--expert-tensor-parallel-size",
            "1",
        ]
    )
    m = job.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq) == (
        8,
        1,
        96,
        [1, 0, 1, 0],
    )
    assert (
        m.moe_shared_expert_intermediate_size,
        m.moe_shared_expert_gate,
        m.moe_router_score_function,
    ) == (64, True, "sigmoid")
    assert (m.moe_router_topk_scaling_factor, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (
        2.5,
        1e-2,
        1e-3,
    )
    assert (m.moe_expert_capacity_factor, m.moe_token_drop_policy) == (1.25, "position")
    assert (m.moe_router_enable_expert_bias, m.moe_router_bias_update_rate, m.moe_grouped_gemm) == (
        True,
        1e-4,
        True,
    )
    assert job.parallel.expert_tensor_parallel_size == 1
    assert [m.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert load_config(
        ["--num-experts", "4", "--moe-router-pre-softmax"]
    ).model.moe_router_pre_softmax
    assert load_config(["--num-experts", "4", "--moe-layer-freq", "2"]).model.moe_layer_freq == 2
    assert load_config(
        ["--num-layers", "3", "--num-experts", "4", "--model.moe_layer_freq=[0,1,1]"]
    ).model.moe_layer_freq == [0, 1, 1]


def test_load_balancing_type_none_turns_the_aux_loss_off_and_others_are_refused():
    none = load_config(["--num-experts", "4", "--moe-router-load-balancing-type", "none"])
    assert none.model.moe_aux_loss_coeff == 0.0
    with pytest.raises(ConfigError, match="load-balancing-type=none.*moe-aux-loss-coeff=0.01"):
        load_config(
            [
                "--num-experts",
                "4",
                "--moe-aux-loss-coeff",
                "0.01",
                "--moe-router-load-balancing-type",
                "none",
            ]
        )
    for other in ("seq_aux_loss", "sinkhorn"):
        with pytest.raises(ConfigError, match=f"load-balancing-type='{other}' is not supported"):
            load_config(["--num-experts", "4", "--moe-router-load-balancing-type", other])


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1", 1),
        ("[1,0,1]", [1, 0, 1]),
        ("([1]*3+[0])*2", [1, 1, 1, 0, 1, 1, 1, 0]),
        ("2*[0,1]", [0, 1, 0, 1]),
        ("[0]+[1]*2", [0, 1, 1]),
    ],
)
def test_layer_freq_expressions_are_read_without_eval(text, expected):
    assert parse_layer_freq(text) == expected


@pytest.mark.parametrize(
    "text,why",
    [
        ("__import__('os').system('true')", "only integers, lists"),
        ("[1]*-1", "only integers"),
        ("[1]*10**12", "only integers"),
        ("[1]*1000000", "repeated 1000000 times"),
        ("[[1]]", "no nested lists"),
        ("[1]+2", r"\+ joins two lists"),
        ("[1]*[2]", r"\* repeats a list"),
        ("([1]", "neither an integer"),
        ("[1.5]", "only integers"),
        ("[True]", "only integers"),
    ],
)
def test_bad_layer_freq_expressions_are_refused_by_name(text, why):
    with pytest.raises(ConfigError, match=f"--moe-layer-freq.*{why}"):
        parse_layer_freq(text)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--expert-model-parallel-size", "2"],
            "parallel.ep=2 splits the experts.*model.num_experts is unset",
        ),
        (
            ["--num-experts", "6", "--expert-model-parallel-size", "4"],
            "parallel.ep=4 must divide model.num_experts=6",
        ),
        (
            [
                "--num-experts",
                "4",
                "--moe-expert-capacity-factor",
                "1",
                "--context-parallel-size",
                "2",
            ],
            "moe_expert_capacity_factor.*parallel.cp=2",
        ),
        (
            ["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
            r"expert_tensor_parallel_size=2: only .*parallel.tp=1",
        ),
        (
            [
                "--num-experts",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--moe-ffn-hidden-size",
                "33",
                "--ffn-hidden-size",
                "64",
            ],
            "parallel.tp=2 must divide model.moe_ffn_hidden_size=33",
        ),
        (
            ["--num-experts", "4", "--model.moe_grouped_gemm=false", "--train.cuda_graph=true"],
            "train.cuda_graph captures a mixture of experts only with.*moe_grouped_gemm=false",
        ),
        (
            [
                "--num-experts",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--train.cuda_graph=true",
            ],
            "train.cuda_graph captures a mixture of experts only with.*parallel.ep=2",
        ),
        (["--expert-model-parallel-size", "0"], "parallel.ep must be >= 1"),
    ],
)
def test_combinations_that_cannot_work_are_refused_naming_the_keys(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)


def test_expert_parallel_config_is_accepted_and_documented():
    job = load_config(
        [
            "--num-experts",
            "8",
            "--expert-model-parallel-size",
            "4",
            "--tensor-model-parallel-size",
            "2",
            "--expert-tensor-parallel-size",
            "2",
        ]
    )
    assert (job.parallel.ep, job.parallel.expert_tensor_parallel_size) == (4, 2)
    text = config_help()
    for key in (
        "--parallel.expert_tensor_parallel_size",
        "--parallel.ep",
        "--model.num_experts",
        "--model.moe_layer_freq",
    ):
        assert key in text
    assert "--moe-router-load-balancing-type" in text and "--expert-tensor-parallel-size" in text


# --------------------------------------------------------------------------- the loop (one process)
MOE = {
    "model.num_layers": 3,
    "model.hidden_size": 32,
    "model.seq_length": 32,
    "model.num_experts": 4,
    "model.moe_router_topk": 2,
    "model.moe_ffn_hidden_size": 32,
    "model.moe_layer_freq": "[1,0,1]",
    "model.moe_aux_loss_coeff": 0.01,
    "model.moe_z_loss_coeff": 0.001,
    "train.micro_batch_size": 4,
    "train.global_batch_size": 8,
    "train.train_iters": 4,
    "train.eval_interval": 2,
    "train.eval_iters": 1,
}


def _train(corpus_cache, run_dir, **extra):
    trainer = Trainer(load_config(small_job_args(corpus_cache, run_dir, **{**MOE, **extra})))
    result = trainer.run()
    return trainer, result, read_metrics(run_dir / "metrics.jsonl")


def _moe_keys(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("moe/")}


def test_router_statistics_are_logged_and_the_loss_stays_the_language_model_loss(
    corpus_cache, tmp_path
):
    """fp32 on CPU: the aux losses change no forward value, so the first step's loss is the same
    bit for bit with and without them; their gradients make the later steps differ."""
    capped, result, rows = _train(
        corpus_cache,
        tmp_path / "capped",
        **{"model.moe_expert_capacity_factor": 1.0, "model.moe_router_enable_expert_bias": True},
    )
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        keys = _moe_keys(r)
        assert set(keys) == {
            f"moe/layer{i}/{what}"
            for i in (0, 2)
            for what in ("tokens_per_expert_max_over_mean", "dropped")
        } | {"moe/aux_loss", "moe/z_loss"}
        for i in (0, 2):
            assert keys[f"moe/layer{i}/tokens_per_expert_max_over_mean"] >= 1.0
            # capacity 1.0: ceil(32 tokens x 2 / 4 experts) = 16 choices per expert and sequence
            assert 0 < keys[f"moe/layer{i}/dropped"] < 8 * 32 * 2
        # two layers, each about coeff x 1 (the Switch loss is 1 at perfect balance, at most E)
        assert 0.01 < keys["moe/aux_loss"] < 2 * 0.01 * 4
        assert keys["moe/z_loss"] > 0
    assert math.isfinite(steps[-1]["loss"]) and steps[-1]["loss"] < steps[0]["loss"]
    biases = [m.router.expert_bias for _, m in moe_layers(capped.model)]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)  # moved after every step
    # each step's statistics were taken (not summed into the next step's)
    assert all(m.stats.micro_batches == 0 for _, m in moe_layers(capped.model))

    _, plain, plain_rows = _train(
        corpus_cache,
        tmp_path / "plain",
        **{
            "model.moe_expert_capacity_factor": 1.0,
            "model.moe_router_enable_expert_bias": True,
            "model.moe_aux_loss_coeff": 0.0,
            "model.moe_z_loss_coeff": 0.0,
        },
    )
    assert plain.losses[1] == result.losses[1]
    assert plain.losses[4] != result.losses[4]
    first = _moe_keys(plain_rows[0])
    assert "moe/aux_loss" not in first and "moe/z_loss" not in first


def test_full_recompute_trains_the_same(corpus_cache, tmp_path):
    """Dropless, full recompute of every block: the same losses and router statistics, exactly."""
    _, ref, ref_rows = _train(corpus_cache, tmp_path / "ref")
    _, got, rows = _train(
        corpus_cache, tmp_path / "rc", **{"parallel.recompute_granularity": "full"}
    )
    assert got.losses == ref.losses and got.eval_losses == ref.eval_losses
    stats = [_moe_keys(r) for r in rows if "loss" in r]
    assert stats == [_moe_keys(r) for r in ref_rows if "loss" in r]
    assert all(s["moe/layer0/dropped"] == s["moe/layer2/dropped"] == 0 for s in stats)


def test_flops_count_active_experts_of_the_whole_model():
    config = ModelConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=256,
        activation="swiglu",
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_layer_freq=2,
    )
    size = model_size(config)
    full = GPT(config)
    assert (
        size.flops_per_token == full.flops_per_token() and size.parameters == full.num_parameters()
    )
    per_expert = 3 * 48 * 64
    assert (
        size.parameters - size.active_parameters == 2 * (8 - 2) * per_expert
    )  # two MoE blocks, six idle experts
    everyone = model_size(ModelConfig(**{**vars(config), "moe_router_topk": 8}))
    assert everyone.flops_per_token - size.flops_per_token == 6 * 2 * (8 - 2) * per_expert


# ----------------------------------------------------------------------------- several ranks (gloo)
# Llama-style MoE on both pipeline stages (block 0 on the stage without the head), with every
# statistic and balancing feature on: aux and z-loss, a capacity, the expert bias, a gated
# shared expert.
MOE_ARCH = {
    **LLAMA,
    "model.num_experts": 4,
    "model.moe_router_topk": 2,
    "model.moe_ffn_hidden_size": 32,
    "model.moe_layer_freq": "[1,0,1,1]",
    "model.moe_aux_loss_coeff": 0.01,
    "model.moe_z_loss_coeff": 0.001,
    "model.moe_expert_capacity_factor": 1.5,
    "model.moe_router_enable_expert_bias": True,
    "model.moe_router_bias_update_rate": 0.01,
    "model.moe_shared_expert_intermediate_size": 32,
    "model.moe_shared_expert_gate": True,
}

# The aux loss is computed over the global micro-batch (micro-batch i of every dp rank together):
# with dp = 2 and one micro-batch of 2 samples per rank that is the whole global batch of 4,
# which one process computes as one micro-batch of 4 (a nonlinear loss: other splits differ).
DP_REF = {"train.global_batch_size": 4, "train.micro_batch_size": 4}
DP = {"train.global_batch_size": 4, "train.micro_batch_size": 2}

# name: (world, reference shape, parallel settings)
SLOW_CASES = {
    "pp2-1f1b": (2, {}, {"parallel.pp": 2}),
    "dp2-ep2": (2, DP_REF, {**DP, "parallel.ep": 2}),
    "pp2-zb-h1-recompute": (
        2,
        {},
        {
            "parallel.pp": 2,
            "parallel.pipeline_schedule": "zb-h1",
            "parallel.recompute_granularity": "full",
        },
    ),
    "dp2-ep1-zero1-overlap": (
        2,
        DP_REF,
        {**DP, "parallel.use_distributed_optimizer": True, "parallel.overlap_grad_reduce": True},
    ),
    "pp2-dp2-ep2": (4, DP_REF, {**DP, "parallel.pp": 2, "parallel.ep": 2}),
}


def _rank_moe(rank, world, args):
    trainer = Trainer(load_config(args))
    result = trainer.run()
    return {
        "losses": result.losses,
        "eval": result.eval_losses,
        "checkpoint": result.checkpoint,
        "flops": trainer.flops_per_token,
        "parameters": trainer.num_parameters,
        "model": dict(vars(trainer.job.model)),
    }


def _moe_case(cases, case, corpus_cache, tmp_path, tmp_path_factory):
    world, shape, extra = cases[case]
    ref, ref_tensors = _reference(corpus_cache, tmp_path_factory, MOE_ARCH, shape)
    run = tmp_path / "run"
    results = run_ranks(
        _rank_moe,
        world,
        small_job_args(corpus_cache, run, **{**COMMON, **MOE_ARCH, **extra}),
        timeout=400,
    )
    _check(results[0], results, ref, ref_tensors)
    ref_rows = [_moe_keys(r) for r in read_metrics(ref.run_dir / "metrics.jsonl") if "loss" in r]
    rows = [_moe_keys(r) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(rows) == len(ref_rows) == STEPS and set(rows[0]) == set(ref_rows[0])
    assert {k for k in rows[0] if k.endswith("dropped")} == {
        f"moe/layer{i}/dropped" for i in (0, 2, 3)
    }
    for got, want in zip(rows, ref_rows):
        for key, value in want.items():  # counts exact; loss values to float32 rounding
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    full = GPT(ModelConfig(**results[0]["model"]))
    for r in results:  # every rank reports the whole model's FLOPs and size, not its shard's
        assert (r["flops"], r["parameters"]) == (full.flops_per_token(), full.num_parameters())


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_moe_training_matches_one_process(case, corpus_cache, tmp_path, tmp_path_factory):
    """Six steps: losses to 1e-6, parameters and moments to 2e-5 (test_pipeline's tolerances:
    fp32, sums in another order), router statistics to float32 rounding."""
    _moe_case(SLOW_CASES, case, corpus_cache, tmp_path, tmp_path_factory)


def _rank_losses(rank, world, args):
    trainer = Trainer(load_config(args))
    return trainer.run().losses


@pytest.mark.dist
def test_moe_blocks_on_both_pipeline_stages_train_as_one_process(corpus_cache, tmp_path):
    """pp = 2, block 0 (MoE) on the stage without the head: its aux gradients must arrive scaled
    by the pipeline's micro-batch count (1/4), or the router's update and the later losses
    differ. Three steps, fp32: losses to 1e-6 relative, router statistics to float32 rounding."""
    quick = {
        **COMMON,
        **MOE_ARCH,
        "model.hidden_size": 32,
        "model.seq_length": 32,
        "train.train_iters": 3,
        "train.eval_interval": 100,
        "model.moe_aux_loss_coeff": 0.1,
    }
    ref = train(load_config(small_job_args(corpus_cache, tmp_path / "ref", **quick)))
    losses = run_ranks(
        _rank_losses,
        2,
        small_job_args(corpus_cache, tmp_path / "pp2", **quick, **{"parallel.pp": 2}),
        timeout=300,
    )
    for got in losses:
        assert got == pytest.approx(ref.losses, rel=1e-6)
    ref_rows = [
        _moe_keys(r) for r in read_metrics(tmp_path / "ref" / "metrics.jsonl") if "loss" in r
    ]
    rows = [_moe_keys(r) for r in read_metrics(tmp_path / "pp2" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 3 and set(rows[0]) == set(ref_rows[0]) and "moe/layer0/dropped" in rows[0]
    for got, want in zip(rows, ref_rows):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-9)


# ----------------------------------------------------------------------------- the CLI end to end
@pytest.mark.e2e
def test_moe_tiny_config_trains_from_the_command_line(corpus_cache, tmp_path):
    """deploy/configs/moe-tiny.toml as shipped (on the test corpus, byte-level, for speed): the
    loss falls over 12 steps and every logged row holds the routers' statistics."""
    run = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "train",
            "--config",
            str(REPO / "deploy" / "configs" / "moe-tiny.toml"),
            "--train-iters",
            "12",
            "--eval-interval",
            "12",
            "--lr-warmup-iters",
            "2",
            "--log-interval",
            "1",
            "--data.tokenizer=byte",
            f"--data.cache_dir={corpus_cache}",
            "--data.default_corpus_bytes=400000",
            "--data.split=80,20,0",
            "--log.plot=false",
            "--run-dir",
            str(run),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "active: top-2 of 8 experts" in proc.stderr
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 13))
    expected = {
        f"moe/layer{i}/{what}"
        for i in range(4)
        for what in ("tokens_per_expert_max_over_mean", "dropped")
    }
    for r in rows:
        assert set(_moe_keys(r)) == expected | {"moe/aux_loss", "moe/z_loss"}
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
