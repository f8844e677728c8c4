"""The Llama family's `config.json` <-> ModelConfig, for `mapping.py`: Llama (with Llama 3 RoPE
scaling), Mistral, Qwen2 and Qwen3, and the attention and RoPE settings Mixtral and Qwen2-MoE
(`moe.py`) share with them.

All four are RMSNorm + SwiGLU + RoPE decoders with grouped-query attention and the same tensor
names; they differ in what the attention carries: Llama biases on every linear layer or none
(attention_bias = mlp_bias), Mistral none, Qwen2 biases on q/k/v alone (meshtrain's
model.qkv_bias), Qwen3 an RMSNorm over each query and key head (model.qk_norm) and a head width
of its own (model.kv_channels). `dense_architecture` picks the one a meshtrain model is (or
checks the one asked for), `dense_hf_config` writes its config, `llama_family_table` reads one.
A sliding window that masks part of the sequence has no meshtrain equivalent and is refused,
unless the imported sequence length fits inside the window (then it masks nothing, and Mistral's
is kept for the export as model.hf_sliding_window).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig

log = logging.getLogger(__name__)

DENSE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""The dense Llama-family HF architectures: model_type -> class name."""
FAMILY = (*DENSE, "mixtral", "qwen2_moe")
"""Every model_type whose attention, norms and RoPE are read here."""


def dense_architecture(model: ModelConfig, requested: str | None = None) -> str:
    """The HF model_type a dense rmsnorm+swiglu+rope model is: `requested`, or the natural one
    (qwen3 with q/k norms, qwen2 with q/k/v-only biases, else llama).

    Raises:
        CheckpointError: `requested` is no dense Llama-family type, or cannot compute this model;
            names every setting in the way.
    """
    qkv_only = model.qkv_bias and not model.add_bias_linear
    arch = requested or ("qwen3" if model.qk_norm else "qwen2" if qkv_only else "llama")
    if arch not in DENSE:
        raise CheckpointError(
            f"architecture {arch!r} is not one a dense rmsnorm+swiglu+rope model exports as; "
            f"choose one of {sorted(DENSE)}"
        )
    why = []
    if model.qk_norm and arch != "qwen3":
        why.append("model.qk_norm=true (only Qwen3 normalizes q and k)")
    if qkv_only and arch not in ("qwen2",):
        why.append(
            "model.qkv_bias=true without model.add_bias_linear (only Qwen2 biases q/k/v alone)"
        )
    if arch == "mistral" and model.add_bias_linear:
        why.append("model.add_bias_linear=true (Mistral has no linear biases)")
    if arch == "qwen2":
        if model.add_bias_linear:
            why.append("model.add_bias_linear=true (Qwen2 biases q/k/v only)")
        elif not model.qkv_bias:
            why.append("model.qkv_bias=false (Qwen2 always biases q/k/v)")
    if arch == "qwen3":
        if not model.qk_norm:
            why.append("model.qk_norm=false (Qwen3 always normalizes q and k)")
        if model.add_bias_linear or model.qkv_bias:
            why.append(
                "linear biases (Qwen3's attention_bias biases q, k, v and o, and its MLP has none)"
            )
    if why:
        raise CheckpointError(
            f"this model maps to no Hugging Face {DENSE[arch]}: " + "; ".join(why)
        )
    return arch


def rope_parameters(model: ModelConfig) -> dict[str, Any]:
    """HF's rope parameters of the model: plain, or Llama 3's scaling (`rope_type: llama3`)."""
    if model.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": model.rotary_base}
    return {
        "rope_type": "llama3",
        "rope_theta": model.rotary_base,
        "factor": model.rope_scaling_factor,
        "low_freq_factor": model.rope_scaling_low_freq_factor,
        "high_freq_factor": model.rope_scaling_high_freq_factor,
        "original_max_position_embeddings": model.rope_scaling_original_max_positions,
    }


def llama_config(model: ModelConfig, dtype: str, eod: int | None) -> dict[str, Any]:
    """The LlamaForCausalLM `config.json` of a model, the base of the family's others."""
    rope = rope_parameters(model)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.groups,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_positions,
        "rms_norm_eps": model.norm_epsilon,
        # transformers >= 5 reads rope_parameters, older versions rope_theta and rope_scaling:
        # write all.
        "rope_theta": model.rotary_base,
        "rope_parameters": rope,
        "rope_scaling": rope if model.rope_scaling_factor is not None else None,
        "attention_bias": model.add_bias_linear,
        "mlp_bias": model.add_bias_linear,
        "attention_dropout": model.attention_dropout,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "initializer_range": model.init_method_std,
        "torch_dtype": dtype,
        "bos_token_id": eod,
        "eos_token_id": eod,
    }


def dense_hf_config(model: ModelConfig, arch: str, dtype: str, eod: int | None) -> dict[str, Any]:
    """The `config.json` of a dense model `dense_architecture` named `arch`."""
    if model.hidden_dropout:
        # Dropout changes training only; the exported model computes the same function.
        log.warning(
            "model.hidden_dropout=%s has no %s config field; dropped",
            model.hidden_dropout,
            DENSE[arch],
        )
    out = llama_config(model, dtype, eod)
    if arch == "llama":
        return out
    del out["attention_bias"], out["mlp_bias"]
    window = model.hf_sliding_window if arch == "mistral" else None
    out.update({"architectures": [DENSE[arch]], "model_type": arch, "sliding_window": window})
    if arch in ("qwen2", "qwen3"):
        out.update(
            {
                "use_sliding_window": False,
                "max_window_layers": model.num_layers,
                "layer_types": ["full_attention"] * model.num_layers,
            }
        )
    if arch == "qwen3":
        out["attention_bias"] = False
    return out


def llama_family_table(
    kind: str, config: dict[str, Any], count: Callable[[str], int], seq_length: int | None
) -> dict[str, Any]:
    """The ModelConfig settings of a Llama-family `config.json` (`kind` in FAMILY): attention,
    norms, RoPE, vocabulary, and the dense MLP width; a MoE model's experts are read elsewhere.

    Args:
        kind: the config's model_type.
        config: the HF config.
        count: reads a positive int key, or raises naming it.
        seq_length: the meshtrain model's sequence length; None: max_position_embeddings.

    Raises:
        CheckpointError: a setting meshtrain computes otherwise; names it and why.
    """

    def need(key: str, ok: Callable[[Any], bool], allowed: str, default: Any = None) -> Any:
        value = config.get(key, default)
        if not ok(value):
            raise CheckpointError(
                f"HF config {key}={value!r} cannot be expressed in meshtrain (needs {allowed})"
            )
        return value

    heads, hidden = count("num_attention_heads"), count("hidden_size")
    need("hidden_act", lambda v: v == "silu", "'silu'")
    head_dim = config.get("head_dim") or (128 if kind == "qwen3" else None)  # Qwen3Config's default
    if head_dim is not None and (
        isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1
    ):
        raise CheckpointError(f"HF config head_dim={head_dim!r} is not a positive integer")
    positions = count("max_position_embeddings")
    seq = positions if seq_length is None else seq_length
    window = _check_window(kind, config, seq, positions)
    # Mistral's and Mixtral's window is one key: kept for the export (model.hf_sliding_window, at
    # least seq), with the model's own context. Qwen's applies to some layers (use_sliding_window,
    # layer_types): dropped, as it covers seq the export attends fully and computes the same.
    kept = window if kind in ("mistral", "mixtral") else None
    dropped = window is not None and kept is None
    bias = {"add_bias_linear": False, "qkv_bias": False, "qk_norm": kind == "qwen3"}
    if kind == "llama":
        bias["add_bias_linear"] = bool(
            need(
                "attention_bias",
                lambda v: v == config.get("mlp_bias", False),
                f"the same value as mlp_bias={config.get('mlp_bias', False)!r}",
                False,
            )
        )
    elif kind == "qwen2":
        bias["qkv_bias"] = True  # always, in Qwen2's attention
    elif kind == "qwen2_moe":
        bias["qkv_bias"] = bool(config.get("qkv_bias", True))
    elif kind == "qwen3":
        need(
            "attention_bias",
            lambda v: not v,
            "false: Qwen3's attention bias also biases o_proj, and meshtrain "
            "biases either q/k/v alone (model.qkv_bias) or every linear layer",
            False,
        )
    table = {
        "num_layers": count("num_hidden_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "kv_channels": head_dim
        if head_dim not in (None, hidden // heads) or hidden % heads
        else None,
        "ffn_hidden_size": config["intermediate_size"],
        "seq_length": seq,
        "vocab_size": config["vocab_size"],
        # The model's own context, kept for its export, unless a window (covering seq) was dropped:
        # beyond seq the export then states no more than meshtrain computes.
        "max_position_embeddings": positions if not dropped and seq < positions else None,
        "hf_sliding_window": kept,
        "normalization": "rmsnorm",
        "norm_epsilon": config.get("rms_norm_eps", 1e-6),
        "activation": "swiglu",
        "position_embedding_type": "rope",
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "attention_dropout": float(config.get("attention_dropout", 0.0)),
        **bias,
        **_rope_table(config),
    }
    return table


def _rope_table(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from `rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta`."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"HF config rope parameters {rope!r} are not an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    table = {"rotary_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if kind == "default":
        return table
    if kind != "llama3":
        raise CheckpointError(
            f"HF config rope scaling {rope!r} cannot be expressed in meshtrain (rope_type "
            f"{kind!r}: only plain RoPE and Llama 3's 'llama3' scaling)"
        )
    keys = {
        "factor": "rope_scaling_factor",
        "low_freq_factor": "rope_scaling_low_freq_factor",
        "high_freq_factor": "rope_scaling_high_freq_factor",
        "original_max_position_embeddings": "rope_scaling_original_max_positions",
    }
    for theirs, ours in keys.items():
        value = rope.get(theirs)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(
                f"HF config llama3 rope scaling {theirs}={value!r} is not a number"
            )
        table[ours] = int(value) if ours.endswith("positions") else float(value)
    return table


def _check_window(kind: str, config: dict[str, Any], seq: int, positions: int) -> int | None:
    """The sliding window in effect (None: none); refuses one that masks part of a `seq`-token
    sequence (HF's token i sees the `window` positions up to and including i: a sequence no
    longer than it is unmasked)."""
    if kind in ("mistral", "mixtral"):
        window = config.get("sliding_window")
    elif kind in ("qwen2", "qwen3", "qwen2_moe") and config.get("use_sliding_window"):
        window = config.get("sliding_window")
        types = config.get("layer_types")
        if isinstance(types, list) and "sliding_attention" not in types:
            window = None  # no layer uses it
    else:
        window = None
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(
            f"HF config sliding_window={window!r} is not a positive integer or null"
        )
    if window < seq:
        raise CheckpointError(
            f"HF config sliding_window={window!r} cannot be expressed in meshtrain at a sequence "
            f"length of {seq} (max_position_embeddings={positions}): meshtrain attends to the "
            "whole sequence, which the window would mask; import with a sequence length of at most "
            f"{window} (--seq-length {window}), where the window covers every token"
        )
    return window
