"""What a meshtrain model is in Hugging Face's terms: the HF architecture a model maps to
(`architecture`; `imported_architecture` keeps an imported model's), its `config.json` (`hf_config`)
and back (`model_from_hf`, with the `hf_*` settings that carry what meshtrain does not compute
with), and the `Rule`s that map every meshtrain tensor to the HF tensors it becomes (`rules`): the
fused QKV (stored per query group) splits into q/k/v, the SwiGLU [gate; up] into gate_proj/up_proj,
and GPT-2's Conv1D weights are transposed (its c_attn is [q; k; v]); `canonical_names` reads a
file's own tensor names as the rules'. GPT-2's tables are here; the Llama family's, the mixtures of
experts' and LLaVA's are in `llama.py`, `moe.py` and `llava.py`. The conversion itself, which
streams tensors through these rules, is `convert.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.services.checkpoint.hf import llava
from meshtrain.services.checkpoint.hf.llama import (
    DENSE,
    FAMILY,
    dense_architecture,
    dense_hf_config,
    llama_config,
    llama_family_table,
)
from meshtrain.services.checkpoint.hf.moe import (
    moe_architecture,
    moe_block,
    moe_from_hf,
    moe_hf_config,
)
from meshtrain.services.common.config import build
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    """One meshtrain tensor and the Hugging Face tensors it becomes.

    Attributes:
        ours: the meshtrain tensor name.
        shape: its shape.
        theirs: the HF tensor names, in the order `to_hf` returns them.
        hf_shapes: their shapes.
        to_hf: ours -> [theirs...].
        from_hf: [theirs...] -> ours.
    """

    ours: str
    shape: tuple[int, ...]
    theirs: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]
    from_hf: Callable[[list[torch.Tensor]], torch.Tensor]


def architecture(model: ModelConfig, requested: str | None = None) -> str:
    """Names the HF model_type a model maps to: "llama", "mistral", "qwen2", "qwen3", "mixtral",
    "qwen2_moe" or "gpt2".

    Args:
        model: the architecture.
        requested: the model_type to export as (a dense Llama-shaped model is also a Mistral);
            None: the one the settings name.

    Raises:
        CheckpointError: the combination of settings has no HF equivalent, or not the requested
            one; names them.
    """
    if model.vision is not None:
        if requested not in (None, "llava"):
            raise CheckpointError(
                f"a vision-language model exports as 'llava', not the requested {requested!r}"
            )
        llava.check_llava(model)
        architecture(dataclasses.replace(model, vision=None))  # the language model maps too
        return "llava"
    style = (model.normalization, model.activation, model.position_embedding_type)
    if model.num_experts is not None:
        arch = moe_architecture(model)
    elif style == ("rmsnorm", "swiglu", "rope"):
        arch = dense_architecture(model, requested)
    elif style == ("layernorm", "gelu", "learned"):
        why = []
        if not model.add_bias_linear:
            why.append("model.add_bias_linear=false: GPT2LMHeadModel always has linear biases")
        if model.groups != model.num_attention_heads:
            why.append(
                f"model.num_query_groups={model.num_query_groups}: GPT2LMHeadModel has no "
                "grouped-query attention (groups must equal heads)"
            )
        if model.kv_channels not in (None, model.hidden_size // model.num_attention_heads):
            why.append(
                f"model.kv_channels={model.kv_channels}: "
                "GPT2LMHeadModel's heads are hidden/heads wide"
            )
        if model.qk_norm:
            why.append("model.qk_norm=true: GPT2LMHeadModel has no q/k norms")
        if why:
            raise CheckpointError("; ".join(why))
        arch = "gpt2"
    else:
        raise CheckpointError(
            f"model.normalization={model.normalization!r}, model.activation={model.activation!r}, "
            f"model.position_embedding_type={model.position_embedding_type!r} map to no Hugging "
            "Face architecture: Llama is rmsnorm+swiglu+rope, GPT-2 is layernorm+gelu+learned"
        )
    if requested is not None and arch != requested:
        raise CheckpointError(f"this model exports as {arch!r}, not the requested {requested!r}")
    return arch


def hf_config(
    model: ModelConfig, dtype: str, eod: int | None = None, arch: str | None = None
) -> dict[str, Any]:
    """The `config.json` of a model.

    Args:
        model: the architecture (vocab_size resolved).
        dtype: logical dtype of the weights, recorded as the HF `torch_dtype`.
        eod: the tokenizer's end-of-document id, written as bos and eos (as GPT-2 does); None
            is written too, since a missing key means HF's own default (Llama's 1 and 2,
            GPT-2's 50256), which is some other token here.
        arch: the model_type to write (see `architecture`); None: the model's own.

    Raises:
        CheckpointError: the model maps to no HF architecture (or not to `arch`).
    """
    arch = architecture(model, arch)
    if arch == "llava":
        text = hf_config(dataclasses.replace(model, vision=None), dtype, eod)
        return llava.llava_hf_config(model, text, dtype)
    if arch in DENSE:
        return dense_hf_config(model, arch, dtype, eod)
    if arch in FAMILY:
        return moe_hf_config(model, arch, llama_config(model, dtype, eod))
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_embd": model.hidden_size,
        "n_layer": model.num_layers,
        "n_head": model.num_attention_heads,
        "n_inner": model.ffn_size,
        "n_positions": model.max_positions,
        "layer_norm_epsilon": model.norm_epsilon,
        "activation_function": "gelu_new",
        "resid_pdrop": model.hidden_dropout,
        "embd_pdrop": model.hidden_dropout,
        "attn_pdrop": model.attention_dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "initializer_range": model.init_method_std,
        "torch_dtype": dtype,
        "bos_token_id": eod,
        "eos_token_id": eod,
    }


def model_from_hf(config: dict[str, Any], seq_length: int | None = None) -> ModelConfig:
    """The ModelConfig of an HF `config.json` (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or
    GPT-2).

    Args:
        config: the HF config.
        seq_length: the model's sequence length (Llama family); None: max_position_embeddings. A
            sliding window is accepted only where it covers the whole sequence.

    Raises:
        CheckpointError: another architecture, or a setting meshtrain cannot express; names it.
    """
    if seq_length is not None and (
        isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1
    ):
        raise CheckpointError(f"sequence length {seq_length!r} is not a positive integer")
    try:
        return _model_from_hf(config, seq_length)
    except KeyError as e:
        raise CheckpointError(
            f"HF config has no {e.args[0]!r} (model_type {config.get('model_type')!r})"
        ) from None


def _model_from_hf(config: dict[str, Any], seq_length: int | None) -> ModelConfig:
    kind = config.get("model_type")
    if kind == "llava":
        text = model_from_hf(config["text_config"], seq_length)
        vision = llava.vision_from_hf(config["vision_config"], **llava.llava_choices(config))
        dtype = config.get("dtype", config.get("torch_dtype"))
        try:
            return dataclasses.replace(
                text,
                vision=vision,
                hf_model_type="llava",
                hf_torch_dtype=dtype if dtype in ("float32", "float16", "bfloat16") else None,
            )
        except ValueError as e:
            raise CheckpointError(f"HF config does not make a valid meshtrain model: {e}") from e

    def count(key: str) -> int:
        # Used in arithmetic before `build` checks the types, so checked here, by name.
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"HF config {key}={value!r} is not a positive integer")
        return value

    if kind in FAMILY:
        table = llama_family_table(kind, config, count, seq_length)
        if kind in ("mixtral", "qwen2_moe"):
            table.update(moe_from_hf(kind, config, count))
    elif kind == "gpt2":
        table = _gpt2_table(config, seq_length)
    else:
        raise CheckpointError(
            f"HF model_type {kind!r} is not supported; only {', '.join(map(repr, FAMILY))}, "
            "'gpt2' and 'llava' (a vision tower alone joins a language model: import the "
            "language model with vision_tower=)"
        )
    table.update(_identity(kind, config))
    try:
        return build(ModelConfig, table, "model.")
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"HF config does not make a valid meshtrain model: {e}") from e


def _need(
    config: dict[str, Any], key: str, ok: Callable[[Any], bool], allowed: str, default: Any = None
) -> Any:
    """HF config `key` (default `default`), refused unless `ok` (which meshtrain can express)."""
    value = config.get(key, default)
    if not ok(value):
        raise CheckpointError(
            f"HF config {key}={value!r} cannot be expressed in meshtrain (needs {allowed})"
        )
    return value


def _gpt2_table(config: dict[str, Any], seq_length: int | None) -> dict[str, Any]:
    """The model settings of a GPT-2 `config.json`."""
    _need(
        config,
        "activation_function",
        lambda v: v in ("gelu_new", "gelu_pytorch_tanh"),
        "tanh-approximate GELU: 'gelu_new'",
        "gelu_new",
    )
    _need(config, "scale_attn_weights", lambda v: v is True, "true", True)
    _need(config, "scale_attn_by_inverse_layer_idx", lambda v: v is False, "false", False)
    if seq_length is not None:
        raise CheckpointError(
            "a sequence length applies to RoPE models; GPT-2's is its n_positions"
        )
    hidden = config["n_embd"]
    return {
        "num_layers": config["n_layer"],
        "hidden_size": hidden,
        "num_attention_heads": config["n_head"],
        "ffn_hidden_size": config.get("n_inner") or 4 * hidden,
        "seq_length": config["n_positions"],
        "max_position_embeddings": config["n_positions"],
        "vocab_size": config["vocab_size"],
        "normalization": "layernorm",
        "norm_epsilon": config.get("layer_norm_epsilon", 1e-5),
        "activation": "gelu",
        "position_embedding_type": "learned",
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
        "hidden_dropout": float(config.get("resid_pdrop", 0.0)),
        "attention_dropout": float(config.get("attn_pdrop", 0.0)),
    }


def _identity(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """The model.hf_* settings of an HF config: what its export writes back that meshtrain
    does not compute with (the architecture, the special-token ids, the weights' dtype)."""
    table: dict[str, Any] = {"hf_model_type": kind}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids = value if key == "eos_token_id" and isinstance(value, list) else [value]
        if value is not None and not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise CheckpointError(f"HF config {key}={value!r} is not a token id")
        table[f"hf_{key}"] = value
    dtype = config.get("dtype", config.get("torch_dtype"))  # transformers >= 5 writes "dtype"
    table["hf_torch_dtype"] = dtype if dtype in ("float32", "float16", "bfloat16") else None
    return table


def rules(model: ModelConfig, arch: str | None = None) -> list[Rule]:
    """The mapping of every meshtrain parameter of `model` to HF tensors, in file order.

    Args:
        model: the architecture (vocab_size resolved).
        arch: the HF model_type (see `architecture`); None: the model's own.

    Raises:
        CheckpointError: the model maps to no HF architecture (or not to `arch`), or its
            vocabulary size is unset.
    """
    arch = architecture(model, arch)
    if arch == "llava":
        assert model.vision is not None
        text = [
            dataclasses.replace(r, theirs=tuple(llava.text_name(t) for t in r.theirs))
            for r in rules(dataclasses.replace(model, vision=None))
        ]
        vision = [Rule(*m) for m in llava.vision_rules(model.vision)]
        return text + vision + [Rule(*m) for m in llava.projector_rules(model)]
    v = _vocab_size(model)
    out = _llama_rules(model, arch, v) if arch in FAMILY else _gpt2_rules(model, v)
    if model.untie_embeddings_and_output_weights:
        out.append(_same("output_layer.weight", "lm_head.weight", (v, model.hidden_size)))
    return out


def _vocab_size(model: ModelConfig) -> int:
    if model.vocab_size is None:
        raise CheckpointError(
            "model.vocab_size is unset: the mapping to Hugging Face tensors needs the vocabulary"
        )
    return model.vocab_size


def _same(ours: str, theirs: str, shape: tuple[int, ...]) -> Rule:
    """A tensor stored the same way on both sides."""
    return Rule(ours, shape, (theirs,), (shape,), lambda t: [t], lambda ts: ts[0])


def _transposed(ours: str, theirs: str, shape: tuple[int, int]) -> Rule:
    """GPT-2's Conv1D weight: stored (in, out), the transpose of a Linear's (out, in)."""
    return Rule(
        ours,
        shape,
        (theirs,),
        (shape[::-1],),
        lambda t: [t.t().contiguous()],
        lambda ts: ts[0].t().contiguous(),
    )


@dataclass(frozen=True)
class _Qkv:
    """The fused QKV's layout: per query group, its `per` query heads, then its key and value
    (each `d` rows wide)."""

    heads: int
    groups: int
    d: int

    @classmethod
    def of(cls, model: ModelConfig) -> _Qkv:
        return cls(model.num_attention_heads, model.groups, model.head_dim)

    @property
    def per(self) -> int:
        return self.heads // self.groups

    @property
    def rows(self) -> int:
        return (self.heads + 2 * self.groups) * self.d

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The fused tensor (rows, [hidden]) as [q, k, v]."""
        heads, groups, per, d = self.heads, self.groups, self.per, self.d
        rest = t.shape[1:]
        g = t.reshape(groups, per + 2, d, *rest)  # (groups, per+2, head_dim, [hidden])
        return [
            g[:, :per].reshape(heads * d, *rest).contiguous(),
            g[:, per].reshape(groups * d, *rest).contiguous(),
            g[:, per + 1].reshape(groups * d, *rest).contiguous(),
        ]

    def fuse(self, ts: list[torch.Tensor]) -> torch.Tensor:
        """[q, k, v] as the fused tensor (rows, [hidden])."""
        groups, per, d = self.groups, self.per, self.d
        q, k, vv = ts
        rest = q.shape[1:]
        parts = [
            q.reshape(groups, per, d, *rest),
            k.reshape(groups, 1, d, *rest),
            vv.reshape(groups, 1, d, *rest),
        ]
        return torch.cat(parts, dim=1).reshape(self.rows, *rest)  # per group: [q heads; k; v]


def _llama_rules(model: ModelConfig, arch: str, v: int) -> list[Rule]:
    """The Llama family's tensors (the dense ones, and the MoE blocks' through `moe.py`), the
    output layer left out."""
    h, ffn, d = model.hidden_size, model.ffn_size, model.head_dim
    heads, groups = model.num_attention_heads, model.groups
    qkv = _Qkv.of(model)
    suffixes = ("weight", "bias") if model.add_bias_linear else ("weight",)
    qkv_suffixes = ("weight", "bias") if model.add_bias_linear or model.qkv_bias else ("weight",)
    out = [_same("embedding.word_embeddings.weight", "model.embed_tokens.weight", (v, h))]
    for i in range(model.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out.append(_same(ours + "input_norm.weight", theirs + "input_layernorm.weight", (h,)))
        for s in qkv_suffixes:
            tail = (h,) if s == "weight" else ()
            out.append(
                Rule(
                    ours + f"attention.qkv.{s}",
                    (qkv.rows, *tail),
                    tuple(theirs + f"self_attn.{p}_proj.{s}" for p in "qkv"),
                    ((heads * d, *tail), (groups * d, *tail), (groups * d, *tail)),
                    qkv.split,
                    qkv.fuse,
                )
            )
        if model.qk_norm:  # Qwen3: one RMSNorm weight over head_dim each, shared by the heads
            for n in ("q_norm", "k_norm"):
                out.append(
                    _same(ours + f"attention.{n}.weight", theirs + f"self_attn.{n}.weight", (d,))
                )
        for s in suffixes:
            out.append(
                _same(
                    ours + f"attention.proj.{s}",
                    theirs + f"self_attn.o_proj.{s}",
                    (h, heads * d) if s == "weight" else (h,),
                )
            )
        out.append(
            _same(ours + "pre_mlp_norm.weight", theirs + "post_attention_layernorm.weight", (h,))
        )
        if arch not in DENSE and model.is_moe_layer(i):
            out.extend(Rule(*m) for m in moe_block(model, arch, ours + "mlp.", theirs))
            continue
        for s in suffixes:
            tail = (h,) if s == "weight" else ()
            out.append(
                Rule(
                    ours + f"mlp.fc1.{s}",
                    (2 * ffn, *tail),
                    (theirs + f"mlp.gate_proj.{s}", theirs + f"mlp.up_proj.{s}"),
                    ((ffn, *tail), (ffn, *tail)),
                    lambda t: [c.contiguous() for c in t.chunk(2, dim=0)],  # [gate; up]
                    lambda ts: torch.cat(ts, dim=0),
                )
            )
            out.append(
                _same(
                    ours + f"mlp.fc2.{s}",
                    theirs + f"mlp.down_proj.{s}",
                    (h, ffn) if s == "weight" else (h,),
                )
            )
    out.append(_same("final_norm.weight", "model.norm.weight", (h,)))
    return out


def _gpt2_rules(model: ModelConfig, v: int) -> list[Rule]:
    """GPT-2's tensors, the output layer left out."""
    h, ffn = model.hidden_size, model.ffn_size
    qkv = _Qkv.of(model)
    out = [
        _same("embedding.word_embeddings.weight", "transformer.wte.weight", (v, h)),
        _same(
            "embedding.position_embeddings.weight",
            "transformer.wpe.weight",
            (model.max_positions, h),
        ),
    ]
    for i in range(model.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        out += [
            _same(ours + "input_norm.weight", theirs + "ln_1.weight", (h,)),
            _same(ours + "input_norm.bias", theirs + "ln_1.bias", (h,)),
            # per == 1 here, so the per-group order is per head [q_h; k_h; v_h]; c_attn wants
            # [q; k; v] (and its weight transposed).
            Rule(
                ours + "attention.qkv.weight",
                (3 * h, h),
                (theirs + "attn.c_attn.weight",),
                ((h, 3 * h),),
                lambda t: [torch.cat(qkv.split(t), dim=0).t().contiguous()],
                lambda ts: qkv.fuse(list(ts[0].t().chunk(3, dim=0))).contiguous(),
            ),
            Rule(
                ours + "attention.qkv.bias",
                (3 * h,),
                (theirs + "attn.c_attn.bias",),
                ((3 * h,),),
                lambda t: [torch.cat(qkv.split(t), dim=0)],
                lambda ts: qkv.fuse(list(ts[0].chunk(3, dim=0))),
            ),
            _transposed(ours + "attention.proj.weight", theirs + "attn.c_proj.weight", (h, h)),
            _same(ours + "attention.proj.bias", theirs + "attn.c_proj.bias", (h,)),
            _same(ours + "pre_mlp_norm.weight", theirs + "ln_2.weight", (h,)),
            _same(ours + "pre_mlp_norm.bias", theirs + "ln_2.bias", (h,)),
            _transposed(ours + "mlp.fc1.weight", theirs + "mlp.c_fc.weight", (ffn, h)),
            _same(ours + "mlp.fc1.bias", theirs + "mlp.c_fc.bias", (ffn,)),
            _transposed(ours + "mlp.fc2.weight", theirs + "mlp.c_proj.weight", (h, ffn)),
            _same(ours + "mlp.fc2.bias", theirs + "mlp.c_proj.bias", (h,)),
        ]
    out.append(_same("final_norm.weight", "transformer.ln_f.weight", (h,)))
    out.append(_same("final_norm.bias", "transformer.ln_f.bias", (h,)))
    return out


def canonical_names(kind: str, text_of_llava: bool) -> Callable[[str], str]:
    """The rules' name of a tensor as the file of a `kind` model stores it (`text_of_llava`: a
    language model's file read as the text half of a LLaVA model)."""

    def canonical(name: str) -> str:
        # Old GPT-2 files name tensors without the "transformer." prefix.
        if kind == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            return f"transformer.{name}"
        if kind != "llava":
            return name
        if text_of_llava:  # a language model's file, named as in a LLaVA one
            return llava.text_name(name)
        return llava.canonical(name)

    return canonical


def imported_architecture(model: ModelConfig, metadata: dict[str, Any], where: str) -> str | None:
    """An imported model exports as its source architecture while its settings still fit it
    (checkpoints imported before model.hf_model_type existed name it in their metadata); None:
    the one the settings name (logged where the imported one no longer fits)."""
    origin = model.hf_model_type or (metadata.get("imported_from") or {}).get("architecture")
    if origin is None:
        return None
    try:
        return architecture(model, origin)
    except CheckpointError as e:
        log.warning(
            "%s: the model was imported from Hugging Face %r, which its settings no longer "
            "fit (%s); exporting as the architecture they name",
            where,
            origin,
            e,
        )
        return None
