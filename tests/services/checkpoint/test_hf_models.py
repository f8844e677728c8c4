"""Hugging Face Llama 3 (RoPE scaling), Mistral, Qwen2 and Qwen3, verified against `transformers`.

As in test_hf.py: small random meshtrain models are exported and loaded by transformers, small
random transformers models are imported and restored into meshtrain's GPT, and the logits of
both sides compared on the same tokens (fp32; 1e-4 absolute covers summation-order differences
on logits of size ~10, where a wrong head order, bias or norm is O(1)); HF -> meshtrain -> HF
round trips must give bit-identical tensors.
"""

import dataclasses
import json

import pytest
import torch

from meshtrain.services.checkpoint.hf.convert import export_hf, import_hf
from meshtrain.services.checkpoint.hf.mapping import model_from_hf
from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.common.errors import CheckpointError, ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer import checkpoint_restore
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from tests.services.checkpoint.test_hf import (
    LLAMA,
    meshtrain_logits,
    random_model,
    save_random_hf,
    save_training_checkpoint,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# original_max_positions 16 < seq 32, so the scaled frequencies differ from plain ones
# where it shows
LLAMA3 = {**LLAMA, "rope_scaling_factor": 8.0, "rope_scaling_original_max_positions": 16}
QWEN2 = {**LLAMA, "qkv_bias": True, "untie_embeddings_and_output_weights": False}
QWEN3 = {**LLAMA, "qk_norm": True, "kv_channels": 24}
TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))


def hf_logits(folder, tokens=TOKENS) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize(
    "settings, arch, cls",
    [
        (LLAMA3, None, "LlamaForCausalLM"),
        (LLAMA, "mistral", "MistralForCausalLM"),
        (QWEN2, None, "Qwen2ForCausalLM"),
        (
            {**QWEN2, "kv_channels": 24, "untie_embeddings_and_output_weights": True},
            None,
            "Qwen2ForCausalLM",
        ),
        (QWEN3, None, "Qwen3ForCausalLM"),
        (
            {**QWEN3, "rope_scaling_factor": 4.0, "rope_scaling_original_max_positions": 8},
            None,
            "Qwen3ForCausalLM",
        ),
    ],
    ids=[
        "llama3-rope-scaling",
        "mistral",
        "qwen2-tied",
        "qwen2-head-dim",
        "qwen3",
        "qwen3-rope-scaling",
    ],
)
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, settings, arch, cls):
    model = random_model(settings)
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model)
    export_hf(root, str(tmp_path / "hf"), arch=arch)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [cls]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    )
    assert type(hf).__name__ == cls
    theirs, ours = hf_logits(tmp_path / "hf"), meshtrain_logits(model, TOKENS)
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_rope_scaling_changes_the_function():
    """Else the llama3 cases above would pass with the scaling ignored on both sides: the same
    weights move the logits by far more than the 1e-4 those cases allow."""
    scaled, plain = random_model(LLAMA3), random_model(LLAMA)
    plain.load_state_dict(scaled.state_dict())
    assert (meshtrain_logits(scaled, TOKENS) - meshtrain_logits(plain, TOKENS)).abs().max() > 0.01


def hf_llama3(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    return save_random_hf(transformers.LlamaForCausalLM, config, tmp_path)[0]


def hf_mistral(tmp_path, sliding_window=None):
    config = transformers.MistralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        sliding_window=sliding_window,
        tie_word_embeddings=False,
    )
    return save_random_hf(transformers.MistralForCausalLM, config, tmp_path)[0]


def hf_qwen2(tmp_path, **extra):
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        **{"tie_word_embeddings": True, **extra},
    )
    return save_random_hf(transformers.Qwen2ForCausalLM, config, tmp_path)[0]


def hf_qwen3(tmp_path, **extra):
    config = transformers.Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=32,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        **{"tie_word_embeddings": False, **extra},
    )
    return save_random_hf(transformers.Qwen3ForCausalLM, config, tmp_path)[0]


def restored(root: str) -> GPT:
    model = GPT(ModelConfig(**read_manifest(root, 0)["metadata"]["config"]["model"]))
    checkpoint_restore.restore(root, model, None, Parallel(Mesh.single()))
    return model


@pytest.mark.parametrize(
    "make, expect",
    [
        (
            hf_llama3,
            {
                "rope_scaling_factor": 8.0,
                "rope_scaling_original_max_positions": 16,
                "rotary_base": 5000.0,
            },
        ),
        (hf_mistral, {"qkv_bias": False, "add_bias_linear": False}),
        (
            lambda p: hf_mistral(p, sliding_window=32),
            {"seq_length": 32},
        ),  # the window covers the sequence
        (hf_qwen2, {"qkv_bias": True, "untie_embeddings_and_output_weights": False}),
        (hf_qwen3, {"qk_norm": True, "kv_channels": 24, "qkv_bias": False}),
    ],
    ids=["llama3", "mistral", "mistral-window-covers", "qwen2-tied", "qwen3"],
)
def test_import_gives_transformers_logits_and_round_trips_bit_exact(tmp_path, make, expect):
    src = make(tmp_path)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    meta = read_manifest(root, 0)["metadata"]
    config = ModelConfig(**meta["config"]["model"])
    assert {k: getattr(config, k) for k in expect} == expect
    torch.testing.assert_close(
        meshtrain_logits(restored(root), TOKENS), hf_logits(src), atol=1e-4, rtol=1e-4
    )
    export_hf(root, str(tmp_path / "back"))
    before = safetensors_torch.load_file(str(src / "model.safetensors"))
    after = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    original = json.loads((src / "config.json").read_text())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["model_type"] == original["model_type"] == meta["imported_from"]["architecture"]


def test_an_import_at_a_shorter_sequence_keeps_the_models_context_for_its_export(tmp_path):
    """Llama 3.1 (131072 positions) is imported to train at 8192; its export must still say
    131072 (transformers warns when the rope scaling's original length is not below it)."""
    src = hf_llama3(tmp_path)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root, seq_length=16)
    model = restored(root)
    assert (model.config.seq_length, model.config.max_position_embeddings) == (16, 32)
    tokens = TOKENS[:, :16]
    torch.testing.assert_close(
        meshtrain_logits(model, tokens), hf_logits(src, tokens), atol=1e-4, rtol=1e-4
    )
    export_hf(root, str(tmp_path / "back"))
    assert (
        json.loads((tmp_path / "back" / "config.json").read_text())["max_position_embeddings"] == 32
    )
    import_hf(
        str(src), str(tmp_path / "longer"), seq_length=64
    )  # beyond it: the context grows with it
    assert restored(str(tmp_path / "longer")).config.max_position_embeddings is None


def test_a_sliding_window_shorter_than_the_sequence_is_refused_unless_the_sequence_fits_in_it(
    tmp_path,
):
    src = hf_mistral(tmp_path, sliding_window=16)
    with pytest.raises(
        CheckpointError, match=r"sliding_window=16 .* sequence length of 32 .*--seq-length 16"
    ):
        import_hf(str(src), str(tmp_path / "a"))
    root = str(tmp_path / "b")
    import_hf(str(src), root, seq_length=16)
    model = restored(root)
    assert model.config.seq_length == 16
    # the window is kept for the export, with the model's own context: the export is the source
    assert (model.config.max_position_embeddings, model.config.hf_sliding_window) == (32, 16)
    export_hf(root, str(tmp_path / "back"))
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["max_position_embeddings"], back["sliding_window"]) == (32, 16)
    # 16 tokens inside a 16-token window: HF masks nothing either
    tokens = TOKENS[:, :16]
    torch.testing.assert_close(
        meshtrain_logits(model, tokens), hf_logits(src, tokens), atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        meshtrain_logits(model, tokens), hf_logits(tmp_path / "back", tokens), atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ConfigError, match="hf_sliding_window=16 is shorter than .*seq_length=32"):
        dataclasses.replace(model.config, seq_length=32)
    with pytest.raises(CheckpointError, match="sequence length 0 is not a positive integer"):
        import_hf(str(src), str(tmp_path / "c"), seq_length=0)


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0}},
            "rope_type 'yarn'",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0}},
            "llama3 rope scaling low_freq_factor=None is not a number",
        ),
        (
            {"model_type": "qwen3", "attention_bias": True},
            "attention_bias=True .* also biases o_proj",
        ),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention"] * 2,
            },
            "sliding_window=8",
        ),
        ({"head_dim": "24"}, "head_dim='24' is not a positive integer"),
    ],
)
def test_import_refuses_what_meshtrain_cannot_express(change, match):
    config = transformers.Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=32,
    ).to_dict()
    config["model_type"] = "llama"
    with pytest.raises(CheckpointError, match=match):
        model_from_hf({**config, **change})


def test_qwen2_sliding_window_on_no_layer_is_accepted():
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=2,
    ).to_dict()
    assert config["layer_types"] == ["full_attention"] * 2
    assert model_from_hf(config).qkv_bias


@pytest.mark.parametrize(
    "settings, arch, match",
    [
        (LLAMA, "qwen3", "Qwen3ForCausalLM: model.qk_norm=false"),
        (LLAMA, "qwen2", "Qwen2ForCausalLM: model.qkv_bias=false"),
        ({**LLAMA, "add_bias_linear": True}, "mistral", "Mistral has no linear biases"),
        (QWEN3, "llama", "LlamaForCausalLM: model.qk_norm=true"),
        (QWEN2, "mistral", "q/k/v alone"),
        ({**QWEN3, "qkv_bias": True}, None, "Qwen3's attention_bias biases q, k, v and o"),
        (LLAMA, "gpt2", "not one a dense rmsnorm\\+swiglu\\+rope model exports as"),
    ],
)
def test_export_refuses_an_architecture_that_cannot_compute_the_model(
    tmp_path, settings, arch, match
):
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, random_model(settings))
    with pytest.raises(CheckpointError, match=match):
        export_hf(root, str(tmp_path / "hf"), arch=arch)
    assert not (tmp_path / "hf").exists()


# config.json of published models (their weights are not needed to check the mapping)
LLAMA31_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
}
QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 21,
    "tie_word_embeddings": True,
}
QWEN3_06B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    "config, seq, expect, total, non_embedding",
    [
        (
            LLAMA31_8B,
            8192,
            {
                "rope_scaling_factor": 8.0,
                "rope_scaling_original_max_positions": 8192,
                "rotary_base": 500000.0,
                "kv_channels": None,
            },
            8_030_261_248,
            None,
        ),
        (MISTRAL_7B, 4096, {"seq_length": 4096, "qkv_bias": False}, 7_241_732_096, None),
        (
            QWEN25_05B,
            1024,
            {
                "qkv_bias": True,
                "add_bias_linear": False,
                "untie_embeddings_and_output_weights": False,
            },
            0.49e9,
            0.36e9,
        ),
        (
            QWEN3_06B,
            2048,
            {"qk_norm": True, "kv_channels": 128, "num_query_groups": 8},
            0.6e9,
            0.44e9,
        ),
    ],
    ids=["llama-3.1-8b", "mistral-7b-v0.1", "qwen2.5-0.5b", "qwen3-0.6b"],
)
def test_published_configs_map_to_models_of_their_size(config, seq, expect, total, non_embedding):
    """The parameter counts of the published weights (Llama and Mistral: their safetensors' exact
    count; Qwen: the model cards' two-digit figures, total and non-embedding, to 1%): every
    shape the settings imply (Qwen3's 128-wide heads in a 1024-wide model, Qwen2's q/k/v
    biases) is right."""
    model = model_from_hf(config, seq_length=seq)
    assert {k: getattr(model, k) for k in expect} == expect
    with torch.device("meta"):
        built = GPT(model)
    if non_embedding is None:
        assert built.num_parameters() == total
    else:
        assert built.num_parameters() == pytest.approx(total, rel=0.01)
        assert built.num_parameters(exclude_embeddings=True) == pytest.approx(
            non_embedding, rel=0.01
        )


def test_mistral_7b_at_its_full_length_is_refused_for_its_window():
    with pytest.raises(
        CheckpointError,
        match=r"sliding_window=4096 .* sequence length of 32768 .*--seq-length 4096",
    ):
        model_from_hf(MISTRAL_7B)
