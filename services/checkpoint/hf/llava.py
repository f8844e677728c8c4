"""Vision-language models <-> Hugging Face `LlavaForConditionalGeneration`, and CLIP / SigLIP
vision towers (`CLIPVisionModel`, `SiglipVisionModel`) alone, for `mapping.py` and `convert.py`.

A meshtrain model with `model.vision` is LLaVA: a CLIP (or SigLIP) tower, the two-layer GELU
projector and a Llama-family language model. Tensor names are those transformers 5 writes:

    language_model.model.* / language_model.lm_head.weight   the language model (llama.py's names)
    vision_tower.embeddings.{class_embedding, patch_embedding, position_embedding}
    vision_tower.pre_layrnorm, vision_tower.post_layernorm   (CLIP's pre-norm; both towers' post)
    vision_tower.encoder.layers.<i>.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2,
        mlp.fc1, mlp.fc2}
    multi_modal_projector.linear_1 / linear_2

Older files (`vision_tower.vision_model.*`, a tower saved alone as `vision_model.*`) and the
in-memory names (`model.language_model.*`, `lm_head.weight`) are read too. meshtrain fuses q/k/v
per head ([q_h; k_h; v_h] rows, so a tensor-parallel split keeps whole heads). The tower's
post-LayerNorm, which LLaVA's features never pass through, is kept (`vision.post_norm`, never
trained) so an export writes it back; SigLIP's attention-pooling head is not part of LLaVA and is
dropped when a SigLIP tower is imported.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtrain.services.checkpoint.hf.moe import Mapping
from meshtrain.services.common.config import build
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig, VisionConfig

TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
"""HF vision tower model_type -> meshtrain's model.vision.variant."""
_ACT = {"clip": "quick_gelu", "siglip": "gelu_pytorch_tanh"}
_SELECT = {"patch": "default", "cls_patch": "full"}
TOWER_PREFIX = "vision_tower."
SIGLIP_HEAD = "vision_tower.head."


def vision_from_hf(config: dict[str, Any], **choices: Any) -> VisionConfig:
    """The VisionConfig of a CLIP or SigLIP vision `config.json` (a LLaVA's vision_config, or a
    tower's own; a whole CLIPModel's vision part too). `choices`: model.vision keys the tower does
    not fix (select_layer, select_feature, projector, image_token_id, ...).

    Raises:
        CheckpointError: another tower, or a setting meshtrain computes otherwise; names it.
    """
    config = config.get("vision_config", config)
    kind = config.get("model_type")
    if kind not in TOWERS:
        raise CheckpointError(
            f"HF vision model_type {kind!r} is not supported; only {sorted(TOWERS)}"
        )
    variant = TOWERS[kind]
    act = config.get("hidden_act", _ACT[variant])
    if act != _ACT[variant]:
        raise CheckpointError(
            f"HF {kind} hidden_act={act!r} cannot be expressed in meshtrain (the {variant} "
            f"variant computes {_ACT[variant]!r})"
        )
    if config.get("num_channels", 3) != 3:
        raise CheckpointError(f"HF {kind} num_channels={config['num_channels']!r}: only 3 (RGB)")
    table = {
        "variant": variant,
        "image_size": config.get("image_size", 224),
        "patch_size": config.get("patch_size", 32 if variant == "clip" else 16),
        "hidden_size": config.get("hidden_size", 768),
        "num_layers": config.get("num_hidden_layers", 12),
        "num_attention_heads": config.get("num_attention_heads", 12),
        "ffn_hidden_size": config.get("intermediate_size", 3072),
        "norm_epsilon": float(config.get("layer_norm_eps", 1e-5 if variant == "clip" else 1e-6)),
        **choices,
    }
    try:
        return build(VisionConfig, table, "model.vision.")
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"HF vision config does not make a valid meshtrain encoder: {e}")


def vision_hf_config(v: VisionConfig) -> dict[str, Any]:
    """The HF vision_config of an encoder."""
    kind = {variant: k for k, variant in TOWERS.items()}[v.variant]
    out = {
        "model_type": kind,
        "hidden_size": v.hidden_size,
        "intermediate_size": v.ffn_hidden_size,
        "num_hidden_layers": v.num_layers,
        "num_attention_heads": v.num_attention_heads,
        "num_channels": 3,
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "hidden_act": _ACT[v.variant],
        "layer_norm_eps": v.norm_epsilon,
        "attention_dropout": 0.0,
    }
    if v.variant == "siglip":
        out["vision_use_head"] = False  # LLaVA reads hidden states, never the pooled output
    return out


def check_llava(model: ModelConfig) -> None:
    """Refuse what LlavaForConditionalGeneration cannot compute, naming the settings."""
    v = model.vision
    assert v is not None
    if v.projector != "mlp2x_gelu":
        raise CheckpointError(
            f"model.vision.projector={v.projector!r}: LlavaForConditionalGeneration's projector "
            "is always Linear-GELU-Linear ('mlp2x_gelu')"
        )
    if (model.normalization, model.activation, model.position_embedding_type) != (
        "rmsnorm",
        "swiglu",
        "rope",
    ):
        raise CheckpointError(
            "a LLaVA export takes a Llama-family language model (rmsnorm, swiglu, rope)"
        )


def llava_hf_config(model: ModelConfig, text: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The LlavaForConditionalGeneration `config.json` around the language model's `text`."""
    v = model.vision
    assert v is not None
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": vision_hf_config(v),
        "image_token_index": v.image_token_id,
        "image_seq_length": v.tokens_per_image,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": v.select_layer,
        # 'default' drops the first token (CLIP's class token); SigLIP has none: 'full'
        "vision_feature_select_strategy": _SELECT[v.select_feature] if v.class_token else "full",
        "multimodal_projector_bias": v.projector_bias,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "torch_dtype": dtype,
    }


def llava_choices(config: dict[str, Any]) -> dict[str, Any]:
    """The model.vision keys a LLaVA `config.json` sets besides the tower's."""
    act = config.get("projector_hidden_act", "gelu")
    if act != "gelu":
        raise CheckpointError(f"HF llava projector_hidden_act={act!r}: only 'gelu'")
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise CheckpointError(
            f"HF llava vision_feature_layer={layer!r}: meshtrain reads one layer (an int)"
        )
    strategy = config.get("vision_feature_select_strategy", "default")
    select = {s: f for f, s in _SELECT.items()}.get(strategy)
    if select is None:
        raise CheckpointError(f"HF llava vision_feature_select_strategy={strategy!r} is unknown")
    tower = config.get("vision_config", {}).get("model_type")
    if TOWERS.get(tower) == "siglip":
        if select != "cls_patch":
            raise CheckpointError(
                "HF llava with a SigLIP tower and vision_feature_select_strategy='default' drops "
                "the first patch (the strategy crops a class token SigLIP does not have); "
                "meshtrain reads every patch, as 'full' does"
            )
        select = "patch"  # every token of a tower without a class token
    token = config.get("image_token_index", config.get("image_token_id"))
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise CheckpointError(f"HF llava image_token_index={token!r} is not a token id")
    return {
        "select_layer": layer,
        "select_feature": select,
        "projector": "mlp2x_gelu",
        "projector_bias": bool(config.get("multimodal_projector_bias", True)),
        "image_token_id": token,
    }


def canonical(name: str) -> str:
    """An HF LLaVA tensor name as this module writes it (see the module docstring)."""
    for old, new in (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(old):
            name = new + name[len(old) :]
    if name == "lm_head.weight":
        name = "language_model.lm_head.weight"
    if name.startswith("vision_tower.vision_model."):
        name = TOWER_PREFIX + name[len("vision_tower.vision_model.") :]
    return name


def tower_name(name: str) -> str:
    """A tensor of a tower saved alone (`vision_model.*` or bare), named as in a LLaVA file."""
    if name.startswith("vision_model."):
        name = name[len("vision_model.") :]
    return TOWER_PREFIX + name


def text_name(name: str) -> str:
    """A language-model tensor (`model.*`, `lm_head.weight`) named as in a LLaVA file."""
    return "language_model." + name


def vision_rules(v: VisionConfig) -> list[Mapping]:
    """The encoder's tensors <-> the tower's (`vision_tower.` names)."""
    h, f, d, heads = (
        v.hidden_size,
        v.ffn_hidden_size,
        v.hidden_size // v.num_attention_heads,
        (v.num_attention_heads),
    )
    out: list[Mapping] = []
    t = TOWER_PREFIX

    def same(ours: str, theirs: str, shape: tuple[int, ...]) -> None:
        out.append((ours, shape, (theirs,), (shape,), lambda x: [x], lambda xs: xs[0]))

    def split_qkv(x: torch.Tensor) -> list[torch.Tensor]:
        rest = x.shape[1:]
        g = x.reshape(heads, 3, d, *rest)  # (heads, [q k v], head_dim, [hidden])
        return [g[:, j].reshape(h, *rest).contiguous() for j in range(3)]

    def fuse_qkv(xs: list[torch.Tensor]) -> torch.Tensor:
        rest = xs[0].shape[1:]
        parts = [x.reshape(heads, 1, d, *rest) for x in xs]
        return torch.cat(parts, dim=1).reshape(3 * h, *rest)  # per head: [q_h; k_h; v_h]

    p = v.patch_size
    same("vision.patch_embedding.weight", t + "embeddings.patch_embedding.weight", (h, 3, p, p))
    if v.variant == "siglip":
        same("vision.patch_embedding.bias", t + "embeddings.patch_embedding.bias", (h,))
    if v.class_token:
        same("vision.class_embedding", t + "embeddings.class_embedding", (h,))
    positions = v.grid**2 + int(v.class_token)
    same(
        "vision.position_embeddings.weight",
        t + "embeddings.position_embedding.weight",
        (positions, h),
    )
    norms = (("pre_norm", "pre_layrnorm"),) if v.variant == "clip" else ()
    for ours, theirs in (*norms, ("post_norm", "post_layernorm")):
        for s in ("weight", "bias"):
            same(f"vision.{ours}.{s}", f"{t}{theirs}.{s}", (h,))
    for i in range(v.num_layers):
        ours, theirs = f"vision.layers.{i}.", f"{t}encoder.layers.{i}."
        for s in ("weight", "bias"):
            tail = (h,) if s == "weight" else ()
            same(ours + f"input_norm.{s}", theirs + f"layer_norm1.{s}", (h,))
            out.append(
                (
                    ours + f"attention.qkv.{s}",
                    (3 * h, *tail),
                    tuple(theirs + f"self_attn.{q}_proj.{s}" for q in "qkv"),
                    ((h, *tail),) * 3,
                    split_qkv,
                    fuse_qkv,
                )
            )
            same(ours + f"attention.proj.{s}", theirs + f"self_attn.out_proj.{s}", (h, *tail))
            same(ours + f"pre_mlp_norm.{s}", theirs + f"layer_norm2.{s}", (h,))
            same(ours + f"mlp.fc1.{s}", theirs + f"mlp.fc1.{s}", (f, *tail))
            same(ours + f"mlp.fc2.{s}", theirs + f"mlp.fc2.{s}", (h, f) if s == "weight" else (h,))
    return out


def projector_rules(model: ModelConfig) -> list[Mapping]:
    """The projector's tensors <-> `multi_modal_projector.linear_1/2`."""
    v = model.vision
    assert v is not None
    h, vh = model.hidden_size, v.hidden_size
    suffixes = ("weight", "bias") if v.projector_bias else ("weight",)
    out: list[Mapping] = []
    for ours, theirs, shape in (("fc1", "linear_1", (h, vh)), ("fc2", "linear_2", (h, h))):
        for s in suffixes:
            sh = shape if s == "weight" else (h,)
            out.append(
                (
                    f"projector.{ours}.{s}",
                    sh,
                    (f"multi_modal_projector.{theirs}.{s}",),
                    (sh,),
                    lambda x: [x],
                    lambda xs: xs[0],
                )
            )
    return out


def fresh_projector(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A new projector's weights, as meshtrain initializes them (normal(0, init_method_std),
    zero biases), from `seed`: for a model whose tower and language model come from two HF
    folders."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for ours, shape, *_ in projector_rules(model):
        if ours.endswith(".bias"):
            out[ours] = torch.zeros(shape)
        else:
            out[ours] = torch.randn(shape, generator=g) * model.init_method_std
    return out
