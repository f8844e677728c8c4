"""Mixture-of-experts models <-> Hugging Face Mixtral and Qwen2-MoE, for `mapping.py`.

Which HF architecture a meshtrain MoE model is (and every setting that keeps it from being
one), its `config.json`, the MoE part of a `ModelConfig` from such a file, and the tensor mapping
of a MoE block. meshtrain stores a block's experts stacked, numbered globally:
`mlp.experts.fc1.weight` (experts, [gate; up], hidden) and `mlp.experts.fc2.weight` (experts,
hidden, ffn); HF files hold one tensor per expert and projection:

    Mixtral    block_sparse_moe.gate.weight                router (experts, hidden)
               block_sparse_moe.experts.<e>.w1 / w3 / w2   gate / up / down of expert e
    Qwen2-MoE  mlp.gate.weight, mlp.experts.<e>.gate_proj / up_proj / down_proj,
               mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate (1, hidden)

Mixtral routes by the softmax of the top-k logits (meshtrain's moe_router_pre_softmax off);
Qwen2-MoE by the softmax over all experts, renormalized over the top k only with
`norm_topk_prob` (so norm_topk_prob false is moe_router_pre_softmax on). Published Qwen2-MoE
models put biases on q/k/v only (`qkv_bias`): meshtrain's model.qkv_bias. The attention, norms,
RoPE and sliding window are read as for the dense Llama family (`llama.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig

log = logging.getLogger(__name__)

# (ours, shape, theirs, their shapes, ours -> theirs, theirs -> ours): one `mapping.Rule`.
Mapping = tuple[
    str,
    tuple[int, ...],
    tuple[str, ...],
    tuple[tuple[int, ...], ...],
    Callable[[torch.Tensor], list[torch.Tensor]],
    Callable[[list[torch.Tensor]], torch.Tensor],
]


def moe_architecture(model: ModelConfig) -> str:
    """ "mixtral" (no shared expert) or "qwen2_moe" (a gated shared expert) for a MoE model.

    Raises:
        CheckpointError: names every setting the chosen architecture cannot compute.
    """
    style = (model.normalization, model.activation, model.position_embedding_type)
    if style != ("rmsnorm", "swiglu", "rope"):
        raise CheckpointError(
            f"model.normalization={model.normalization!r}, model.activation={model.activation!r}, "
            f"model.position_embedding_type={model.position_embedding_type!r} with experts map to "
            "no Hugging Face architecture: Mixtral and Qwen2-MoE are rmsnorm+swiglu+rope"
        )
    qwen = bool(model.moe_shared_expert_intermediate_size)
    name = "Qwen2MoeForCausalLM" if qwen else "MixtralForCausalLM"
    why = []
    if model.add_bias_linear:
        why.append("model.add_bias_linear=true (no linear biases there)")
    if model.qkv_bias and not qwen:
        why.append(
            "model.qkv_bias=true (Mixtral has no q/k/v biases; Qwen2-MoE, which has, also has a "
            "shared expert)"
        )
    if model.qk_norm:
        why.append("model.qk_norm=true (no q/k norms there)")
    if model.moe_router_score_function != "softmax":
        why.append(
            f"model.moe_router_score_function={model.moe_router_score_function!r} "
            "(its router is a softmax)"
        )
    if model.moe_router_topk_scaling_factor not in (None, 1.0):
        why.append(
            f"model.moe_router_topk_scaling_factor={model.moe_router_topk_scaling_factor} "
            "(no such factor)"
        )
    if model.moe_router_enable_expert_bias:
        why.append("model.moe_router_enable_expert_bias=true (no expert bias in its routing)")
    if qwen:
        if not model.moe_shared_expert_gate:
            why.append(
                "model.moe_shared_expert_gate=false (Qwen2-MoE always gates its shared expert)"
            )
    else:
        dense = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]
        if dense:
            why.append(
                f"model.moe_layer_freq={model.moe_layer_freq!r} leaves blocks {dense[:8]} dense "
                "(Mixtral has experts in every block; Qwen2-MoE, which has dense blocks, also has "
                "a shared expert)"
            )
        if model.moe_router_pre_softmax:
            why.append(
                "model.moe_router_pre_softmax=true (Mixtral softmaxes the top-k logits; Qwen2-MoE, "
                "which takes the full softmax, also has a shared expert)"
            )
    if why:
        raise CheckpointError(
            f"this mixture-of-experts model maps to no Hugging Face {name}: " + "; ".join(why)
        )
    return "qwen2_moe" if qwen else "mixtral"


def moe_hf_config(model: ModelConfig, arch: str, base: dict[str, Any]) -> dict[str, Any]:
    """The `config.json` of a model `moe_architecture` named `arch`, from the Llama-style `base`
    (attention, norms, RoPE, vocabulary). Training-only settings without a field there (which
    the exported model computes the same without) are dropped with a warning."""
    dropped = {
        "model.hidden_dropout": model.hidden_dropout,
        "model.moe_z_loss_coeff": model.moe_z_loss_coeff,
        "model.moe_expert_capacity_factor (HF computes every routed token)": (
            model.moe_expert_capacity_factor
        ),
    }
    for key, value in dropped.items():
        if value:
            log.warning("%s=%s has no %s config field; dropped", key, value, arch)
    out = {k: v for k, v in base.items() if k not in ("attention_bias", "mlp_bias")}
    out.update(
        {
            "num_experts_per_tok": model.moe_router_topk,
            # HF adds the load-balancing loss only when the router logits are output.
            "router_aux_loss_coef": model.moe_aux_loss_coeff,
            "output_router_logits": model.moe_aux_loss_coeff > 0,
        }
    )
    if arch == "mixtral":
        out.update(
            {
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "intermediate_size": model.moe_ffn_size,
                "num_local_experts": model.num_experts,
                "sliding_window": model.hf_sliding_window,
                "router_jitter_noise": 0.0,
            }
        )
    else:
        out.update(
            {
                "architectures": ["Qwen2MoeForCausalLM"],
                "model_type": "qwen2_moe",
                "intermediate_size": model.ffn_size,
                "moe_intermediate_size": model.moe_ffn_size,
                "num_experts": model.num_experts,
                "shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
                "norm_topk_prob": not model.moe_router_pre_softmax,
                "qkv_bias": model.qkv_bias,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [
                    i for i in range(model.num_layers) if not model.is_moe_layer(i)
                ],
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": model.num_layers,
            }
        )
    return out


def moe_from_hf(kind: str, config: dict[str, Any], count: Callable[[str], int]) -> dict[str, Any]:
    """The ModelConfig settings of a Mixtral or Qwen2-MoE `config.json` beyond Llama's.

    Args:
        kind: "mixtral" or "qwen2_moe".
        config: the HF config.
        count: reads a positive int key, or raises naming it.

    Raises:
        CheckpointError: a setting meshtrain computes otherwise; names it and why.
    """
    if config.get("router_jitter_noise"):
        log.warning(
            "HF config router_jitter_noise=%s (multiplicative noise on the router input in "
            "training) has no meshtrain setting; dropped",
            config["router_jitter_noise"],
        )
    coeff = config.get("router_aux_loss_coef", 0.001)
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0:
        raise CheckpointError(f"HF config router_aux_loss_coef={coeff!r} is not a number >= 0")
    table = {
        "moe_router_topk": count("num_experts_per_tok"),
        "moe_router_score_function": "softmax",
        # HF adds the load-balancing loss only when it outputs the router logits.
        "moe_aux_loss_coeff": float(coeff) if config.get("output_router_logits", False) else 0.0,
    }
    if kind == "mixtral":
        table.update(
            {
                "num_experts": count("num_local_experts"),
                "moe_ffn_hidden_size": count("intermediate_size"),
                "moe_layer_freq": 1,
                "moe_router_pre_softmax": False,
            }
        )
        return table
    experts, step = (
        count("num_experts"),
        count("decoder_sparse_step") if "decoder_sparse_step" in config else 1,
    )
    skip = config.get("mlp_only_layers") or []
    if not isinstance(skip, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in skip
    ):
        raise CheckpointError(f"HF config mlp_only_layers={skip!r} is not a list of layer numbers")
    layers = count("num_hidden_layers")
    freq = [int(i not in skip and (i + 1) % step == 0) for i in range(layers)]
    table.update(
        {
            "num_experts": experts,
            "moe_ffn_hidden_size": count("moe_intermediate_size"),
            "moe_layer_freq": 1 if all(freq) else freq,
            "moe_shared_expert_intermediate_size": count("shared_expert_intermediate_size"),
            "moe_shared_expert_gate": True,
            "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
        }
    )
    return table


def moe_block(model: ModelConfig, arch: str, ours: str, theirs: str) -> list[Mapping]:
    """The tensors of one MoE block: `ours` is `layers.<i>.mlp.`, `theirs` the HF layer prefix."""
    e, f, h = model.num_experts, model.moe_ffn_size, model.hidden_size
    assert e is not None  # called for the MoE blocks of a model with experts
    if arch == "mixtral":
        at, gate, up, down = theirs + "block_sparse_moe.", "w1", "w3", "w2"
        router = at + "gate.weight"
    else:
        at, gate, up, down = theirs + "mlp.", "gate_proj", "up_proj", "down_proj"
        router = at + "gate.weight"
    out: list[Mapping] = [
        (ours + "router.weight", (e, h), (router,), ((e, h),), lambda t: [t], lambda ts: ts[0]),
        # fc1 (experts, [gate; up], hidden) -> gate, up of each expert in turn; fc2 -> down.
        (
            ours + "experts.fc1.weight",
            (e, 2 * f, h),
            tuple(f"{at}experts.{j}.{w}.weight" for j in range(e) for w in (gate, up)),
            ((f, h),) * (2 * e),
            lambda t: [c.contiguous() for x in t for c in x.chunk(2, dim=0)],
            lambda ts: torch.stack([torch.cat(ts[2 * j : 2 * j + 2], dim=0) for j in range(e)]),
        ),
        (
            ours + "experts.fc2.weight",
            (e, h, f),
            tuple(f"{at}experts.{j}.{down}.weight" for j in range(e)),
            ((h, f),) * e,
            lambda t: [x.contiguous() for x in t],
            lambda ts: torch.stack(ts),
        ),
    ]
    if arch == "qwen2_moe":
        s = model.moe_shared_expert_intermediate_size
        assert s  # `moe_architecture` names qwen2_moe a model with a shared expert
        out += [
            (
                ours + "shared_expert.fc1.weight",
                (2 * s, h),
                (at + "shared_expert.gate_proj.weight", at + "shared_expert.up_proj.weight"),
                ((s, h), (s, h)),
                lambda t: [c.contiguous() for c in t.chunk(2, dim=0)],
                lambda ts: torch.cat(ts, dim=0),
            ),
            (
                ours + "shared_expert.fc2.weight",
                (h, s),
                (at + "shared_expert.down_proj.weight",),
                ((h, s),),
                lambda t: [t],
                lambda ts: ts[0],
            ),
            (
                ours + "shared_expert_gate.weight",
                (1, h),
                (at + "shared_expert_gate.weight",),
                ((1, h),),
                lambda t: [t],
                lambda ts: ts[0],
            ),
        ]
    return out
