"""The architecture of a megatron-core torch_dist checkpoint, for `torch_dist.py`: its
ModelConfig from the saved Megatron-LM `args` (in `common.pt`), from Megatron-style flags where
it has none, and from the tensors' shapes; and the reverse, the Megatron-LM flags that build a
meshtrain model.

What the shapes tell is taken from them (layers, hidden and MLP widths, vocabulary rows, biases,
LayerNorm vs RMSNorm by the norms' biases, SwiGLU by fc1's doubled rows, learned positions by
their table, an untied output layer, q/k norms, the query groups once the heads are known) and
checked against the args; what they cannot tell (heads, RoPE base, sequence length of a RoPE
model) must come from the args or a flag, and a missing one is an error naming the flag.
`common.pt` is unpickled with torch's weights-only loader: Megatron's own classes in the args
(enums, configs) become inert stand-ins, so loading a checkpoint runs none of its code.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshtrain.services.common.config import build
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig

QKV = "decoder.layers.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.linear_fc2.weight"
EMBEDDING = "embedding.word_embeddings.weight"
POSITIONS = "embedding.position_embeddings.weight"
# Megatron argument names read from the saved args (flags use the same names).
ARG_NAMES = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "seq_length",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "use_rope_scaling",
    "rope_scaling_factor",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "openai_gelu",
    "squared_relu",
    "apply_layernorm_1p",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "multi_latent_attention",
    "hidden_dropout",
    "attention_dropout",
    "init_method_std",
    "make_vocab_size_divisible_by",
    "vocab_size",
    "padded_vocab_size",
)
_SAFE = {
    "argparse.Namespace": argparse.Namespace,
    "types.SimpleNamespace": types.SimpleNamespace,
    "pathlib.PosixPath": pathlib.PosixPath,
}
# Key fragments of features that have no meshtrain mapping, and what to call them.
_UNSUPPORTED = (
    (".mlp.router.", "mixture-of-experts layers"),
    (".mlp.experts.", "mixture-of-experts layers"),
    (".mlp.shared_experts.", "mixture-of-experts layers"),
    ("linear_q_down_proj", "multi-latent attention (MLA)"),
    ("linear_kv_down_proj", "multi-latent attention (MLA)"),
    ("linear_q_up_proj", "multi-latent attention (MLA)"),
    ("linear_kv_up_proj", "multi-latent attention (MLA)"),
)


class _Stand_in:  # noqa: N801 - the name says what it is
    """Takes the place of a class of Megatron's in the unpickled args; keeps what it was given."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def read_common(folder: Path) -> dict[str, Any]:
    """`common.pt` of a torch_dist folder ({} where there is none), loaded weights-only.

    Raises:
        CheckpointError: the file is not a torch pickle, or not a dict.
    """
    path = folder / "common.pt"
    if not path.is_file():
        return {}
    try:
        unknown = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        allowed: list[Callable | tuple[Callable, str]] = [  # what torch's safe_globals takes
            (_SAFE.get(name, _Stand_in), name) for name in unknown
        ]
        with torch.serialization.safe_globals(allowed):
            common = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path}: not readable ({type(e).__name__}: {str(e)[:300]})"
        ) from None
    if not isinstance(common, dict):
        raise CheckpointError(
            f"{path}: holds a {type(common).__name__}, not the dict megatron-core writes"
        )
    return common


def refuse_unsupported_keys(keys: dict[str, tuple[int, ...]], folder: Path) -> None:
    """Raises CheckpointError naming a feature whose tensors meshtrain cannot import (MoE, MLA,
    MTP)."""
    for key in keys:
        if key.startswith("mtp."):
            raise CheckpointError(
                f"{folder}: multi-token prediction layers ({key!r}) are not supported"
            )
        for fragment, what in _UNSUPPORTED:
            if fragment in key:
                raise CheckpointError(
                    f"{folder}: {what} ({key!r}) are not supported; only dense GPT and "
                    "Llama-style models import"
                )


def _facts(args: Any, flags: dict[str, Any]) -> dict[str, Any]:
    facts = {}
    if args is not None:
        if getattr(args, "disable_bias_linear", None) is not None:  # older checkpoints' spelling
            facts["add_bias_linear"] = not args.disable_bias_linear
        for name in ARG_NAMES:
            value = getattr(args, name, None)
            if value is not None:
                facts[name] = value
    unknown = sorted(set(flags) - set(ARG_NAMES))
    if unknown:
        raise CheckpointError(f"unknown Megatron settings {unknown}; known: {', '.join(ARG_NAMES)}")
    facts.update({k: v for k, v in flags.items() if v is not None})
    return facts


def _refuse(facts: dict[str, Any], folder: Path) -> None:
    why = []
    if facts.get("num_experts"):
        why.append(f"num_experts={facts['num_experts']} (mixture-of-experts layers)")
    if facts.get("multi_latent_attention"):
        why.append("multi_latent_attention (multi-latent attention, MLA)")
    if facts.get("apply_layernorm_1p"):
        why.append("apply_layernorm_1p (zero-centred norm weights)")
    if facts.get("squared_relu"):
        why.append("squared_relu")
    if facts.get("rotary_interleaved"):
        why.append("rotary_interleaved")
    if float(facts.get("rotary_percent", 1.0)) != 1.0:
        why.append(f"rotary_percent={facts['rotary_percent']} (meshtrain rotates whole heads)")
    kind = facts.get("position_embedding_type")
    if kind is not None and kind not in ("learned_absolute", "learned", "rope"):
        why.append(f"position_embedding_type={kind!r} (only learned_absolute and rope)")
    norm = facts.get("normalization")
    if norm is not None and str(norm).lower() not in ("layernorm", "rmsnorm"):
        why.append(f"normalization={norm!r} (only LayerNorm and RMSNorm)")
    if why:
        raise CheckpointError(f"{folder}: settings meshtrain cannot express: {'; '.join(why)}")


def model_from_megatron(
    args: Any, flags: dict[str, Any], keys: dict[str, tuple[int, ...]], folder: Path
) -> tuple[ModelConfig, list[str]]:
    """The ModelConfig of a checkpoint, and notes on what meshtrain computes differently.

    Args:
        args: the saved Megatron-LM args (a Namespace), or None.
        flags: Megatron argument names -> values, over the args.
        keys: the model tensors' keys -> global shapes.
        folder: the checkpoint, for messages.

    Raises:
        CheckpointError: a fact is missing (names the flag), contradicts the tensors, or is a
            feature meshtrain cannot express.
    """
    facts = _facts(args, flags)
    _refuse(facts, folder)
    for key in (QKV, FC2, EMBEDDING):
        if key not in keys:
            raise CheckpointError(
                f"{folder}: missing tensor {key!r}, so not a megatron-core GPTModel checkpoint"
            )
    layers, qkv_rows, hidden = keys[QKV]
    rows, ffn = keys[EMBEDDING][0], keys[FC2][2]
    fc1_rows = keys[FC1][1] if FC1 in keys else keys.get(FC1 + "_w", (0, 0))[1] * 2
    seen = {
        "normalization": "layernorm" if "decoder.final_layernorm.bias" in keys else "rmsnorm",
        "swiglu": fc1_rows == 2 * ffn,
        "position_embedding_type": "learned" if POSITIONS in keys else "rope",
        "add_bias_linear": "decoder.layers.self_attention.linear_proj.bias" in keys,
        "qk_layernorm": "decoder.layers.self_attention.q_layernorm.weight" in keys,
        "untie_embeddings_and_output_weights": "output_layer.weight" in keys,
        "num_layers": layers,
        "hidden_size": hidden,
        "ffn_hidden_size": ffn,
    }
    said = dict(facts)
    said["normalization"] = str(facts.get("normalization", seen["normalization"])).lower()
    position = facts.get("position_embedding_type", seen["position_embedding_type"])
    if "position_embedding_type" in facts and position == "learned_absolute":
        position = "learned"  # Megatron's learned_absolute, by meshtrain's name
    said["position_embedding_type"] = position
    wrong = [
        f"{k}={said[k]!r} but the tensors say {v!r}"
        for k, v in seen.items()
        if k in said and type(v)(said[k]) != v
    ]
    if wrong:
        raise CheckpointError(
            f"{folder}: the settings disagree with the tensors: {'; '.join(wrong)}"
        )
    heads = facts.get("num_attention_heads")
    if heads is None:
        raise CheckpointError(
            f"{folder}: the number of attention heads is unknown (the checkpoint has no saved "
            "args): give --num-attention-heads"
        )
    d = facts.get("kv_channels") or (hidden // heads if hidden % heads == 0 else None)
    if d is None:
        raise CheckpointError(
            f"{folder}: hidden size {hidden} is no multiple of {heads} heads: check "
            "--num-attention-heads, or give --kv-channels (the head width)"
        )
    if qkv_rows % d:
        raise CheckpointError(
            f"{folder}: fused qkv rows {qkv_rows} are no whole number of {d}-wide heads: check "
            "--num-attention-heads and --kv-channels (the head width)"
        )
    if facts.get("group_query_attention") or flags.get("num_query_groups") is not None:
        groups = facts.get("num_query_groups")
    elif args is not None:
        groups = heads
    else:
        groups = (qkv_rows // d - heads) // 2  # rows = (heads + 2 * groups) * head_dim
    if not groups or groups < 1 or (heads + 2 * groups) * d != qkv_rows:
        raise CheckpointError(
            f"{folder}: fused qkv rows {qkv_rows} do not match {heads} heads of width {d} and "
            f"{groups} query groups: check --num-attention-heads, --num-query-groups and "
            "--kv-channels"
        )
    learned = seen["position_embedding_type"] == "learned"
    positions = keys[POSITIONS][0] if learned else None
    seq = facts.get("seq_length", positions)
    if seq is None:
        raise CheckpointError(
            f"{folder}: the sequence length of this RoPE model is unknown (no saved args): give "
            "--seq-length"
        )
    notes = []
    table: dict[str, Any] = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups if groups != heads else None,
        "kv_channels": d if d * heads != hidden else None,
        "ffn_hidden_size": ffn,
        "seq_length": min(seq, positions) if learned else seq,
        "max_position_embeddings": positions,
        "vocab_size": facts.get("vocab_size", rows),
        "normalization": seen["normalization"],
        "norm_epsilon": float(facts.get("norm_epsilon", 1e-5)),
        "activation": "swiglu" if seen["swiglu"] else "gelu",
        "position_embedding_type": seen["position_embedding_type"],
        "add_bias_linear": seen["add_bias_linear"],
        "qkv_bias": not seen["add_bias_linear"]
        and "decoder.layers.self_attention.linear_qkv.bias" in keys,
        "qk_norm": seen["qk_layernorm"],
        "untie_embeddings_and_output_weights": seen["untie_embeddings_and_output_weights"],
        "hidden_dropout": float(facts.get("hidden_dropout", 0.0)),
        "attention_dropout": float(facts.get("attention_dropout", 0.0)),
        "init_method_std": float(facts.get("init_method_std", 0.02)),
        "make_vocab_size_divisible_by": int(facts.get("make_vocab_size_divisible_by", 128)),
    }
    if table["vocab_size"] > rows:
        raise CheckpointError(
            f"{folder}: vocab_size={table['vocab_size']} exceeds the embedding's {rows} rows"
        )
    if not learned:
        if "rotary_base" not in facts and args is None:
            raise CheckpointError(
                f"{folder}: the RoPE base is unknown (no saved args): give --rotary-base "
                "(Megatron's default is 10000; Llama 3 used 500000)"
            )
        table["rotary_base"] = float(facts.get("rotary_base", 10000))
        if facts.get("use_rope_scaling"):
            table["rope_scaling_factor"] = float(facts.get("rope_scaling_factor", 8.0))
    if not seen["swiglu"] and not facts.get("openai_gelu"):
        notes.append(
            "the checkpoint's GELU is the exact (erf) one, which meshtrain computes with the tanh "
            "approximation (--openai-gelu): the two differ by at most 4.7e-4 per activation"
        )
    try:
        return build(ModelConfig, table, "model."), notes
    except (ValueError, KeyError) as e:
        raise CheckpointError(
            f"{folder}: the settings do not make a valid meshtrain model: {e}"
        ) from e


def check_exportable(model: ModelConfig) -> None:
    """Raises CheckpointError naming what a Megatron GPTModel cannot compute: MoE layers, and
    Llama 3 RoPE scaling with other bounds than Megatron's fixed ones (low 1, high 4, original
    8192)."""
    if model.num_experts is not None:
        raise CheckpointError(
            "model.num_experts is set: mixture-of-experts layers have no Megatron mapping here "
            "(only dense GPT and Llama-style models)"
        )
    if model.rope_scaling_factor is not None:
        bounds = (
            model.rope_scaling_low_freq_factor,
            model.rope_scaling_high_freq_factor,
            model.rope_scaling_original_max_positions,
        )
        if bounds != (1.0, 4.0, 8192):
            raise CheckpointError(
                "model.rope_scaling_low_freq_factor, high_freq_factor, original_max_positions = "
                f"{bounds}: Megatron's --use-rope-scaling fixes them at (1, 4, 8192)"
            )


def megatron_flags(model: ModelConfig) -> list[str]:
    """The Megatron-LM flags that build a GPTModel computing `model`, the tokenizer's aside (from
    it Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP rows)."""
    out = [
        "--num-layers",
        model.num_layers,
        "--hidden-size",
        model.hidden_size,
        "--ffn-hidden-size",
        model.ffn_size,
        "--num-attention-heads",
        model.num_attention_heads,
    ]
    if model.groups != model.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", model.groups]
    if model.head_dim * model.num_attention_heads != model.hidden_size:
        out += ["--kv-channels", model.head_dim]
    out += [
        "--seq-length",
        model.seq_length,
        "--max-position-embeddings",
        model.max_positions,
        "--normalization",
        "LayerNorm" if model.normalization == "layernorm" else "RMSNorm",
        "--norm-epsilon",
        model.norm_epsilon,
    ]
    out += ["--swiglu"] if model.activation == "swiglu" else ["--openai-gelu"]
    if model.position_embedding_type == "rope":
        out += ["--position-embedding-type", "rope", "--rotary-base", _number(model.rotary_base)]
        if model.rope_scaling_factor is not None:
            out += [
                "--use-rope-scaling",
                "--rope-scaling-factor",
                _number(model.rope_scaling_factor),
            ]
    else:
        out += ["--position-embedding-type", "learned_absolute"]
    if not model.add_bias_linear:
        out.append("--disable-bias-linear")
        if model.qkv_bias:
            out.append("--add-qkv-bias")
    if model.qk_norm:
        out.append("--qk-layernorm")
    if model.untie_embeddings_and_output_weights:
        out.append("--untie-embeddings-and-output-weights")
    out += [
        "--make-vocab-size-divisible-by",
        model.make_vocab_size_divisible_by,
        "--ckpt-format",
        "torch_dist",
    ]
    return [str(x) for x in out]


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and math.isfinite(x) else repr(float(x))
