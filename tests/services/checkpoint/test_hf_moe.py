"""Hugging Face export/import of mixture-of-experts models, verified against `transformers`.

Small random meshtrain MoE models are exported and loaded as `MixtralForCausalLM` or (with a
gated shared expert) `Qwen2MoeForCausalLM`, and small random HF models of both are imported into
meshtrain's `GPT`; in both directions the logits on
the same tokens must agree. fp32 throughout: 1e-4 absolute covers summation-order differences
between the two attention and expert implementations on logits of size ~10, where a wrong expert
order or a swapped gate/up half is O(1). Random weights of scale 0.2 make the router's top-k
choices far from ties, so both sides pick the same experts.
"""

import json

import pytest
import torch

from meshtrain.services.checkpoint.hf.convert import export_hf, import_hf
from meshtrain.services.checkpoint.hf.mapping import model_from_hf
from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer import checkpoint_restore, checkpointing
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.optim.optimizer import build_optimizer
from meshtrain.services.trainer.parallel.mesh import Mesh
from tests.services.checkpoint.test_hf import meshtrain_logits as logits
from tests.services.checkpoint.test_hf import random_model, save_random_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MIXTRAL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 96,
    "seq_length": 32,
    "vocab_size": 300,
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "position_embedding_type": "rope",
    "rotary_base": 5000.0,
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "norm_epsilon": 1e-6,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 48,
    "moe_aux_loss_coeff": 0.02,
}


def hf_mixtral(tmp_path, dtype=torch.float32, tie=False, **extra):
    config = transformers.MixtralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=tie,
        **extra,
    )
    return save_random_hf(transformers.MixtralForCausalLM, config, tmp_path, dtype)


@pytest.mark.parametrize(
    "settings",
    [
        MIXTRAL,
        {
            **MIXTRAL,
            "untie_embeddings_and_output_weights": False,
            "moe_router_topk": 1,
            "num_query_groups": 4,
        },
    ],
    ids=["untied-top2-gqa", "tied-top1"],
)
def test_export_loads_as_mixtral_with_the_same_logits(tmp_path, settings):
    model = random_model(settings)
    root = str(tmp_path / "ckpt")
    checkpointing.save_checkpoint(root, 5, model, None)
    dst = tmp_path / "hf"
    export_hf(root, str(dst))
    config = json.loads((dst / "config.json").read_text())
    assert (
        config["num_local_experts"] == 4
        and config["num_experts_per_tok"] == settings["moe_router_topk"]
    )
    assert config["router_aux_loss_coef"] == 0.02 and config["output_router_logits"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
    assert type(hf).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    hf.eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = logits(model, tokens)
    assert ours.abs().max() > 0.5  # the comparison is not between near-zero outputs
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_import_of_mixtral_gives_the_same_logits_and_restores_into_the_trainer(tmp_path):
    src, hf = hf_mixtral(tmp_path, output_router_logits=True, router_aux_loss_coef=0.03)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    meta = read_manifest(root, 0)["metadata"]
    assert meta["imported_from"]["architecture"] == "mixtral"
    config = ModelConfig(**meta["config"]["model"])
    assert (config.num_experts, config.moe_router_topk, config.moe_ffn_size) == (4, 2, 48)
    assert config.moe_aux_loss_coeff == 0.03 and not config.moe_router_pre_softmax
    model = GPT(config)
    optimizer = build_optimizer(model, JobConfig(model=config).optim)
    state, _ = checkpoint_restore.restore(root, model, optimizer, Parallel(Mesh.single()))
    assert state.iteration == 0
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    hf.eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = logits(model, tokens)
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "dtype, tie", [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16", "fp32-tied"]
)
def test_round_trip_mixtral_meshtrain_mixtral_is_bit_exact(tmp_path, dtype, tie):
    src, _ = hf_mixtral(tmp_path, dtype, tie)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    export_hf(root, str(tmp_path / "back"))
    before = safetensors_torch.load_file(str(src / "model.safetensors"))
    after = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in after
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize(
    "change, match",
    [
        ({"moe_layer_freq": 2}, r"moe_layer_freq=2 leaves blocks \[1\] dense"),
        (
            {"moe_shared_expert_intermediate_size": 32},
            "Qwen2MoeForCausalLM: .*moe_shared_expert_gate=false",
        ),
        ({"moe_router_pre_softmax": True}, "MixtralForCausalLM: model.moe_router_pre_softmax=true"),
        ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid'"),
        ({"moe_router_enable_expert_bias": True}, "no expert bias"),
        ({"moe_router_topk_scaling_factor": 2.5}, "moe_router_topk_scaling_factor=2.5"),
        ({"add_bias_linear": True}, "add_bias_linear=true"),
        ({"qkv_bias": True}, "MixtralForCausalLM: model.qkv_bias=true"),
        ({"qk_norm": True}, "model.qk_norm=true"),
        ({"normalization": "layernorm"}, "Mixtral and Qwen2-MoE are rmsnorm"),
    ],
)
def test_export_refuses_moe_models_hf_cannot_compute(tmp_path, change, match):
    model = random_model({**MIXTRAL, **change})
    root = str(tmp_path / "ckpt")
    checkpointing.save_checkpoint(root, 1, model, None)
    with pytest.raises(CheckpointError, match=match):
        export_hf(root, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"sliding_window": 16},
            r"sliding_window=16 cannot be expressed .* sequence length of 32 .*--seq-length 16",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_local_experts": 0}, "num_local_experts=0 is not a positive integer"),
        ({"router_aux_loss_coef": "big"}, "router_aux_loss_coef='big' is not a number"),
    ],
)
def test_import_refuses_moe_configs_meshtrain_cannot_express(change, match):
    config = transformers.MixtralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    ).to_dict()
    with pytest.raises(CheckpointError, match=match):
        model_from_hf({**config, **change})


def test_import_maps_the_router_settings():
    base = transformers.MixtralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_local_experts=8,
        num_experts_per_tok=3,
    ).to_dict()
    model = model_from_hf(
        {**base, "sliding_window": 32}
    )  # a window covering the sequence changes nothing
    assert (model.num_experts, model.moe_router_topk) == (8, 3)
    assert (
        model.moe_aux_loss_coeff == 0.0
    )  # output_router_logits false: HF adds no load-balancing loss
    assert (
        all(model.is_moe_layer(i) for i in range(2))
        and model.moe_shared_expert_intermediate_size is None
    )


QWEN = {
    **MIXTRAL,
    "num_layers": 3,
    "moe_layer_freq": [1, 0, 1],
    "moe_shared_expert_intermediate_size": 40,
    "moe_shared_expert_gate": True,
    "moe_router_pre_softmax": True,
}


def hf_qwen2_moe(tmp_path, dtype=torch.float32, **extra):
    config = transformers.Qwen2MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
        **{"qkv_bias": False, **extra},
    )
    return save_random_hf(transformers.Qwen2MoeForCausalLM, config, tmp_path, dtype)


@pytest.mark.parametrize(
    "settings",
    [QWEN, {**QWEN, "moe_router_pre_softmax": False, "moe_layer_freq": 1}],
    ids=["full-softmax-dense-block", "norm-topk"],
)
def test_export_with_a_gated_shared_expert_loads_as_qwen2_moe_with_the_same_logits(
    tmp_path, settings
):
    model = random_model(settings)
    root = str(tmp_path / "ckpt")
    checkpointing.save_checkpoint(root, 5, model, None)
    dst = tmp_path / "hf"
    export_hf(root, str(dst))
    config = json.loads((dst / "config.json").read_text())
    assert (
        config["norm_topk_prob"] is not settings["moe_router_pre_softmax"]
        and config["qkv_bias"] is False
    )
    assert config["mlp_only_layers"] == ([1] if settings["moe_layer_freq"] != 1 else [])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    hf.eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = logits(model, tokens)
    assert ours.abs().max() > 0.5
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_import_of_qwen2_moe_without_qkv_bias_gives_the_same_logits_and_round_trips(tmp_path):
    src, hf = hf_qwen2_moe(tmp_path)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    config = ModelConfig(**read_manifest(root, 0)["metadata"]["config"]["model"])
    assert config.moe_layer_freq == [1, 0, 1] and config.moe_router_pre_softmax
    assert (config.moe_shared_expert_intermediate_size, config.ffn_size, config.moe_ffn_size) == (
        40,
        96,
        48,
    )
    model = GPT(config)
    checkpoint_restore.restore(root, model, None, Parallel(Mesh.single()))
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    hf.eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    torch.testing.assert_close(logits(model, tokens), theirs, atol=1e-4, rtol=1e-4)
    export_hf(root, str(tmp_path / "back"))
    before = safetensors_torch.load_file(str(src / "model.safetensors"))
    after = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_qwen2_moe_with_qkv_bias_imports_exports_and_keeps_transformers_logits(tmp_path):
    """Published Qwen2-MoE models bias q/k/v only (qkv_bias, the HF default): model.qkv_bias."""
    src, hf = hf_qwen2_moe(tmp_path, qkv_bias=True)
    assert hf.model.layers[0].self_attn.q_proj.bias is not None
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    config = ModelConfig(**read_manifest(root, 0)["metadata"]["config"]["model"])
    assert config.qkv_bias and not config.add_bias_linear
    model = GPT(config)
    checkpoint_restore.restore(root, model, None, Parallel(Mesh.single()))
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            logits(model, tokens), hf.eval()(tokens).logits, atol=1e-4, rtol=1e-4
        )
    export_hf(root, str(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "config.json").read_text())["qkv_bias"] is True
    before = safetensors_torch.load_file(str(src / "model.safetensors"))
    after = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(before) == sorted(after) and all(
        torch.equal(after[n], t) for n, t in before.items()
    )
