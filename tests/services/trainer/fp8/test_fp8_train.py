"""FP8 in the trainer: which layers it takes, what it refuses, Megatron's flags, training that
follows bf16, and checkpoints that load across FP8 and bf16 runs."""

import pytest
import torch
from torch import nn

from meshtrain.services.checkpoint.reader import load_checkpoint
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.fp8 import Fp8Linear, Recipe, apply_fp8
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.train import Trainer, train
from tests.services.trainer.conftest import small_job_args

LLAMA = {
    "model.normalization": "rmsnorm",
    "model.activation": "swiglu",
    "model.position_embedding_type": "rope",
    "model.num_query_groups": 2,
    "model.add_bias_linear": False,
    "model.untie_embeddings_and_output_weights": True,
}
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=300)


def _fp8_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Fp8Linear)]


def test_the_blocks_dense_linears_go_fp8_and_nothing_else():
    model = GPT(ModelConfig(**MODEL, untie_embeddings_and_output_weights=True))
    keys = set(model.state_dict())
    handle = apply_fp8(model, Recipe(), Mesh.single())
    want = [
        f"layers.{i}.{sub}"
        for i in range(4)
        for sub in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")
    ]
    assert _fp8_layers(model) == want == handle.layers
    assert type(model.output_layer) is nn.Linear  # the output layer stays bf16
    assert set(model.state_dict()) == keys  # checkpoints see the same parameters
    assert handle.delayed is None


def test_first_and_last_blocks_can_stay_bf16_and_odd_shapes_do():
    model = GPT(ModelConfig(**MODEL))
    apply_fp8(model, Recipe(), Mesh.single(), bf16_layers_at_start=1, bf16_layers_at_end=2)
    assert {n.split(".")[1] for n in _fp8_layers(model)} == {"1"}
    odd = GPT(
        ModelConfig(**dict(MODEL, hidden_size=72, num_attention_heads=4))
    )  # 72 is not a multiple of 16
    assert apply_fp8(odd, Recipe(), Mesh.single()) is None and not _fp8_layers(odd)
    with pytest.raises(ConfigError, match="leave none of the model's 4 blocks"):
        apply_fp8(GPT(ModelConfig(**MODEL)), Recipe(), Mesh.single(), 2, 2)


def test_mixture_of_experts_blocks_keep_their_experts_in_bf16():
    model = GPT(
        ModelConfig(**MODEL, num_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0, 1, 0])
    )
    apply_fp8(model, Recipe("hybrid", "delayed"), Mesh.single())
    names = _fp8_layers(model)
    assert "layers.0.attention.qkv" in names and "layers.1.mlp.fc1" in names
    assert not any(n.startswith("layers.0.mlp") or n.startswith("layers.2.mlp") for n in names)


def test_megatron_fp8_flags_map_to_the_train_keys():
    job = load_config(
        [
            "--bf16",
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "delayed",
            "--fp8-amax-history-len",
            "16",
            "--fp8-amax-compute-algo",
            "most_recent",
            "--fp8-margin",
            "1",
            "--first-last-layers-bf16",
            "--num-layers-at-start-in-bf16",
            "2",
            "--num-layers-at-end-in-bf16",
            "0",
        ]
    )
    t = job.train
    assert (t.fp8, t.fp8_recipe, t.fp8_amax_history_len, t.fp8_amax_compute_algo, t.fp8_margin) == (
        "hybrid",
        "delayed",
        16,
        "most_recent",
        1,
    )
    assert (t.fp8_bf16_first_last, t.fp8_bf16_layers_at_start, t.fp8_bf16_layers_at_end) == (
        True,
        2,
        0,
    )
    with pytest.raises(ConfigError, match="--fp8-param-gather"):
        load_config(["--bf16", "--fp8-format", "hybrid", "--fp8-param-gather"])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--train.fp8=hybrid"], "needs train.bf16=true"),
        (["--bf16", "--train.fp8=hybrid", "--train.fp8_recipe=rowwise"], "set train.fp8='e4m3'"),
        (["--bf16", "--train.fp8=e5m2"], "train.fp8"),
        (["--bf16", "--train.fp8=hybrid", "--train.fp8_recipe=mxfp8"], "fp8_recipe"),
        (
            ["--bf16", "--train.fp8=hybrid", "--train.fp8_amax_history_len=0"],
            "fp8_amax_history_len must be >= 1",
        ),
        (
            [
                "--bf16",
                "--train.fp8=hybrid",
                "--parallel.tp=2",
                "--parallel.sequence_parallel=true",
                "--parallel.tp_comm_overlap=true",
            ],
            "tp_comm_overlap",
        ),
        (
            [
                "--bf16",
                "--train.fp8=hybrid",
                "--parallel.pp=2",
                "--parallel.pipeline_schedule=zb-h1",
            ],
            "zb-h1",
        ),
        (
            [
                "--bf16",
                "--train.fp8=hybrid",
                "--train.fp8_recipe=delayed",
                "--train.cuda_graph=true",
                "--train.device=cuda",
            ],
            "CUDA graph",
        ),
    ],
)
def test_what_fp8_does_not_combine_with_is_refused_by_name(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)


def _losses(result) -> list[float]:
    return [result.losses[s] for s in sorted(result.losses)]


@pytest.mark.parametrize(
    "recipe,fmt", [("tensorwise", "hybrid"), ("delayed", "hybrid"), ("rowwise", "e4m3")]
)
@pytest.mark.e2e
def test_fp8_training_follows_bf16(recipe, fmt, corpus_cache, tmp_path):
    """A Llama-style model, bf16 weight copies with fused accumulation: within 1% of bf16 at
    every one of 12 steps, and learning."""
    common = dict(
        LLAMA,
        **{
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 12,
            "train.gradient_accumulation_fusion": True,
        },
    )
    bf16 = train(load_config(small_job_args(corpus_cache, tmp_path / "bf16", **common)))
    fp8 = train(
        load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "fp8",
                **common,
                **{"train.fp8": fmt, "train.fp8_recipe": recipe},
            )
        )
    )
    assert fp8.losses[12] < fp8.losses[1] - 0.5
    assert _losses(fp8) == pytest.approx(_losses(bf16), rel=1e-2)
    assert _losses(fp8) != _losses(bf16)  # FP8 really ran


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_recompute_reruns_the_same_fp8_forward(recipe, corpus_cache, tmp_path):
    """Full recompute: the second forward (on the fp32 weights, after the copies are put back)
    casts the same FP8 values, and records no new amax (the max is idempotent): losses equal
    the run without recompute exactly."""
    common = dict(
        LLAMA,
        **{
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 6,
            "train.fp8": "hybrid",
            "train.fp8_recipe": recipe,
            "train.gradient_accumulation_fusion": True,
        },
    )
    plain = train(load_config(small_job_args(corpus_cache, tmp_path / "plain", **common)))
    again = train(
        load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "again",
                **common,
                **{"parallel.recompute_granularity": "full"},
            )
        )
    )
    assert again.losses == plain.losses


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_weights_cast_once_a_step_train_as_weights_cast_in_every_layer_call(
    recipe, corpus_cache, tmp_path
):
    """Fp8WeightCache (with the bf16 weight copies) against no copies, where each layer casts
    its fp32 weight itself in every micro-batch: the same losses, exactly."""
    common = dict(
        LLAMA,
        **{
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 6,
            "train.fp8": "hybrid",
            "train.fp8_recipe": recipe,
        },
    )
    args = small_job_args(corpus_cache, tmp_path / "cached", **common)
    trainer = Trainer(load_config(args))
    assert trainer.fp8_weights is not None and len(trainer.fp8_weights.entries) == 3 * 4 * 2
    trainer.release_run_dir()
    cached = train(load_config(args))
    uncached = train(
        load_config(
            small_job_args(
                corpus_cache, tmp_path / "uncached", **common, **{"train.bf16_weight_copies": False}
            )
        )
    )
    assert cached.losses == uncached.losses


def test_checkpoints_load_across_fp8_and_bf16(corpus_cache, tmp_path):
    """An FP8 run's checkpoint resumes a bf16 run and the reverse: the same arrays, and the
    resumed run continues from the saved parameters."""
    common = dict(
        LLAMA,
        **{
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 4,
            "checkpoint.save_interval": 4,
        },
    )
    fp8 = train(
        load_config(
            small_job_args(corpus_cache, tmp_path / "fp8", **common, **{"train.fp8": "hybrid"})
        )
    )
    bf16 = train(load_config(small_job_args(corpus_cache, tmp_path / "bf16", **common)))
    fp8_arrays, _ = load_checkpoint(fp8.checkpoint.rsplit("/", 1)[0], 4)
    bf16_arrays, _ = load_checkpoint(bf16.checkpoint.rsplit("/", 1)[0], 4)
    assert set(fp8_arrays) == set(bf16_arrays)
    for saved, into, extra in ((fp8, "into-bf16", {}), (bf16, "into-fp8", {"train.fp8": "hybrid"})):
        args = small_job_args(
            corpus_cache,
            tmp_path / into,
            **dict(common, **{"train.train_iters": 6}),
            **extra,
            **{
                "checkpoint.load": saved.checkpoint.rsplit("/", 1)[0],
                "checkpoint.load_step": 4,
                "checkpoint.save": str(tmp_path / into / "ck"),
            },
        )
        trainer = Trainer(load_config(args))
        assert trainer.state.iteration == 4
        arrays = fp8_arrays if saved is fp8 else bf16_arrays
        for name, p in trainer.model.named_parameters():
            stored = arrays[name]  # the vocabulary's padding rows are not stored
            torch.testing.assert_close(
                p.detach().cpu()[: stored.shape[0]], stored, rtol=0, atol=0, msg=name
            )
        assert bool(trainer.fp8) == ("train.fp8" in extra)
        loss, _ = trainer.train_step(4)
        assert torch.isfinite(loss)
        trainer.release_run_dir()


@pytest.mark.slow  # the interpreter runs every cast of 8 steps
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fused_casts_train_as_the_unfused_casts(recipe, corpus_cache, tmp_path, monkeypatch):
    """train.fp8_fused_casts on (the Triton cast kernels, run by the CPU interpreter in place of
    the reference the dispatch picks off CUDA) against off: the same losses, exactly, through
    the weight cache, delayed scaling's later steps and the backward's casts."""
    from meshtrain.kernels import dispatch, fp8_cast

    common = dict(
        LLAMA,
        **{
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 4,
            "train.fp8": "hybrid",
            "train.fp8_recipe": recipe,
        },
    )
    off = train(
        load_config(
            small_job_args(
                corpus_cache, tmp_path / "off", **common, **{"train.fp8_fused_casts": False}
            )
        )
    )
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fp8_cast.fp8_cast_transpose(*args, **kwargs)

    monkeypatch.setattr(dispatch, "fp8_cast_transpose", counted)
    monkeypatch.setattr(dispatch, "fp8_amax", fp8_cast.fp8_amax)
    on = train(load_config(small_job_args(corpus_cache, tmp_path / "on", **common)))
    assert calls  # the kernels ran
    assert on.losses == off.losses
