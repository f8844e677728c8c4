"""Hugging Face LlavaForConditionalGeneration and CLIP / SigLIP vision towers, verified against
`transformers`: a small random LLaVA imports with the same logits on the same image and text
(fp32, 1e-4) and exports back bit-exact; a meshtrain vision-language model exports to a folder
transformers loads with the same logits; a tower alone joins a language model's import."""

import json

import pytest
import torch

from meshtrain.services.checkpoint.hf.convert import export_hf, import_hf
from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.cli import main
from meshtrain.services.common.config import build
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer import checkpoint_restore
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from tests.services.checkpoint.test_hf import save_random_hf, save_training_checkpoint

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

IMAGE_TOKEN = 7


def text_config(**extra):
    return transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        **extra,
    )


def clip_config():
    return transformers.CLIPVisionConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=8,
        patch_size=4,
    )


def siglip_config():
    return transformers.SiglipVisionConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=8,
        patch_size=4,
    )


def llava_config(vision, strategy="default", layer=-2, tie=False):
    return transformers.LlavaConfig(
        vision_config=vision,
        text_config=text_config(tie_word_embeddings=tie),
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        image_seq_length=4 + (strategy == "full" and vision.model_type == "clip_vision_model"),
        tie_word_embeddings=tie,
    )


def inputs(per_image: int, seed: int = 1):
    """Two samples: two images in the first, none in the second; and the pixels."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 300, (2, 24), generator=g)
    tokens[0, 2 : 2 + per_image] = IMAGE_TOKEN
    tokens[0, 12 : 12 + per_image] = IMAGE_TOKEN
    return tokens, torch.randn(2, 3, 8, 8, generator=g)


def restored(root: str) -> GPT:
    config = build(ModelConfig, read_manifest(root, 0)["metadata"]["config"]["model"], "model.")
    model = GPT(config)
    checkpoint_restore.restore(root, model, None, Parallel(Mesh.single()))
    return model.eval()


def hf_logits(folder, tokens, images):
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return hf(input_ids=tokens, pixel_values=images).logits


@pytest.mark.parametrize(
    "vision, strategy, layer, tie",
    [
        (clip_config, "default", -2, False),
        (clip_config, "full", 1, True),
        (siglip_config, "full", -1, False),
    ],
    ids=["clip-patch-untied", "clip-cls-layer1-tied", "siglip"],
)
def test_llava_imports_with_transformers_logits_and_round_trips_bit_exact(
    tmp_path, vision, strategy, layer, tie
):
    src, hf = save_random_hf(
        transformers.LlavaForConditionalGeneration,
        llava_config(vision(), strategy, layer, tie),
        tmp_path,
    )
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    model = restored(root)
    v = model.config.vision
    assert (v.select_layer, v.image_token_id) == (layer, IMAGE_TOKEN)
    tokens, images = inputs(v.tokens_per_image)
    with torch.no_grad():
        ours = model(tokens, images=images)
        theirs = hf.eval()(input_ids=tokens, pixel_values=images).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # the images matter: other pixels, other logits
    with torch.no_grad():
        assert not torch.allclose(model(tokens, images=images + 1.0), ours, atol=1e-3)

    export_hf(root, str(tmp_path / "back"))
    before = safetensors_torch.load_file(str(src / "model.safetensors"))
    after = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    if tie:
        before.pop("language_model.lm_head.weight", None)
    before = {k: t for k, t in before.items() if not k.startswith("vision_tower.head.")}
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["model_type"] == "llava"
    torch.testing.assert_close(hf_logits(tmp_path / "back", tokens, images), theirs)


def test_a_meshtrain_vision_language_model_exports_to_transformers(tmp_path):
    settings = dict(
        vocab_size=300,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        seq_length=32,
        normalization="rmsnorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )
    vision = build(
        ModelConfig,
        {
            **settings,
            "vision": {
                "image_size": 8,
                "patch_size": 4,
                "hidden_size": 24,
                "num_layers": 2,
                "num_attention_heads": 4,
                "ffn_hidden_size": 48,
                "image_token_id": IMAGE_TOKEN,
            },
        },
    )
    torch.manual_seed(0)
    model = GPT(vision)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    save_training_checkpoint(str(tmp_path / "ckpt"), model)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    tokens, images = inputs(4)
    with torch.no_grad():
        ours = model.eval()(tokens, images=images)
    torch.testing.assert_close(
        hf_logits(tmp_path / "hf", tokens, images), ours, atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_a_vision_tower_alone_joins_a_language_models_import(tmp_path, tower):
    cls, config = {
        "clip": (transformers.CLIPVisionModel, clip_config()),
        "siglip": (transformers.SiglipVisionModel, siglip_config()),
    }[tower]
    tower_dir, hf_tower = save_random_hf(cls, config, tmp_path / "tower")
    lm_dir, hf_lm = save_random_hf(transformers.LlamaForCausalLM, text_config(), tmp_path / "lm")
    root = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="image_token_id"):
        import_hf(str(lm_dir), root, vision_tower=str(tower_dir))
    if tower == "clip":
        import_hf(
            str(lm_dir), root, vision_tower=str(tower_dir), vision={"image_token_id": IMAGE_TOKEN}
        )
    else:  # as a user types it
        argv = ["ckpt", "import", "--format", "hf", str(lm_dir), root]
        argv += ["--vision-tower", str(tower_dir), "--image-token-id", str(IMAGE_TOKEN)]
        assert main(argv) == 0
    model = restored(root)
    assert model.config.vision.variant == tower and model.config.hf_model_type == "llava"
    images = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        states = hf_tower.eval()(pixel_values=images, output_hidden_states=True).hidden_states
        feats = model.vision(images)
        text = torch.randint(10, 300, (2, 16))
        torch.testing.assert_close(model(text), hf_lm.eval()(text).logits, atol=1e-4, rtol=1e-4)
    want = states[-2][:, 1:] if tower == "clip" else states[-2]
    torch.testing.assert_close(feats, want, atol=1e-5, rtol=1e-5)
    # the new projector is initialized, and the whole exports as a LLaVA transformers loads
    assert model.projector.fc1.weight.std() > 0
    export_hf(root, str(tmp_path / "back"))
    tokens, pixels = inputs(4)
    with torch.no_grad():
        ours = model(tokens, images=pixels)
    torch.testing.assert_close(
        hf_logits(tmp_path / "back", tokens, pixels), ours, atol=1e-4, rtol=1e-4
    )
