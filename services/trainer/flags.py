"""The trainer's command line: `--config FILE`, `--section.key=value` overrides and Megatron-LM's flags.

`parse_overrides` turns the words after `meshtrain train` into (config file, nested override
table); `meshtrain.services.trainer.config.load_config` merges that table over the defaults and the file.

    parse_overrides(["--config", "a.toml", "--hidden-size", "768", "--train.bf16=true"])
    # -> ("a.toml", {"model": {"hidden_size": 768}, "train": {"bf16": True}})
"""

from __future__ import annotations

import ast
from typing import Any

from meshtrain.services.common import config as cfg
from meshtrain.services.common.errors import ConfigError

# Megatron-LM flag -> (dotted key, takes a value). Flags without a value set a bool to true.
ALIASES: dict[str, tuple[str, bool]] = {
    "--num-layers": ("model.num_layers", True),
    "--hidden-size": ("model.hidden_size", True),
    "--num-attention-heads": ("model.num_attention_heads", True),
    "--num-query-groups": ("model.num_query_groups", True),
    "--ffn-hidden-size": ("model.ffn_hidden_size", True),
    "--seq-length": ("model.seq_length", True),
    "--max-position-embeddings": ("model.max_position_embeddings", True),
    "--vocab-size": ("model.vocab_size", True),
    "--make-vocab-size-divisible-by": ("model.make_vocab_size_divisible_by", True),
    "--normalization": ("model.normalization", True),
    "--position-embedding-type": ("model.position_embedding_type", True),
    "--rotary-base": ("model.rotary_base", True),
    "--init-method-std": ("model.init_method_std", True),
    "--hidden-dropout": ("model.hidden_dropout", True),
    "--attention-dropout": ("model.attention_dropout", True),
    "--transformer-impl": ("model.transformer_impl", True),
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
    "--micro-batch-size": ("train.micro_batch_size", True),
    "--global-batch-size": ("train.global_batch_size", True),
    "--train-iters": ("train.train_iters", True),
    "--eval-interval": ("train.eval_interval", True),
    "--eval-iters": ("train.eval_iters", True),
    "--seed": ("train.seed", True),
    "--bf16": ("train.bf16", False),
    "--gradient-accumulation-fusion": ("train.gradient_accumulation_fusion", False),
    "--no-gradient-accumulation-fusion": ("train.gradient_accumulation_fusion=false", False),
    "--lr": ("optim.lr", True),
    "--min-lr": ("optim.min_lr", True),
    "--lr-warmup-iters": ("optim.lr_warmup_iters", True),
    "--lr-decay-iters": ("optim.lr_decay_iters", True),
    "--lr-decay-style": ("optim.lr_decay_style", True),
    "--weight-decay": ("optim.weight_decay", True),
    "--adam-beta1": ("optim.adam_beta1", True),
    "--adam-beta2": ("optim.adam_beta2", True),
    "--adam-eps": ("optim.adam_eps", True),
    "--clip-grad": ("optim.clip_grad", True),
    "--tensor-model-parallel-size": ("parallel.tp", True),
    "--pipeline-model-parallel-size": ("parallel.pp", True),
    "--virtual-pipeline-model-parallel-size": ("parallel.virtual_pipeline_model_parallel_size", True),
    "--num-layers-per-virtual-pipeline-stage": ("parallel.num_layers_per_virtual_pipeline_stage", True),
    "--decoder-first-pipeline-num-layers": ("parallel.decoder_first_pipeline_num_layers", True),
    "--decoder-last-pipeline-num-layers": ("parallel.decoder_last_pipeline_num_layers", True),
    "--context-parallel-size": ("parallel.cp", True),
    "--cp-comm-type": ("parallel.cp_comm_type", True),
    "--hierarchical-context-parallel-sizes": ("parallel.hierarchical_context_parallel_sizes", True),
    "--expert-model-parallel-size": ("parallel.ep", True),
    "--expert-tensor-parallel-size": ("parallel.expert_tensor_parallel_size", True),
    "--sequence-parallel": ("parallel.sequence_parallel", False),
    "--tp-comm-overlap": ("parallel.tp_comm_overlap", False),
    "--distributed-timeout-minutes": ("parallel.distributed_timeout_minutes", True),
    "--use-distributed-optimizer": ("parallel.use_distributed_optimizer", False),
    "--overlap-grad-reduce": ("parallel.overlap_grad_reduce", False),
    "--overlap-param-gather": ("parallel.overlap_param_gather", False),
    "--ddp-bucket-size": ("parallel.ddp_bucket_size", True),
    "--grad-reduce-in-bf16": ("parallel.grad_reduce_dtype=bf16", False),
    "--recompute-granularity": ("parallel.recompute_granularity", True),
    "--recompute-method": ("parallel.recompute_method", True),
    "--recompute-num-layers": ("parallel.recompute_num_layers", True),
    "--save": ("checkpoint.save", True),
    "--load": ("checkpoint.load", True),
    "--save-interval": ("checkpoint.save_interval", True),
    "--ckpt-step": ("checkpoint.load_step", True),
    "--run-dir": ("log.run_dir", True),
    "--log-interval": ("log.log_interval", True),
}

# Megatron flags taking one or more words (nargs="+"); those of _STRING_LISTS stay strings.
_MULTI_WORD = {"--data-path", "--data-service-addresses", "--hierarchical-context-parallel-sizes"}
_STRING_LISTS = {"data.data_path", "data.service_addresses"}

# Keys whose values are strings even when they look like numbers or booleans.
_STRING_KEYS = {"data.tokenizer", "data.split", "checkpoint.save", "checkpoint.load", "log.run_dir",
                "data.tokenizer_type", "data.vocab_file", "data.merge_file", "data.tokenizer_model",
                "data.tiktoken_pattern"}

# Tokenizer types whose vocabulary Megatron's --vocab-size gives; with one of them named by
# --tokenizer-type, --vocab-size is the tokenizer's (data.vocab_size) and the model's vocabulary
# follows from it, as in Megatron, rather than model.vocab_size.
_VOCAB_SIZE_TOKENIZERS = ("NullTokenizer", "TikTokenizer")


# Megatron spellings of choice values -> ours.
_VALUE_SPELLINGS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm", "learned_absolute": "learned"}


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
        raise ConfigError(f"--moe-layer-freq={text!r} is neither an integer, a list nor a list expression "
                          "such as ([1]*3+[0])*2") from None

    def value(node: ast.AST) -> int | list[int]:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [value(e) for e in node.elts]
            if any(not isinstance(v, int) for v in items):
                raise ConfigError(f"--moe-layer-freq={text!r}: lists hold integers only (no nested lists)")
            return items
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
        raise ConfigError(f"--moe-layer-freq={text!r}: only integers, lists, + and * are allowed, "
                          f"not {ast.unparse(node)!r}")

    def _bounded(items: list[int]) -> list[int]:
        if len(items) > _LIST_LIMIT:
            raise ConfigError(f"--moe-layer-freq={text!r} builds more than {_LIST_LIMIT} entries")
        return items

    return value(tree)


def _value_for(key: str, text: str) -> Any:
    text = _VALUE_SPELLINGS.get(text, text)
    if key in _STRING_KEYS:
        return text
    if key == "model.moe_layer_freq":
        return parse_layer_freq(text)
    if key in ("data.data_path", "data.service_addresses"):
        return cfg.parse_value(text) if text.lstrip().startswith("[") else [text]
    return cfg.parse_value(text)


def parse_overrides(args: list[str]) -> tuple[str | None, dict[str, Any]]:
    """Turn command-line words into (config file, nested override table).

    Accepts `--config FILE`, `--section.key=value` / `--section.key value`, and the Megatron
    aliases in `ALIASES`. `--data-path` takes one or more words, like Megatron's.

    Raises:
        ConfigError: for an unknown flag or a flag missing its value.
    """
    config_file: str | None = None
    table: dict[str, Any] = {}
    balancing: str | None = None  # --moe-router-load-balancing-type, applied at the end
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("--"):
            raise ConfigError(f"unexpected argument {word!r}; overrides look like --section.key=value")
        name, eq, inline = word.partition("=")

        def take_value() -> str:
            nonlocal i
            if eq:
                return inline
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{name} needs a value")
            i += 1
            return args[i]

        if name == "--config":
            config_file = take_value()
        elif name == "--moe-router-load-balancing-type":
            balancing = take_value()
            if balancing not in ("aux_loss", "none"):
                raise ConfigError(
                    f"--moe-router-load-balancing-type={balancing!r} is not supported: 'aux_loss' (the load-"
                    "balancing loss over the global micro-batch, weighted by --moe-aux-loss-coeff) or 'none' "
                    "(no such loss; --moe-router-enable-expert-bias balances without one)")
        elif name in ALIASES:
            target, has_value = ALIASES[name]
            if not has_value:
                if eq:
                    raise ConfigError(f"{name} is a switch and takes no value")
                key, _, fixed = target.partition("=")
                cfg.set_dotted(table, key, cfg.parse_value(fixed) if fixed else True)
            elif name in _MULTI_WORD and not eq:
                words = []
                while i + 1 < len(args) and not args[i + 1].startswith("--"):
                    i += 1
                    words.append(args[i])
                if not words:
                    raise ConfigError(f"{name} needs a value")
                cfg.set_dotted(table, target, words if target in _STRING_LISTS else [cfg.parse_value(w) for w in words])
            else:
                cfg.set_dotted(table, target, _value_for(target, take_value()))
        elif "." in name[2:]:
            key = name[2:].replace("-", "_")
            cfg.set_dotted(table, key, _value_for(key, take_value()))
        else:
            near = cfg.close_matches(name, ["--config", *ALIASES])
            hint = (f"did you mean {' or '.join(near)}?" if near
                    else "use --section.key=value (see --help-config for the keys and aliases)")
            raise ConfigError(f"unknown flag {name}; {hint}")
        i += 1
    data = table.get("data", {})
    if data.get("tokenizer_type") in _VOCAB_SIZE_TOKENIZERS and "vocab_size" in table.get("model", {}):
        data["vocab_size"] = table["model"].pop("vocab_size")
        if not table["model"]:
            del table["model"]
    if balancing == "none":  # Megatron ignores the coefficient then; here a contradiction is refused
        coeff = table.get("model", {}).get("moe_aux_loss_coeff", 0)
        if coeff:
            raise ConfigError(f"--moe-router-load-balancing-type=none turns the load-balancing loss off, but "
                              f"--moe-aux-loss-coeff={coeff} asks for it: give one of them")
        cfg.set_dotted(table, "model.moe_aux_loss_coeff", 0.0)
    return config_file, table
