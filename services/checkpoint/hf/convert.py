"""Hugging Face <-> meshtrain checkpoints: `LlamaForCausalLM` (Llama 3 RoPE scaling included),
`MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` (`llama.py`), `GPT2LMHeadModel`,
for mixture-of-experts models `MixtralForCausalLM` and `Qwen2MoeForCausalLM` (`moe.py`), and
for vision-language models `LlavaForConditionalGeneration` (`llava.py`; a CLIP or SigLIP tower
alone joins a language model's import with `vision_tower=`).

`export_hf(src_root, dst_dir)` turns a training checkpoint into a folder `transformers` loads
(safetensors shards of at most `max_shard_size` with their index, or one `model.safetensors`;
`config.json`, `generation_config.json` when the special-token ids are known, and the run's
`tokenizer.json` with a `tokenizer_config.json`); `import_hf(src, dst_root)` turns such a
folder, or a repo id found in the local Hugging Face cache (`files.model_folder`), into a
step-0 training checkpoint (fresh RNG, no optimizer state) that `meshtrain train --load` continues.
The import records the source's architecture and the config fields meshtrain does not compute
with (special-token ids, Mistral's window, dtype) as the model's `hf_*` settings, which every
later save carries, so the export writes the same model back.
The mapping is a list of `Rule`s, one per meshtrain tensor, each naming the HF tensors it
becomes and the two conversions: the fused QKV (stored per query group) splits into q/k/v,
the SwiGLU [gate; up] into gate_proj/up_proj, and GPT-2's Conv1D weights are transposed
(its c_attn is [q; k; v]). Every tensor is planned and shape-checked before anything is
written; an unmapped, missing or misshapen tensor is an error, and the export is built in a
temporary folder that is renamed into place only when complete. Both directions stream one
tensor at a time: export writes safetensors itself (`write.py`: headers from the plan).

    export_hf("runs/a/checkpoints", "out/hf")        # then AutoModelForCausalLM.from_pretrained
    import_hf("out/hf", "runs/b/checkpoints")         # then meshtrain train --load ...
    import_hf("Qwen/Qwen3-0.6B", "runs/c/checkpoints")  # from ~/.cache/huggingface/hub, offline
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import posixpath
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.convert import (
    TensorSpec,
    open_source,
    save_streaming,
)
from meshtrain.services.checkpoint.hf import llava
from meshtrain.services.checkpoint.hf import tokenizer as hf_tokenizer
from meshtrain.services.checkpoint.hf.files import (
    model_folder,
    open_safetensors,
    read_json,
    safetensors_files,
)
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
from meshtrain.services.checkpoint.hf.write import (
    DEFAULT_MAX_SHARD_SIZE,
    LOGICAL,
    parse_size,
    plan_shards,
    write_shards,
)
from meshtrain.services.checkpoint.reader import list_checkpoints, read_tensor
from meshtrain.services.checkpoint.store import open_root, remove_tree
from meshtrain.services.checkpoint.tokenizer_store import (
    METADATA_KEY,
    tokenizer_boxes,
    tokenizer_spec,
)
from meshtrain.services.common.builds import local_build_dir, remove_dead_builds
from meshtrain.services.common.config import build, to_dict
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig

log = logging.getLogger(__name__)

TRAIN_FORMAT = "meshtrain-train/1"  # meshtrain.services.trainer.checkpoint_state.FORMAT
# HF tensors that are derived buffers, not weights: old GPT-2 files carry the causal mask,
# old Llama files the RoPE inverse frequencies. They are skipped on import.
_DERIVED = (
    ".attn.bias",
    ".attn.masked_bias",
    ".rotary_emb.inv_freq",
    ".embeddings.position_ids",
)
# Written first and removed last by an export to an object store (see `export_hf`).
INCOMPLETE = ".meshtrain-export-incomplete"


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

    def need(key: str, ok: Callable[[Any], bool], allowed: str, default: Any = None) -> Any:
        value = config.get(key, default)
        if not ok(value):
            raise CheckpointError(
                f"HF config {key}={value!r} cannot be expressed in meshtrain (needs {allowed})"
            )
        return value

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
        need(
            "activation_function",
            lambda v: v in ("gelu_new", "gelu_pytorch_tanh"),
            "tanh-approximate GELU: 'gelu_new'",
            "gelu_new",
        )
        need("scale_attn_weights", lambda v: v is True, "true", True)
        need("scale_attn_by_inverse_layer_idx", lambda v: v is False, "false", False)
        if seq_length is not None:
            raise CheckpointError(
                "a sequence length applies to RoPE models; GPT-2's is its n_positions"
            )
        hidden = config["n_embd"]
        table = {
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
        model: the architecture.
        arch: the HF model_type (see `architecture`); None: the model's own.

    Raises:
        CheckpointError: the model maps to no HF architecture (or not to `arch`).
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
    h, v, ffn, d = model.hidden_size, model.vocab_size, model.ffn_size, model.head_dim
    heads, groups = model.num_attention_heads, model.groups
    per = heads // groups
    qkv_rows = (heads + 2 * groups) * d
    out: list[Rule] = []

    def same(ours: str, theirs: str, shape: tuple[int, ...]) -> None:
        out.append(Rule(ours, shape, (theirs,), (shape,), lambda t: [t], lambda ts: ts[0]))

    def transposed(ours: str, theirs: str, shape: tuple[int, int]) -> None:
        # GPT-2's Conv1D stores (in, out), the transpose of a Linear's (out, in).
        out.append(
            Rule(
                ours,
                shape,
                (theirs,),
                (shape[::-1],),
                lambda t: [t.t().contiguous()],
                lambda ts: ts[0].t().contiguous(),
            )
        )

    def split_qkv(t: torch.Tensor) -> list[torch.Tensor]:
        rest = t.shape[1:]
        g = t.reshape(groups, per + 2, d, *rest)  # (groups, per+2, head_dim, [hidden])
        return [
            g[:, :per].reshape(heads * d, *rest).contiguous(),
            g[:, per].reshape(groups * d, *rest).contiguous(),
            g[:, per + 1].reshape(groups * d, *rest).contiguous(),
        ]

    def fuse_qkv(ts: list[torch.Tensor]) -> torch.Tensor:
        q, k, vv = ts
        rest = q.shape[1:]
        parts = [
            q.reshape(groups, per, d, *rest),
            k.reshape(groups, 1, d, *rest),
            vv.reshape(groups, 1, d, *rest),
        ]
        return torch.cat(parts, dim=1).reshape(qkv_rows, *rest)  # per group: [q heads; k; v]

    suffixes = ("weight", "bias") if model.add_bias_linear else ("weight",)
    qkv_suffixes = ("weight", "bias") if model.add_bias_linear or model.qkv_bias else ("weight",)
    if arch in FAMILY:
        same("embedding.word_embeddings.weight", "model.embed_tokens.weight", (v, h))
        for i in range(model.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            same(ours + "input_norm.weight", theirs + "input_layernorm.weight", (h,))
            for s in qkv_suffixes:
                tail = (h,) if s == "weight" else ()
                out.append(
                    Rule(
                        ours + f"attention.qkv.{s}",
                        (qkv_rows, *tail),
                        tuple(theirs + f"self_attn.{p}_proj.{s}" for p in "qkv"),
                        ((heads * d, *tail), (groups * d, *tail), (groups * d, *tail)),
                        split_qkv,
                        fuse_qkv,
                    )
                )
            if model.qk_norm:  # Qwen3: one RMSNorm weight over head_dim each, shared by the heads
                same(ours + "attention.q_norm.weight", theirs + "self_attn.q_norm.weight", (d,))
                same(ours + "attention.k_norm.weight", theirs + "self_attn.k_norm.weight", (d,))
            for s in suffixes:
                same(
                    ours + f"attention.proj.{s}",
                    theirs + f"self_attn.o_proj.{s}",
                    (h, heads * d) if s == "weight" else (h,),
                )
            same(ours + "pre_mlp_norm.weight", theirs + "post_attention_layernorm.weight", (h,))
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
                same(
                    ours + f"mlp.fc2.{s}",
                    theirs + f"mlp.down_proj.{s}",
                    (h, ffn) if s == "weight" else (h,),
                )
        same("final_norm.weight", "model.norm.weight", (h,))
    else:
        same("embedding.word_embeddings.weight", "transformer.wte.weight", (v, h))
        same(
            "embedding.position_embeddings.weight",
            "transformer.wpe.weight",
            (model.max_positions, h),
        )
        for i in range(model.num_layers):
            ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
            same(ours + "input_norm.weight", theirs + "ln_1.weight", (h,))
            same(ours + "input_norm.bias", theirs + "ln_1.bias", (h,))
            # per == 1 here, so the per-group order is per head [q_h; k_h; v_h]; c_attn wants
            # [q; k; v] (and its weight transposed).
            out.append(
                Rule(
                    ours + "attention.qkv.weight",
                    (3 * h, h),
                    (theirs + "attn.c_attn.weight",),
                    ((h, 3 * h),),
                    lambda t: [torch.cat(split_qkv(t), dim=0).t().contiguous()],
                    lambda ts: fuse_qkv(list(ts[0].t().chunk(3, dim=0))).contiguous(),
                )
            )
            out.append(
                Rule(
                    ours + "attention.qkv.bias",
                    (3 * h,),
                    (theirs + "attn.c_attn.bias",),
                    ((3 * h,),),
                    lambda t: [torch.cat(split_qkv(t), dim=0)],
                    lambda ts: fuse_qkv(list(ts[0].chunk(3, dim=0))),
                )
            )
            transposed(ours + "attention.proj.weight", theirs + "attn.c_proj.weight", (h, h))
            same(ours + "attention.proj.bias", theirs + "attn.c_proj.bias", (h,))
            same(ours + "pre_mlp_norm.weight", theirs + "ln_2.weight", (h,))
            same(ours + "pre_mlp_norm.bias", theirs + "ln_2.bias", (h,))
            transposed(ours + "mlp.fc1.weight", theirs + "mlp.c_fc.weight", (ffn, h))
            same(ours + "mlp.fc1.bias", theirs + "mlp.c_fc.bias", (ffn,))
            transposed(ours + "mlp.fc2.weight", theirs + "mlp.c_proj.weight", (h, ffn))
            same(ours + "mlp.fc2.bias", theirs + "mlp.c_proj.bias", (h,))
        same("final_norm.weight", "transformer.ln_f.weight", (h,))
        same("final_norm.bias", "transformer.ln_f.bias", (h,))
    if model.untie_embeddings_and_output_weights:
        same("output_layer.weight", "lm_head.weight", (v, h))
    return out


def export_hf(
    src_root: str,
    dst_dir: str,
    step: int | None = None,
    tokenizer: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    arch: str | None = None,
) -> str:
    """Writes a training checkpoint as a Hugging Face model folder.

    Args:
        src_root: checkpoint root URL.
        dst_dir: the folder to create (local path or fsspec URL); it must not exist, unless it is
            what an interrupted export to an object store left (marked `INCOMPLETE`): replaced.
        step: the step; None exports the latest committed one.
        tokenizer: a `tokenizer.json` (or folder holding one) to ship instead of the run's.
        max_shard_size: bytes of tensor data per safetensors file (an int, or "5GB", "500MB",
            "2GiB"); a model over it is written in shards with `model.safetensors.index.json`.
        arch: the HF model_type to write ("mistral" for a Llama-shaped model); None: the
            imported model's (model.hf_model_type) while the settings fit it, else the one they
            name (see `architecture`).

    Returns:
        `dst_dir`.

    Raises:
        CheckpointError: the model maps to no HF architecture, a tensor is missing, unmapped,
            of the wrong shape or of mixed dtype, the run's tokenizer file is gone, or
            `dst_dir` exists. Nothing is left at `dst_dir` then.
    """
    source = open_source(src_root, step)
    step, where, manifest, specs, metadata, model = (
        source.step,
        source.where,
        source.manifest,
        source.specs,
        source.metadata,
        source.model,
    )
    limit = parse_size(max_shard_size)
    # An imported model exports as its source architecture while its settings still fit it
    # (checkpoints imported before model.hf_model_type existed name it in their metadata).
    origin = model.hf_model_type or (metadata.get("imported_from") or {}).get("architecture")
    if arch is None and origin is not None:
        try:
            arch = architecture(model, origin)
        except CheckpointError as e:
            log.warning(
                "%s: the model was imported from Hugging Face %r, which its settings no longer "
                "fit (%s); exporting as the architecture they name",
                where,
                origin,
                e,
            )
    plan = rules(model, arch)
    _check_tensors({r.ours: r.shape for r in plan}, specs, where, ignore=layout.NON_PARAMETER)
    dtypes = {specs[r.ours][1] for r in plan}
    if len(dtypes) != 1:
        raise CheckpointError(
            f"{where}: parameters have mixed dtypes {sorted(dtypes)}; "
            "convert to one with `ckpt convert --dtype` first"
        )
    dtype = dtypes.pop()
    spec = (
        tokenizer if tokenizer is not None else tokenizer_spec(src_root, step, metadata, manifest)
    )
    tokenizer_file = hf_tokenizer.tokenizer_file(spec, where)
    eod = hf_tokenizer.eod_id(tokenizer_file, spec, model, where)
    special, kept = _special_ids(model, tokenizer_file, eod, where)
    if model.hf_torch_dtype not in (None, dtype):
        log.warning(
            "%s: the weights are %s, the imported model's were %s: exporting them as %s "
            "(`meshtrain ckpt convert --dtype` casts a checkpoint first)",
            where,
            dtype,
            model.hf_torch_dtype,
            dtype,
        )

    dst = open_root(dst_dir)  # the checkpoint store's way in: fresh listings, the run's S3 endpoint
    fs, path = dst.fs, dst.path
    # A local folder is built beside its place and renamed into it in one step. An object store
    # has no rename (a move copies every object, model.safetensors's gigabytes included), so
    # there the files go straight to their place, config.json last: transformers starts from
    # it, so a folder holding it holds every file, and one left by a crash has none. There an
    # INCOMPLETE object, written first and removed last, marks the prefix as an export in
    # progress, so that one killed (SIGKILL, a lost machine) is told from someone's data, and
    # exporting again replaces it.
    marker = posixpath.join(path, INCOMPLETE)
    if fs.exists(path):
        if dst.is_local or not fs.exists(marker):
            raise CheckpointError(f"export destination {dst_dir!r} already exists")
        log.warning("%s: replacing the leftovers of an interrupted export", dst_dir)
        remove_tree(dst, path)
    out = local_build_dir(path) if dst.is_local else path
    if dst.is_local:
        for folder in remove_dead_builds(path):  # a killed export's, else never removed
            log.warning("removed %s, left by an export to %s that was killed", folder, dst_dir)
        fs.makedirs(out, exist_ok=True)  # object stores have no folders to make
    else:
        fs.pipe_file(marker, b"an export to this prefix began and has not finished\n")
    shards = plan_shards(
        ((n, shape) for r in plan for n, shape in zip(r.theirs, r.hf_shapes)), dtype, limit
    )

    def produced():  # (HF name, tensor) in the plan's order, one meshtrain tensor read at a time
        for rule in plan:
            yield from zip(
                rule.theirs, rule.to_hf(read_tensor(src_root, step, rule.ours, manifest=manifest))
            )

    try:
        write_shards(fs, out, shards, dtype, produced())
        config = {**hf_config(model, dtype, eod, arch), **special}
        files = {}
        generation = {k: v for k, v in special.items() if v is not None}
        if generation:
            # transformers 5 takes generate()'s stopping ids from here only, not config.json.
            files["generation_config.json"] = generation
        if tokenizer_file is not None:
            fs.put_file(str(tokenizer_file), posixpath.join(out, "tokenizer.json"))
            template = hf_tokenizer.chat_template_file(tokenizer_file)
            if template is not None:
                fs.put_file(str(template), posixpath.join(out, "chat_template.jinja"))
            files["tokenizer_config.json"] = hf_tokenizer.tokenizer_config(
                tokenizer_file, model, where, special if kept else None
            )
        files["config.json"] = config  # last
        for name, content in files.items():
            fs.pipe_file(posixpath.join(out, name), json.dumps(content, indent=2).encode())
        if dst.is_local:
            fs.mv(out, path, recursive=True)
        else:
            fs.rm_file(marker)
    except BaseException:
        # Nothing half-written is left, in place or beside it (closing the failed write uploaded
        # what it had), nor the folder marker SeaweedFS keeps for every prefix written.
        remove_tree(dst, out)
        if not dst.is_local:
            try:
                fs.rm_file(out + "/")
            except FileNotFoundError:
                pass
        raise
    log.info(
        "exported %s to %s (%s, %s, %d safetensors file%s)",
        where,
        dst_dir,
        config["architectures"][0],
        dtype,
        len(shards),
        "" if len(shards) == 1 else "s",
    )
    return dst_dir


def _special_ids(
    model: ModelConfig, tokenizer_file: Path | None, eod: int | None, where: str
) -> tuple[dict[str, Any], bool]:
    """The special-token ids of an export's config.json, and whether they are the imported ones.

    An imported model keeps its config's bos/eos/pad ids (model.hf_*_token_id) while the
    tokenizer shipped is the one imported with it (model.hf_tokenizer_sha256; an import without
    a tokenizer.json keeps them whatever the tokenizer). Otherwise the tokenizer's end of
    document is both bos and eos (None too: a missing key means HF's own default, some other
    token here).
    """
    own = {"bos_token_id": eod, "eos_token_id": eod}
    if model.hf_model_type is None:
        return own, False
    if model.hf_tokenizer_sha256 is not None:
        digest = None
        if tokenizer_file is not None:
            digest = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
        if digest != model.hf_tokenizer_sha256:
            log.info(
                "%s: the tokenizer is not the one imported with the model: its end of document "
                "(%s) is written as bos and eos, not the imported ids",
                where,
                eod,
            )
            return own, False
    ids = {"bos_token_id": model.hf_bos_token_id, "eos_token_id": model.hf_eos_token_id}
    if model.hf_pad_token_id is not None:
        ids["pad_token_id"] = model.hf_pad_token_id
    return ids, True


def import_hf(
    src_dir: str,
    dst_root: str,
    seed: int = 1234,
    seq_length: int | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    vision_tower: str | None = None,
    vision: dict[str, Any] | None = None,
) -> str:
    """Writes a Hugging Face model folder as a step-0 meshtrain training checkpoint.

    The checkpoint holds the weights, `metadata.config` (a whole job config whose model
    section comes from `config.json`), no optimizer state (`optimizer_step` 0), and RNG states
    seeded with `seed`, which is what `checkpoint_restore.restore` needs to continue training.

    Args:
        src_dir: local folder with `config.json` and `model.safetensors` (or a sharded
            `model.safetensors.index.json`), or a repo id (`org/name`) or `models--org--name`
            folder of the Hugging Face cache, read offline (`files.model_folder`).
        dst_root: checkpoint root URL, holding no committed checkpoint.
        seed: seeds the stored RNG states.
        seq_length: the model's sequence length (RoPE models); None: max_position_embeddings.
        revision: a cached branch, tag or commit of a repo id; None: main.
        cache_dir: the hub cache; None: HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub.
        vision_tower: a CLIPVisionModel or SiglipVisionModel folder (or cached repo id) to put
            in front of the language model `src_dir`: the checkpoint is then a LLaVA-style model
            whose projector is new (initialized from `seed`), ready for LLaVA's first stage.
        vision: with `vision_tower`, the model.vision keys the tower does not fix
            (image_token_id, which must be a token of the language model's vocabulary;
            select_layer, select_feature, projector, projector_bias).

    Returns:
        The URL of the committed checkpoint.

    Raises:
        CheckpointError: the source is not found, the config cannot be expressed, a tensor is
            missing, unmapped or of the wrong shape or mixed dtype, or `dst_root` already holds a
            committed checkpoint (of any step: `train --load` would resume the latest, not step 0).
    """
    src = model_folder(src_dir, revision, cache_dir)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{src}: no config.json, so not a Hugging Face model folder")
    hf = read_json(config_path)
    model = model_from_hf(hf, seq_length)
    tower_src = None
    if vision_tower is not None:
        if model.vision is not None:
            raise CheckpointError(f"{src} has a vision tower already (model_type 'llava')")
        tower_src = model_folder(vision_tower, revision, cache_dir)
        if not (tower_src / "config.json").is_file():
            raise CheckpointError(
                f"{tower_src}: no config.json, so not a Hugging Face model folder"
            )
        if vision is None or "image_token_id" not in vision:
            raise CheckpointError(
                "a vision tower needs vision={'image_token_id': ...}: the placeholder token of "
                "the language model's vocabulary that image features take the place of"
            )
        encoder = llava.vision_from_hf(read_json(tower_src / "config.json"), **vision)
        try:
            model = dataclasses.replace(model, vision=encoder, hf_model_type="llava")
        except ValueError as e:
            raise CheckpointError(f"{tower_src} with {src}: {e}") from e
    elif vision is not None:
        raise CheckpointError("vision= settings apply with vision_tower= only")
    existing = list_checkpoints(dst_root)
    if existing:
        # Step 0 would be passed over by `train --load`, which resumes the latest step.
        raise CheckpointError(
            f"{dst_root!r} already holds committed checkpoints "
            f"{existing[:5]}{' ...' if len(existing) > 5 else ''}: "
            "`meshtrain train --load` would resume the latest of them, not the import (step 0); "
            "import into an empty root"
        )
    kind = "llava" if model.vision is not None else hf["model_type"]  # one `architecture` names
    plan = rules(model, kind)
    gpt2 = kind == "gpt2"

    def canonical(name: str) -> str:
        # Old GPT-2 files name tensors without the "transformer." prefix.
        if gpt2 and not name.startswith(("transformer.", "lm_head.")):
            return f"transformer.{name}"
        if kind != "llava":
            return name
        if tower_src is not None:  # a language model's file, named as in a LLaVA one
            return llava.text_name(name)
        return llava.canonical(name)

    # HF name -> (the safetensors file's handle, the name there), over the source folders
    stored: dict[str, tuple[Any, str]] = {}
    sources = [(src, canonical)]
    if tower_src is not None:
        sources.append((tower_src, llava.tower_name))
    for folder, rename in sources:
        files = safetensors_files(folder)
        missing = sorted(f for f in set(files.values()) if not (folder / f).is_file())
        if missing:
            raise CheckpointError(
                f"{folder}: the safetensors index names files that are not there: {missing}"
            )
        handles = {f: open_safetensors(folder / f) for f in set(files.values())}
        for n, f in files.items():
            if n.endswith(_DERIVED):
                continue
            if n not in handles[f].keys():  # noqa: SIM118 (not a dict)
                raise CheckpointError(
                    f"{folder}: model.safetensors.index.json puts tensor {n!r} in {f}, which "
                    "does not hold it (a shard from another download?)"
                )
            stored[rename(n)] = (handles[f], n)
    found: dict[str, TensorSpec] = {}
    for name, (handle, original) in stored.items():
        tensor_slice = handle.get_slice(original)
        dtype = LOGICAL.get(tensor_slice.get_dtype())
        if dtype is None:
            raise CheckpointError(
                f"{src}: tensor {original!r} has unsupported dtype {tensor_slice.get_dtype()}"
            )
        found[name] = (tuple(tensor_slice.get_shape()), dtype)
    head = "language_model.lm_head.weight" if kind == "llava" else "lm_head.weight"
    if not model.untie_embeddings_and_output_weights:
        found.pop(head, None)  # tied: HF ignores a stored copy, so do we
    dropped = [n for n in found if n.startswith(llava.SIGLIP_HEAD)]
    if dropped:  # SigLIP's pooling head: no part of a LLaVA model
        log.info(
            "%s: SigLIP's attention-pooling head (%d tensors) is not imported", src, len(dropped)
        )
        for n in dropped:
            del found[n]
    fresh: dict[str, torch.Tensor] = {}
    if tower_src is not None:  # a new projector, between a tower and a language model
        fresh = llava.fresh_projector(model, seed)
        found.update({r.theirs[0]: (r.shape, None) for r in plan if r.ours in fresh})
    wanted = {t: s for r in plan for t, s in zip(r.theirs, r.hf_shapes)}
    _check_tensors(wanted, found, f"HF folder {src}", ignore=())
    dtypes = {found[t][1] for t in wanted} - {None}
    if len(dtypes) != 1:
        raise CheckpointError(f"HF folder {src}: tensors have mixed dtypes {sorted(dtypes)}")
    dtype = dtypes.pop()

    def read_hf(name: str) -> torch.Tensor:
        handle, original = stored[name]
        return handle.get_tensor(original)

    by_ours = {r.ours: r for r in plan}

    tokenizer = src / "tokenizer.json"
    # the folder resolved, not the file: in the hub cache the file is a link to a blob
    tokenizer_path = str(src.resolve() / "tokenizer.json") if tokenizer.is_file() else None
    if tokenizer_path is not None:  # the tokenizer the special-token ids belong to
        digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
        model = dataclasses.replace(model, hf_tokenizer_sha256=digest)
    carried, record = tokenizer_boxes(tokenizer_path)  # the checkpoint carries the file itself
    carried_tensors = {box.array: tensor for box, tensor in carried}

    def load(name: str) -> torch.Tensor:
        if name == "rng.torch_cpu":
            return torch.Generator().manual_seed(seed).get_state()
        if name in carried_tensors:
            return carried_tensors[name]
        if name in fresh:
            return fresh[name].to(layout.torch_dtype(dtype))
        rule = by_ours[name]
        return rule.from_hf([read_hf(t) for t in rule.theirs]).contiguous()

    specs: dict[str, TensorSpec] = {r.ours: (r.shape, dtype) for r in plan}
    specs["rng.torch_cpu"] = (tuple(torch.get_rng_state().shape), "uint8")
    specs.update({box.array: (box.global_shape, box.dtype) for box, _ in carried})
    np_state = np.random.RandomState(seed).get_state()
    metadata = {
        "format": TRAIN_FORMAT,
        "iteration": 0,
        "consumed_samples": 0,
        "optimizer_step": 0,
        "config": {"model": to_dict(model)},  # an import has an architecture, no training settings
        "rng_python": random.Random(seed).getstate(),
        "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "tokenizer": tokenizer_path,
        **({METADATA_KEY: record} if record else {}),
        "imported_from": {
            "url": str(src.resolve()),
            "format": "hf",
            "architecture": kind,
            **({"vision_tower": str(tower_src.resolve())} if tower_src is not None else {}),
        },
    }
    url, _ = save_streaming(dst_root, 0, specs, load, metadata, desc="import")
    return url


def _check_tensors(
    wanted: dict[str, tuple[int, ...]],
    have: dict[str, TensorSpec],
    where: str,
    ignore: tuple[str, ...],
) -> None:
    """Raises CheckpointError naming missing, misshapen and unmapped tensors."""
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise CheckpointError(
            f"{where}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    wrong = [
        f"{n} is {have[n][0]}, expected {s}"
        for n, s in wanted.items()
        if tuple(have[n][0]) != tuple(s)
    ]
    if wrong:
        raise CheckpointError(f"{where}: wrong shapes: {'; '.join(wrong[:5])}")
    unmapped = sorted(n for n in have if n not in wanted and not (ignore and n.startswith(ignore)))
    if unmapped:
        raise CheckpointError(f"{where}: tensors with no mapping {unmapped[:5]}")
