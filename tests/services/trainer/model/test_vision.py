"""The vision encoder, projector and merge on one device: placeholders take the image features
in reading order, other image sizes interpolate the positions as transformers does, freezing
marks the right parts, and bad input is refused by name."""

import pytest
import torch

from meshtrain.services.common.config import build
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig, VisionConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.model.vision import VisionEncoder, freeze, merge_image_features

VISION = dict(
    image_size=8,
    patch_size=4,
    hidden_size=24,
    num_layers=3,
    num_attention_heads=4,
    ffn_hidden_size=48,
    image_token_id=5,
)


def model(**vision) -> GPT:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=50,
        seq_length=24,
        hidden_size=32,
        num_layers=2,
        vision=VisionConfig(**{**VISION, **vision}),
    )
    return GPT(config)


def test_placeholders_take_the_features_in_reading_order():
    embeds = torch.zeros(2, 6, 3)
    tokens = torch.tensor([[1, 5, 5, 2, 5, 5], [5, 5, 3, 3, 3, 3]])
    feats = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3)  # 3 images of 2 tokens
    out = merge_image_features(embeds, tokens, feats, 5)
    assert torch.equal(out[0, 1:3], feats[0]) and torch.equal(out[0, 4:6], feats[1])
    assert torch.equal(out[1, 0:2], feats[2]) and not out[0, 0].any()
    with pytest.raises(ValueError, match="6 image placeholder tokens .* for 2 images of 2"):
        merge_image_features(embeds, tokens, feats[:2], 5)


def test_images_change_only_what_follows_them_and_samples_without_images_work():
    m = model().eval()
    tokens = torch.randint(6, 50, (2, 24))
    tokens[0, 4:8] = 5  # one image in the first sample, none in the second
    images = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        a = m(tokens, images=images)
        b = m(tokens, images=images * 2)
    assert torch.equal(a[:, :4], b[:, :4]) and torch.equal(a[1], b[1])  # causal; other sample
    assert not torch.allclose(a[0, 4:], b[0, 4:])
    text = GPT(ModelConfig(vocab_size=50, seq_length=24, hidden_size=32, num_layers=2))
    with pytest.raises(ValueError, match="text-only"):
        text(tokens, images=images)


def test_other_image_sizes_interpolate_the_positions_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.CLIPVisionModel(
        transformers.CLIPVisionConfig(
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=8,
            patch_size=4,
        )
    ).eval()
    enc = VisionEncoder(VisionConfig(**{**VISION, "select_layer": -1}))
    sd = {k.removeprefix("vision_model."): t for k, t in hf.state_dict().items()}
    with torch.no_grad():
        enc.patch_embedding.weight.copy_(sd["embeddings.patch_embedding.weight"])
        enc.class_embedding.copy_(sd["embeddings.class_embedding"])
        enc.position_embeddings.weight.copy_(sd["embeddings.position_embedding.weight"])
        enc.pre_norm.load_state_dict(
            {"weight": sd["pre_layrnorm.weight"], "bias": sd["pre_layrnorm.bias"]}
        )
        for i, layer in enumerate(enc.layers):
            p = f"encoder.layers.{i}."
            q, k, v = (sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
            qb, kb, vb = (sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
            d = 6
            layer.attention.qkv.weight.copy_(
                torch.stack([q.view(4, d, 24), k.view(4, d, 24), v.view(4, d, 24)], 1).reshape(
                    72, 24
                )
            )
            layer.attention.qkv.bias.copy_(
                torch.stack([qb.view(4, d), kb.view(4, d), vb.view(4, d)], 1).reshape(72)
            )
            layer.attention.proj.weight.copy_(sd[p + "self_attn.out_proj.weight"])
            layer.attention.proj.bias.copy_(sd[p + "self_attn.out_proj.bias"])
            for ours, theirs in (("input_norm", "layer_norm1"), ("pre_mlp_norm", "layer_norm2")):
                getattr(layer, ours).weight.copy_(sd[p + theirs + ".weight"])
                getattr(layer, ours).bias.copy_(sd[p + theirs + ".bias"])
            for fc in ("fc1", "fc2"):
                getattr(layer.mlp, fc).weight.copy_(sd[p + f"mlp.{fc}.weight"])
                getattr(layer.mlp, fc).bias.copy_(sd[p + f"mlp.{fc}.bias"])
        images = torch.randn(2, 3, 16, 16)  # a 4x4 grid for a 2x2 table
        theirs = hf(pixel_values=images, interpolate_pos_encoding=True, output_hidden_states=True)
        ours = enc(images)
    assert ours.shape == (2, 16, 24)
    torch.testing.assert_close(ours, theirs.hidden_states[-1][:, 1:], atol=1e-5, rtol=1e-5)
    assert enc(torch.randn(1, 3, 12, 8)).shape == (1, 6, 24)  # not square either
    with pytest.raises(ValueError, match="multiples of model.vision.patch_size=4"):
        enc(torch.randn(1, 3, 10, 8))


def test_freeze_marks_the_parts_and_the_blocks_never_run():
    m = model()
    freeze(m, vision=False, projector=False, language_model=True)
    trained = {n for n, p in m.named_parameters() if p.requires_grad}
    assert all(n.startswith(("vision.", "projector.")) for n in trained)
    assert "vision.layers.1.mlp.fc1.weight" in trained
    assert "vision.layers.2.mlp.fc1.weight" not in trained  # select_layer -2 of 3: 2 run
    assert "vision.post_norm.weight" not in trained
    m2 = model(select_layer=0)  # the embeddings alone
    freeze(m2)
    assert not any(p.requires_grad for n, p in m2.named_parameters() if "vision.layers" in n)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"variant": "siglip", "select_feature": "cls_patch"}, "only the 'clip' variant"),
        ({"image_size": 10}, "multiple of model.vision.patch_size"),
        ({"select_layer": -5}, "select_layer=-5 is outside"),
        ({"num_attention_heads": 5}, "divisible by model.vision.num_attention_heads"),
    ],
)
def test_bad_vision_settings_are_refused_by_name(table, message):
    with pytest.raises(ConfigError, match=message):
        build(ModelConfig, {"vision": {**VISION, **table}}, "model.")


def test_the_placeholder_must_be_a_token_of_the_vocabulary():
    with pytest.raises(ConfigError, match="image_token_id=60 is outside the vocabulary of 50"):
        build(ModelConfig, {"vocab_size": 50, "vision": {**VISION, "image_token_id": 60}})
