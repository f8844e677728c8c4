"""The trainer's command line: `--config FILE`, `--section.key=value` overrides and Megatron-LM's
flags.

`parse_overrides` turns the words after `meshtrain train` into (config file, nested override
table); `load.load_config` merges that table over the defaults and the file.

    parse_overrides(["--config", "a.toml", "--hidden-size", "768", "--train.bf16=true"])
    # -> ("a.toml", {"model": {"hidden_size": 768}, "train": {"bf16": True}})
"""

from __future__ import annotations

import ast
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from meshtrain.services.common import config as cfg
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.megatron import NO_EFFECT, classify

log = logging.getLogger("meshtrain.config")

# Megatron-LM flag -> (dotted key, takes a value). Flags without a value set a bool to true.
ALIASES: dict[str, tuple[str, bool]] = {
    "--num-layers": ("model.num_layers", True),
    "--hidden-size": ("model.hidden_size", True),
    "--num-attention-heads": ("model.num_attention_heads", True),
    "--num-query-groups": ("model.num_query_groups", True),
    "--kv-channels": ("model.kv_channels", True),
    "--add-qkv-bias": ("model.qkv_bias", False),
    "--qk-layernorm": ("model.qk_norm", False),
    "--ffn-hidden-size": ("model.ffn_hidden_size", True),
    "--seq-length": ("model.seq_length", True),
    "--max-position-embeddings": ("model.max_position_embeddings", True),
    "--vocab-size": ("model.vocab_size", True),
    "--make-vocab-size-divisible-by": ("model.make_vocab_size_divisible_by", True),
    "--normalization": ("model.normalization", True),
    "--norm-epsilon": ("model.norm_epsilon", True),
    "--position-embedding-type": ("model.position_embedding_type", True),
    "--rotary-base": ("model.rotary_base", True),
    "--init-method-std": ("model.init_method_std", True),
    "--hidden-dropout": ("model.hidden_dropout", True),
    "--attention-dropout": ("model.attention_dropout", True),
    "--attention-backend": ("model.attention_backend", True),
    "--fp32-residual-connection": ("model.fp32_residual_connection", False),
    "--swiglu": ("model.activation=swiglu", False),
    "--disable-bias-linear": ("model.add_bias_linear=false", False),
    "--untie-embeddings-and-output-weights": ("model.untie_embeddings_and_output_weights", False),
    "--num-experts": ("model.num_experts", True),
    "--moe-layer-freq": ("model.moe_layer_freq", True),
    "--moe-ffn-hidden-size": ("model.moe_ffn_hidden_size", True),
    "--moe-router-topk": ("model.moe_router_topk", True),
    "--moe-router-score-function": ("model.moe_router_score_function", True),
    "--moe-router-pre-softmax": ("model.moe_router_pre_softmax", False),
    "--moe-router-topk-scaling-factor": ("model.moe_router_topk_scaling_factor", True),
    "--moe-aux-loss-coeff": ("model.moe_aux_loss_coeff", True),
    "--moe-z-loss-coeff": ("model.moe_z_loss_coeff", True),
    "--moe-expert-capacity-factor": ("model.moe_expert_capacity_factor", True),
    "--moe-token-drop-policy": ("model.moe_token_drop_policy", True),
    "--moe-router-enable-expert-bias": ("model.moe_router_enable_expert_bias", False),
    "--moe-router-bias-update-rate": ("model.moe_router_bias_update_rate", True),
    "--moe-shared-expert-intermediate-size": ("model.moe_shared_expert_intermediate_size", True),
    "--moe-shared-expert-gate": ("model.moe_shared_expert_gate", False),
    "--moe-grouped-gemm": ("model.moe_grouped_gemm", False),
    # aux_loss: the load-balancing loss of model.moe_aux_loss_coeff; none: that coefficient 0
    "--moe-router-load-balancing-type": ("model.moe_aux_loss_coeff", True),
    "--data-path": ("data.data_path", True),
    "--data-service-addresses": ("data.service_addresses", True),
    "--tokenizer": ("data.tokenizer", True),
    "--tokenizer-type": ("data.tokenizer_type", True),
    "--vocab-file": ("data.vocab_file", True),
    "--merge-file": ("data.merge_file", True),
    "--tokenizer-model": ("data.tokenizer_model", True),
    "--tiktoken-pattern": ("data.tiktoken_pattern", True),
    "--tiktoken-num-special-tokens": ("data.tiktoken_num_special_tokens", True),
    "--split": ("data.split", True),
    "--data-cache-path": ("data.cache_dir", True),
    "--eod-mask-loss": ("data.eod_mask_loss", False),
    "--reset-attention-mask": ("data.reset_attention_mask", False),
    "--reset-position-ids": ("data.reset_position_ids", False),
    "--sft": ("data.format=sft", False),
    "--micro-batch-size": ("train.micro_batch_size", True),
    "--batch-size": ("train.micro_batch_size", True),  # Megatron's old name of --micro-batch-size
    "--global-batch-size": ("train.global_batch_size", True),
    "--train-iters": ("train.train_iters", True),
    "--eval-interval": ("train.eval_interval", True),
    "--eval-iters": ("train.eval_iters", True),
    "--seed": ("train.seed", True),
    "--bf16": ("train.bf16", False),
    "--fp8-format": ("train.fp8", True),
    "--fp8-recipe": ("train.fp8_recipe", True),
    "--fp8-margin": ("train.fp8_margin", True),
    "--fp8-amax-history-len": ("train.fp8_amax_history_len", True),
    "--fp8-amax-compute-algo": ("train.fp8_amax_compute_algo", True),
    "--first-last-layers-bf16": ("train.fp8_bf16_first_last", False),
    "--num-layers-at-start-in-bf16": ("train.fp8_bf16_layers_at_start", True),
    "--num-layers-at-end-in-bf16": ("train.fp8_bf16_layers_at_end", True),
    "--gradient-accumulation-fusion": ("train.gradient_accumulation_fusion", False),
    "--no-gradient-accumulation-fusion": ("train.gradient_accumulation_fusion=false", False),
    "--lr": ("optim.lr", True),
    "--min-lr": ("optim.min_lr", True),
    "--lr-warmup-iters": ("optim.lr_warmup_iters", True),
    "--lr-decay-iters": ("optim.lr_decay_iters", True),
    "--lr-decay-style": ("optim.lr_decay_style", True),
    "--lr-warmup-fraction": ("optim.lr_warmup_fraction", True),
    "--lr-wsd-decay-style": ("optim.lr_wsd_decay_style", True),
    "--lr-wsd-decay-iters": ("optim.lr_wsd_decay_iters", True),
    "--weight-decay": ("optim.weight_decay", True),
    "--adam-beta1": ("optim.adam_beta1", True),
    "--adam-beta2": ("optim.adam_beta2", True),
    "--adam-eps": ("optim.adam_eps", True),
    "--clip-grad": ("optim.clip_grad", True),
    "--optimizer-cpu-offload": ("optim.optimizer_cpu_offload", False),
    "--overlap-cpu-optimizer-d2h-h2d": ("optim.overlap_cpu_optimizer_d2h_h2d", False),
    "--tensor-model-parallel-size": ("parallel.tp", True),
    "--pipeline-model-parallel-size": ("parallel.pp", True),
    "--virtual-pipeline-model-parallel-size": (
        "parallel.virtual_pipeline_model_parallel_size",
        True,
    ),
    "--num-layers-per-virtual-pipeline-stage": (
        "parallel.num_layers_per_virtual_pipeline_stage",
        True,
    ),
    "--decoder-first-pipeline-num-layers": ("parallel.decoder_first_pipeline_num_layers", True),
    "--decoder-last-pipeline-num-layers": ("parallel.decoder_last_pipeline_num_layers", True),
    "--context-parallel-size": ("parallel.cp", True),
    "--cp-comm-type": ("parallel.cp_comm_type", True),
    "--hierarchical-context-parallel-sizes": ("parallel.hierarchical_context_parallel_sizes", True),
    "--expert-model-parallel-size": ("parallel.ep", True),
    "--expert-tensor-parallel-size": ("parallel.expert_tensor_parallel_size", True),
    "--sequence-parallel": ("parallel.sequence_parallel", False),
    # Megatron-LM's multimodal example (examples/multimodal): LLaVA's freezing stages
    "--freeze-LM": ("train.freeze_language_model", False),
    "--freeze-ViT": ("train.freeze_vision", False),
    "--tp-comm-overlap": ("parallel.tp_comm_overlap", False),
    "--distributed-timeout-minutes": ("parallel.distributed_timeout_minutes", True),
    "--use-distributed-optimizer": ("parallel.use_distributed_optimizer", False),
    "--use-torch-fsdp2": ("parallel.use_torch_fsdp2", False),
    "--data-parallel-sharding-strategy": ("parallel.data_parallel_sharding_strategy", True),
    "--data-parallel-replicate-degree": ("parallel.dp_replicate", True),
    "--data-parallel-shard-degree": ("parallel.dp_shard", True),
    "--overlap-grad-reduce": ("parallel.overlap_grad_reduce", False),
    "--overlap-param-gather": ("parallel.overlap_param_gather", False),
    "--ddp-bucket-size": ("parallel.ddp_bucket_size", True),
    "--grad-reduce-in-bf16": ("parallel.grad_reduce_dtype=bf16", False),
    "--recompute-granularity": ("parallel.recompute_granularity", True),
    "--recompute-activations": ("parallel.recompute_granularity=selective", False),
    "--checkpoint-activations": (
        "parallel.recompute_granularity=full",
        False,
    ),  # Megatron's old name
    "--recompute-method": ("parallel.recompute_method", True),
    "--recompute-num-layers": ("parallel.recompute_num_layers", True),
    "--save": ("checkpoint.save", True),
    "--load": ("checkpoint.load", True),
    "--save-interval": ("checkpoint.save_interval", True),
    "--ckpt-step": ("checkpoint.load_step", True),
    "--finetune": ("checkpoint.finetune", False),
    "--no-load-optim": ("checkpoint.load_optim=false", False),
    "--no-load-rng": ("checkpoint.load_rng=false", False),
    "--async-save": ("checkpoint.async_save", False),
    "--run-dir": ("log.run_dir", True),
    "--log-interval": ("log.log_interval", True),
    "--tensorboard-dir": ("log.tensorboard_dir", True),
    "--wandb-project": ("log.wandb_project", True),
    "--wandb-exp-name": ("log.wandb_exp_name", True),
    "--wandb-save-dir": ("log.wandb_save_dir", True),
    "--wandb-entity": ("log.wandb_entity", True),
}

# Megatron flags taking one or more words (nargs="+"); those of _STRING_LISTS stay strings.
_MULTI_WORD = {"--data-path", "--data-service-addresses", "--hierarchical-context-parallel-sizes"}
_STRING_LISTS = {"data.data_path", "data.service_addresses"}

# Keys whose values are strings even when they look like numbers or booleans.
_STRING_KEYS = {
    "data.tokenizer",
    "data.split",
    "checkpoint.save",
    "checkpoint.load",
    "log.run_dir",
    "data.tokenizer_type",
    "data.vocab_file",
    "data.merge_file",
    "data.tokenizer_model",
    "data.tiktoken_pattern",
    "data.cache_dir",
    "log.tensorboard_dir",
    "log.wandb_project",
    "log.wandb_exp_name",
    "log.wandb_save_dir",
    "log.wandb_entity",
}

# Tokenizer types whose vocabulary Megatron's --vocab-size gives; with one of them named by
# --tokenizer-type, --vocab-size is the tokenizer's (data.vocab_size) and the model's vocabulary
# follows from it, as in Megatron, rather than model.vocab_size.
_VOCAB_SIZE_TOKENIZERS = ("NullTokenizer", "TikTokenizer")


# Megatron spellings of choice values -> ours.
_VALUE_SPELLINGS = {
    "LayerNorm": "layernorm",
    "RMSNorm": "rmsnorm",
    "learned_absolute": "learned",
    "WSD": "wsd",
}
# ... and per key: Megatron's attention backends (Transformer Engine's fused attention is cuDNN's).
_KEY_SPELLINGS = {"model.attention_backend": {"fused": "cudnn", "unfused": "math", "local": "math"}}

# Megatron's sample-counted flags -> the iteration-counted key each becomes
# (samples / global batch).
_SAMPLE_FLAGS = {
    "--train-samples": "train.train_iters",
    "--lr-decay-samples": "optim.lr_decay_iters",
    "--lr-warmup-samples": "optim.lr_warmup_iters",
    "--lr-wsd-decay-samples": "optim.lr_wsd_decay_iters",
}

# Flags accepted with one value only: (that value, why no other is).
_ONLY_VALUE = {
    "--rotary-percent": (1.0, "rotary embeddings cover the whole head (partial RoPE is not built)")
}


_PYTHON_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?")

_LIST_LIMIT = 100_000
"""Most entries a --moe-layer-freq expression may build (a layer list; bounds `[1]*10**12`)."""


def parse_layer_freq(text: str) -> int | list[int]:
    """--moe-layer-freq: an int (every k-th block is MoE), a list of 0/1 per block, or Megatron's
    Python-like expression of lists such as `([1]*3+[0])*2` (read without eval: only integers,
    lists, parentheses, + of lists and * of a list by an integer).

    Raises:
        ConfigError: naming the flag and what in the text is not allowed.
    """
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise ConfigError(
            f"--moe-layer-freq={text!r} is neither an integer, a list nor a list expression "
            "such as ([1]*3+[0])*2"
        ) from None

    def value(node: ast.AST) -> int | list[int]:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(e) for e in node.elts]
            ints = [v for v in items if isinstance(v, int)]
            if len(ints) != len(items):
                raise ConfigError(
                    f"--moe-layer-freq={text!r}: lists hold integers only (no nested lists)"
                )
            return ints
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                if isinstance(left, list) and isinstance(right, list):
                    return _bounded(left + right)
                raise ConfigError(f"--moe-layer-freq={text!r}: + joins two lists")
            if isinstance(left, int) and isinstance(right, list):
                left, right = right, left
            if isinstance(left, list) and isinstance(right, int):
                if right < 0 or len(left) * right > _LIST_LIMIT:
                    raise ConfigError(f"--moe-layer-freq={text!r}: a list repeated {right} times")
                return left * right
            raise ConfigError(f"--moe-layer-freq={text!r}: * repeats a list by an integer")
        raise ConfigError(
            f"--moe-layer-freq={text!r}: only integers, lists, + and * are allowed, "
            f"not {ast.unparse(node)!r}"
        )

    def _bounded(items: list[int]) -> list[int]:
        if len(items) > _LIST_LIMIT:
            raise ConfigError(f"--moe-layer-freq={text!r} builds more than {_LIST_LIMIT} entries")
        return items

    return value(tree)


def _value_for(key: str, text: str) -> Any:
    text = _KEY_SPELLINGS.get(key, {}).get(text, _VALUE_SPELLINGS.get(text, text))
    if key in _STRING_KEYS:
        return text
    if key == "model.moe_layer_freq":
        return parse_layer_freq(text)
    if key in ("data.data_path", "data.service_addresses"):
        return cfg.parse_value(text) if text.lstrip().startswith("[") else [text]
    value = cfg.parse_value(text)
    if isinstance(value, str) and _PYTHON_FLOAT.fullmatch(text):
        return float(text)  # Megatron's argparse reads Python numbers: .001 and 1. are not TOML
    return value


def parse_overrides(args: list[str]) -> tuple[str | None, dict[str, Any]]:
    """Turn command-line words into (config file, nested override table).

    Accepts `--config FILE`, `--section.key=value` / `--section.key value`, the Megatron
    aliases in `ALIASES`, and the Megatron flags of `megatron.py`: those without effect here
    are accepted with a warning, those of features meshtrain does not have are refused, every one
    of them named in one error. `--data-path` takes one or more words, like Megatron's.

    Raises:
        ConfigError: for an unknown or refused flag, or a flag missing its value.
    """
    words = _Words(args)
    parsed = _Parsed()
    while words.next_flag():
        _read_flag(words, parsed)
    if parsed.refused:
        lines = "\n".join(f"  {flag}: {why}" for flag, why in parsed.refused.items())
        raise ConfigError(
            f"{len(parsed.refused)} Megatron-LM flag(s) of features meshtrain does not have "
            f"(remove them to go on):\n{lines}"
        )
    _apply_deferred(parsed.table, parsed.deferred)
    return parsed.config_file, parsed.table


class _Words:
    """The command line read left to right: the current flag, then the word(s) of its value."""

    def __init__(self, args: list[str]) -> None:
        self._args = args
        self._i = -1
        self.name = ""
        """The current flag, without its `=value`."""
        self.inline: str | None = None
        """The value written `--flag=value`; None when the flag has no `=`."""

    def next_flag(self) -> bool:
        """Step to the next flag; False at the end of the words."""
        self._i += 1
        if self._i >= len(self._args):
            return False
        word = self._args[self._i]
        if not word.startswith("--"):
            raise ConfigError(
                f"unexpected argument {word!r}; overrides look like --section.key=value"
            )
        self.name, eq, inline = word.partition("=")
        self.inline = inline if eq else None
        return True

    def _next_is_value(self) -> bool:
        return self._i + 1 < len(self._args) and not self._args[self._i + 1].startswith("--")

    def value(self) -> str:
        """The flag's one value: after its `=`, else the next word."""
        if self.inline is not None:
            return self.inline
        if not self._next_is_value():
            raise ConfigError(f"{self.name} needs a value")
        self._i += 1
        return self._args[self._i]

    def values(self) -> list[str]:
        """The flag's value after its `=`, else every word up to the next flag (maybe none)."""
        if self.inline is not None:
            return [self.inline]
        words = []
        while self._next_is_value():
            self._i += 1
            words.append(self._args[self._i])
        return words

    def switch(self) -> None:
        """Refuse a value given to a flag that takes none."""
        if self.inline is not None:
            raise ConfigError(f"{self.name} is a switch and takes no value")


@dataclass
class _Parsed:
    """What the words have said so far."""

    config_file: str | None = None
    table: dict[str, Any] = field(default_factory=dict)
    """The nested override table."""
    deferred: dict[str, Any] = field(default_factory=dict)
    """Flags applied once every word is read (they depend on others): `_apply_deferred`."""
    refused: dict[str, str] = field(default_factory=dict)
    """Flags of features meshtrain does not have -> why, refused together at the end."""


def _read_flag(words: _Words, parsed: _Parsed) -> None:
    """Read the current flag (and its value) into `parsed`."""
    name = words.name
    known = classify(name) if name not in ALIASES else None
    if name == "--config":
        parsed.config_file = words.value()
    elif name in _DEFERRED_SWITCHES:
        words.switch()
        parsed.deferred[name] = True
    elif name in _DEFERRED_VALUES:
        parsed.deferred[name] = words.value()
    elif name in _ONLY_VALUE:
        value, why = _ONLY_VALUE[name]
        given = cfg.parse_value(words.value())
        if given != value:
            parsed.refused[name] = f"only {value} is accepted: {why}"
    elif name in ALIASES:
        _read_alias(words, parsed.table)
    elif known is not None:
        _read_megatron_flag(words, known, parsed.refused)
    elif "." in name[2:]:
        key = name[2:].replace("-", "_")
        cfg.set_dotted(parsed.table, key, _value_for(key, words.value()))
    else:
        near = cfg.close_matches(
            name, ["--config", *ALIASES, *_DEFERRED_SWITCHES, *_DEFERRED_VALUES]
        )
        hint = (
            f"did you mean {' or '.join(near)}?"
            if near
            else "use --section.key=value (see --help-config for the keys and aliases)"
        )
        raise ConfigError(f"unknown flag {name}; {hint}")


def _read_alias(words: _Words, table: dict[str, Any]) -> None:
    """A flag of `ALIASES`: set the key it stands for."""
    target, has_value = ALIASES[words.name]
    if not has_value:
        words.switch()
        key, _, fixed = target.partition("=")
        cfg.set_dotted(table, key, cfg.parse_value(fixed) if fixed else True)
    elif words.name in _MULTI_WORD and words.inline is None:
        values = words.values()
        if not values:
            raise ConfigError(f"{words.name} needs a value")
        cfg.set_dotted(
            table,
            target,
            values if target in _STRING_LISTS else [cfg.parse_value(w) for w in values],
        )
    else:
        cfg.set_dotted(table, target, _value_for(target, words.value()))


def _read_megatron_flag(words: _Words, known: tuple[str, str], refused: dict[str, str]) -> None:
    """A Megatron flag of `megatron.py`: accepted with a warning when it has no effect here,
    else noted in `refused` (with its value, if any, read past)."""
    kind, why = known
    if kind == "no_effect":
        if NO_EFFECT[words.name][0]:
            words.value()
        else:
            words.switch()
        log.warning("%s: accepted without effect: %s", words.name, why)
    else:
        words.values()
        refused[words.name] = f"meshtrain has {why}" if why.startswith("no ") else why


# Megatron flags whose meaning depends on other flags of the command line (`_apply_deferred`).
_DEFERRED_SWITCHES = ("--group-query-attention", "--use-rope-scaling", "--openai-gelu")
_DEFERRED_VALUES = ("--moe-router-load-balancing-type", "--rope-scaling-factor", *_SAMPLE_FLAGS)


def accepted_flags() -> list[str]:
    """Every Megatron flag that sets a key here (for `--help-config`)."""
    return sorted({*ALIASES, *_DEFERRED_SWITCHES, *_DEFERRED_VALUES, *_ONLY_VALUE})


def _apply_deferred(table: dict[str, Any], flags: dict[str, Any]) -> None:
    """Apply the Megatron flags that read other flags of the same command line."""
    model, data = (
        table.setdefault("model", {}),
        table.setdefault("data", {}),
    )  # empty ones dropped at the end
    if data.get("tokenizer_type") in _VOCAB_SIZE_TOKENIZERS and "vocab_size" in model:
        cfg.set_dotted(table, "data.vocab_size", model.pop("vocab_size"))
    if "vocab_file" in data and "merge_file" in data and "tokenizer_type" not in data:
        # Megatron's GPT-3 example names no type; the one type that reads a merge file is
        # GPT-2's BPE
        log.warning(
            "--vocab-file and --merge-file without --tokenizer-type: GPT2BPETokenizer, the "
            "tokenizer that reads both"
        )
        data["tokenizer_type"] = "GPT2BPETokenizer"
    for key in ("tiktoken_pattern", "tiktoken_num_special_tokens"):  # read by TikTokenizer alone
        if key in data and data.get("tokenizer_type", "TikTokenizer") != "TikTokenizer":
            log.warning(
                "--%s applies to --tokenizer-type TikTokenizer: not used with %s "
                "(Megatron-LM ignores it too)",
                key.replace("_", "-"),
                data["tokenizer_type"],
            )
            del data[key]
    # meshtrain's GELU is the tanh approximation, which --openai-gelu asks for.
    if flags.get("--openai-gelu"):
        if model.get("activation", "gelu") != "gelu":
            raise ConfigError(
                f"--openai-gelu asks for a GELU MLP, but model.activation={model['activation']!r} "
                "(--swiglu) for another: give one of them"
            )
        model["activation"] = "gelu"
    # Megatron reads --num-query-groups (default 1) only with --group-query-attention.
    if flags.get("--group-query-attention"):
        model.setdefault("num_query_groups", 1)
    elif "num_query_groups" in model:
        log.warning(
            "--num-query-groups=%s without --group-query-attention: applied here, where "
            "Megatron-LM would ignore it (multi-head attention)",
            model["num_query_groups"],
        )
    if "--rope-scaling-factor" in flags and not flags.get("--use-rope-scaling"):
        raise ConfigError(
            "--rope-scaling-factor applies with --use-rope-scaling (Megatron-LM ignores it "
            "otherwise): add --use-rope-scaling, or remove the factor"
        )
    if flags.get("--use-rope-scaling"):  # Megatron's default factor: 8 (Llama 3.1)
        model["rope_scaling_factor"] = cfg.parse_value(flags.get("--rope-scaling-factor", "8.0"))
    # Megatron turns sequence parallelism off at tensor-parallel size 1 (nothing to split over).
    if table.get("parallel", {}).get("sequence_parallel") and table["parallel"].get("tp") == 1:
        log.warning(
            "--sequence-parallel with --tensor-model-parallel-size 1: off, as in Megatron-LM"
        )
        del table["parallel"]["sequence_parallel"]
    _apply_sample_counts(table, flags)
    balancing = flags.get("--moe-router-load-balancing-type")
    if balancing is not None and balancing not in ("aux_loss", "none"):
        raise ConfigError(
            f"--moe-router-load-balancing-type={balancing!r} is not supported: 'aux_loss' "
            "(the load-balancing loss over the global micro-batch, weighted by "
            "--moe-aux-loss-coeff) or 'none' (no such loss; --moe-router-enable-expert-bias "
            "balances without one)"
        )
    if (
        balancing == "none"
    ):  # Megatron ignores the coefficient then; here a contradiction is refused
        coeff = model.get("moe_aux_loss_coeff", 0)
        if coeff:
            raise ConfigError(
                f"--moe-router-load-balancing-type=none turns the load-balancing loss off, but "
                f"--moe-aux-loss-coeff={coeff} asks for it: give one of them"
            )
        cfg.set_dotted(table, "model.moe_aux_loss_coeff", 0.0)
    for section in ("model", "data"):
        if not table[section]:
            del table[section]


def _apply_sample_counts(table: dict[str, Any], flags: dict[str, Any]) -> None:
    """Megatron's sample-counted length and schedule (--train-samples, --lr-*-samples) in optimizer
    steps of --global-batch-size samples: the run length as Megatron counts it (samples // batch),
    the schedule's lengths rounded to whole steps (Megatron's schedule advances by a batch a step,
    so it can end within one step of where this one does; a warning says when)."""
    given = [flag for flag in _SAMPLE_FLAGS if flag in flags]
    if not given:
        return
    batch = table.get("train", {}).get("global_batch_size")
    if not isinstance(batch, int) or batch <= 0:
        raise ConfigError(
            f"{given[0]} counts samples: give --global-batch-size on the same command line to turn "
            "it into optimizer steps"
        )
    for flag in given:
        key = _SAMPLE_FLAGS[flag]
        section, _, name = key.partition(".")
        iters_flag = "--" + name.replace("_", "-")
        if name in table.get(section, {}):
            raise ConfigError(f"{flag} and {iters_flag} both set {key}: give one of them")
        samples = cfg.parse_value(flags[flag])
        if type(samples) is not int or samples < 0:
            raise ConfigError(
                f"{flag} must be a number of samples (an integer >= 0), got {flags[flag]!r}"
            )
        steps = samples // batch if flag == "--train-samples" else round(samples / batch)
        if flag != "--train-samples" and steps * batch != samples:
            log.warning(
                "%s=%d is %.2f steps of %d samples: %s=%d",
                flag,
                samples,
                samples / batch,
                batch,
                iters_flag,
                steps,
            )
        cfg.set_dotted(table, key, steps)
