"""`meshtrain ckpt export|import|convert`: Hugging Face and Megatron Core export/import, checkpoint
rewriting.

    meshtrain ckpt export --format hf SRC DST [--step N] [--tokenizer FILE] [--max-shard-size 5GB]
        [--architecture llama|mistral|qwen2|qwen3]
    meshtrain ckpt import --format hf SRC DST [--seq-length N] [--revision REV] [--cache-dir DIR]
        [--vision-tower DIR --image-token-id N [--vision-select-layer K]]
        (SRC: a folder, or a repo id org/name found in the Hugging Face cache, offline)
    meshtrain ckpt export --format megatron SRC DST [--step N] [--padded-vocab-size N]
    meshtrain ckpt import --format megatron SRC DST [--iteration N] [--num-attention-heads N]
        [--group-query-attention] [--num-query-groups N] [--kv-channels N]
        [--normalization LayerNorm|RMSNorm] [--norm-epsilon X] [--swiglu] [--openai-gelu]
        [--position-embedding-type learned_absolute|rope] [--rotary-base X]
        [--use-rope-scaling] [--rope-scaling-factor X] [--seq-length N]
        [--untie-embeddings-and-output-weights] [--vocab-size N] [Megatron-LM's other
        architecture flags: every flag line `ckpt export --format megatron` prints]
        (SRC: a megatron-core torch_dist folder, or a Megatron-LM checkpoint root)
    meshtrain ckpt convert SRC DST [--step N] [--dtype bf16|fp32|fp16] [--drop-optimizer]
        [--target-tensor-parallel-size N] [--target-pipeline-parallel-size N]
        [--target-expert-parallel-size N]

The Megatron architecture flags are needed only where the checkpoint has no saved `args`
(`megatron/args.py`). `register_subcommands(ckpt_subparsers)` adds the three commands to the
`ckpt` parser; each sets `func` to a handler taking the parsed namespace and returning an exit
code. Errors are `MeshtrainError`s, which the top-level CLI prints and turns into exit status 2.
"""

from __future__ import annotations

import argparse

from meshtrain.services.common.errors import CheckpointError


def cmd_export(args: argparse.Namespace) -> int:
    """Exports a training checkpoint as a Hugging Face folder or a Megatron Core torch_dist
    checkpoint."""
    from meshtrain.services.checkpoint.hf.convert import export_hf

    _check_format(args.format, args, _HF_EXPORT, ["padded_vocab_size"])
    if args.format == "megatron":
        from meshtrain.services.checkpoint.megatron.torch_dist import export_megatron

        _, flags = export_megatron(
            args.src, args.dst, step=args.step, padded_vocab_size=args.padded_vocab_size
        )
        print(
            f"exported {args.src} to {args.dst} (megatron-core torch_dist, a release checkpoint: "
            f"{args.dst}/release)\nload it in Megatron-LM with --load {args.dst} and these model "
            f"flags (plus your tokenizer's):\n  {' '.join(flags)}"
        )
        return 0
    export_hf(
        args.src,
        args.dst,
        step=args.step,
        tokenizer=args.tokenizer,
        max_shard_size=args.max_shard_size,
        arch=args.architecture,
    )
    print(f"exported {args.src} to {args.dst} (Hugging Face safetensors + config.json)")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Imports a Hugging Face folder as a step-0 training checkpoint; prints how to train on."""
    import tomli_w

    from meshtrain.services.checkpoint.hf.convert import import_hf
    from meshtrain.services.checkpoint.reader import read_manifest

    _check_format(args.format, args, _HF_IMPORT, _MEGATRON_IMPORT)
    if args.format == "megatron":
        return _import_megatron(args)
    url = import_hf(
        args.src,
        args.dst,
        seed=args.seed,
        seq_length=args.seq_length,
        revision=args.revision,
        cache_dir=args.cache_dir,
        vision_tower=args.vision_tower,
        vision=_vision_choices(args),
    )
    meta = read_manifest(args.dst, 0)["metadata"]
    settings = {"model": meta["config"]["model"]}
    print(f"imported {args.src} as {url}")
    # `meshtrain train` builds the model and picks the tokenizer from its own config, not the
    # checkpoint's: without these it trains the imported weights on another tokenizer's ids.
    if meta.get("tokenizer"):
        settings["data"] = {"tokenizer": meta["tokenizer"]}
        print(
            f"continue with: meshtrain train --load {args.dst} --data-path PREFIX and these "
            "settings, PREFIX being data tokenized with the model's own tokenizer (meshtrain data "
            f"preprocess ... --tokenizer {meta['tokenizer']}):\n"
        )
    else:
        print(
            f"continue with: meshtrain train --load {args.dst} and these settings; {args.src} has "
            "no tokenizer.json, so also set data.tokenizer (and --data-path) to the tokenizer the "
            "model was trained with:\n"
        )
    print(tomli_w.dumps(settings))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Rewrites a checkpoint: dtype, optimizer state, shard shapes for a target layout."""
    from meshtrain.services.checkpoint.convert import convert

    result = convert(
        args.src,
        args.dst,
        dtype=args.dtype,
        drop_optimizer=args.drop_optimizer,
        target_tp=args.target_tp,
        target_pp=args.target_pp,
        target_ep=args.target_ep,
        step=args.step,
        progress=True,
    )
    rate = result.bytes_read / max(result.seconds, 1e-9) / 1e9
    print(
        f"converted step {result.step}: {result.tensors} tensors, {result.bytes_read / 1e9:.2f} GB "
        f"read, {result.bytes_written / 1e9:.2f} GB written in {result.seconds:.1f} s ({rate:.2f} "
        f"GB/s) -> {result.url}"
    )
    return 0


def register_subcommands(ckpt_subparsers: argparse._SubParsersAction) -> None:
    """Adds `export`, `import` and `convert` to the `ckpt` subcommand parsers.

    Args:
        ckpt_subparsers: what `add_subparsers()` of the `ckpt` parser returned.
    """
    _add_export(ckpt_subparsers)
    _add_import(ckpt_subparsers)
    _add_convert(ckpt_subparsers)


def _add_export(ckpt_subparsers: argparse._SubParsersAction) -> None:
    """`ckpt export`: a checkpoint as a Hugging Face folder or a Megatron torch_dist release."""
    exp = ckpt_subparsers.add_parser(
        "export", help="write a checkpoint as a Hugging Face model folder"
    )
    exp.add_argument(
        "--format",
        default="hf",
        help="hf (the default: safetensors + config.json) or megatron (a megatron-core torch_dist "
        "release checkpoint)",
    )
    exp.add_argument("src", help="checkpoint root")
    exp.add_argument("dst", help="folder to create")
    exp.add_argument("--step", type=int, help="step to export (default: the latest)")
    exp.add_argument("--tokenizer", help="tokenizer.json to ship instead of the run's")
    exp.add_argument(
        "--max-shard-size",
        default="5GB",
        help="most tensor bytes per safetensors file, e.g. 5GB (the default), 500MB, 2GiB; a "
        "larger model is written in shards with model.safetensors.index.json",
    )
    exp.add_argument(
        "--architecture",
        choices=["llama", "mistral", "qwen2", "qwen3"],
        help="Hugging Face model_type of a dense RoPE model (default: the imported model's, "
        "model.hf_model_type, while the settings fit it, else the one they name)",
    )
    exp.add_argument(
        "--padded-vocab-size",
        type=int,
        help="megatron: embedding and output rows, as Megatron-LM pads the tokenizer's vocabulary "
        "(a multiple of make_vocab_size_divisible_by x TP; default: the model's own padding)",
    )
    exp.set_defaults(func=cmd_export)


def _add_import(ckpt_subparsers: argparse._SubParsersAction) -> None:
    """`ckpt import`: a Hugging Face folder (with an optional vision tower) or a Megatron
    checkpoint as step 0 of a checkpoint root."""
    imp = ckpt_subparsers.add_parser(
        "import", help="turn a Hugging Face model folder into a checkpoint"
    )
    imp.add_argument(
        "--format",
        default="hf",
        help="hf (the default: Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or GPT-2 "
        "safetensors) or megatron (a megatron-core torch_dist checkpoint of a GPT model)",
    )
    imp.add_argument(
        "src",
        help="Hugging Face model folder, or a repo id (org/name) in the Hugging Face cache; "
        "megatron: a torch_dist folder, or a Megatron-LM root with "
        "latest_checkpointed_iteration.txt",
    )
    imp.add_argument("dst", help="checkpoint root to write step 0 into")
    imp.add_argument("--seed", type=int, default=1234, help="seeds the stored RNG states")
    imp.add_argument(
        "--seq-length",
        type=int,
        help="the model's sequence length (default: max_position_embeddings); a Mistral sliding "
        "window is accepted when it covers this length",
    )
    imp.add_argument("--revision", help="cached branch, tag or commit of a repo id (default: main)")
    imp.add_argument(
        "--cache-dir",
        help="Hugging Face hub cache (default: $HF_HUB_CACHE, $HF_HOME/hub, "
        "~/.cache/huggingface/hub)",
    )
    vis = imp.add_argument_group(
        "vision tower",
        "a CLIPVisionModel or SiglipVisionModel in front of the language model SRC: a LLaVA-style "
        "model with a new projector (docs/multimodal.md)",
    )
    vis.add_argument("--vision-tower", help="the tower's folder, or a repo id in the HF cache")
    vis.add_argument(
        "--image-token-id",
        type=int,
        help="the placeholder token of SRC's vocabulary that image features take the place of",
    )
    vis.add_argument(
        "--vision-select-layer",
        type=int,
        help="the tower layer the projector reads (model.vision.select_layer; default -2)",
    )
    _add_megatron_import_flags(imp)
    imp.set_defaults(func=cmd_import)


def _add_megatron_import_flags(imp: argparse.ArgumentParser) -> None:
    """Megatron-LM's model flags on `ckpt import`, for a torch_dist checkpoint saved without its
    args (they override the saved ones)."""
    meg = imp.add_argument_group(
        "megatron",
        "Megatron-LM's flags, for a checkpoint without saved args (they override the saved ones)",
    )
    meg.add_argument(
        "--iteration",
        type=int,
        help="the iter_NNNNNNN folder under a root (default: the tracker's)",
    )
    meg.add_argument("--num-layers", type=int, help="checked against the stacked layers")
    meg.add_argument("--hidden-size", type=int, help="checked against the tensors")
    meg.add_argument("--ffn-hidden-size", type=int, help="checked against linear_fc2's columns")
    meg.add_argument("--num-attention-heads", type=int)
    meg.add_argument(
        "--group-query-attention",
        action="store_const",
        const=True,
        help="read --num-query-groups (as Megatron-LM does)",
    )
    meg.add_argument("--num-query-groups", type=int, help="default: from the fused qkv rows")
    meg.add_argument("--kv-channels", type=int, help="head width (default: hidden size / heads)")
    meg.add_argument(
        "--normalization", choices=["LayerNorm", "RMSNorm"], help="default: from the norms' biases"
    )
    meg.add_argument("--norm-epsilon", type=float, help="default: 1e-5, Megatron's")
    meg.add_argument(
        "--swiglu", action="store_const", const=True, help="checked against linear_fc1's rows"
    )
    meg.add_argument(
        "--openai-gelu",
        action="store_const",
        const=True,
        help="the GELU is tanh-approximate, as meshtrain's (without it: the exact one, noted)",
    )
    meg.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope"],
        help="default: from the position table's presence",
    )
    meg.add_argument(
        "--rotary-base", type=float, help="RoPE base; needed for a RoPE model without saved args"
    )
    meg.add_argument(
        "--use-rope-scaling", action="store_const", const=True, help="Llama 3 RoPE scaling"
    )
    meg.add_argument(
        "--rope-scaling-factor", type=float, help="with --use-rope-scaling (default: 8)"
    )
    meg.add_argument(
        "--max-position-embeddings",
        type=int,
        help="accepted as the export prints it (the position table's rows are read)",
    )
    meg.add_argument(
        "--disable-bias-linear",
        dest="add_bias_linear",
        action="store_const",
        const=False,
        help="checked against the linear layers' biases",
    )
    meg.add_argument(
        "--add-qkv-bias",
        action="store_const",
        const=True,
        help="accepted as the export prints it (the qkv bias is read)",
    )
    meg.add_argument(
        "--qk-layernorm", action="store_const", const=True, help="checked against the q/k norms"
    )
    meg.add_argument(
        "--make-vocab-size-divisible-by", type=int, help="the padding multiple (default: 128)"
    )
    meg.add_argument(
        "--ckpt-format",
        choices=["torch_dist"],
        help="accepted as the export prints it (the only format read)",
    )
    meg.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_const",
        const=True,
        help="checked against output_layer.weight's presence",
    )
    meg.add_argument(
        "--vocab-size",
        type=int,
        help="the tokenizer's vocabulary: drops Megatron-LM's padding rows "
        "(default: every embedding row)",
    )


def _add_convert(ckpt_subparsers: argparse._SubParsersAction) -> None:
    """`ckpt convert`: a checkpoint rewritten in another dtype, without its optimizer, or laid
    out for other tensor, pipeline and expert parallel sizes."""
    conv = ckpt_subparsers.add_parser(
        "convert", help="rewrite a checkpoint (dtype, optimizer, layout)"
    )
    conv.add_argument("src", help="source checkpoint root")
    conv.add_argument("dst", help="destination checkpoint root")
    conv.add_argument("--step", type=int, help="step to convert (default: the latest)")
    conv.add_argument(
        "--dtype", choices=["bf16", "fp32", "fp16"], help="dtype of the model parameters"
    )
    conv.add_argument(
        "--drop-optimizer", action="store_true", help="leave out the optimizer moments"
    )
    conv.add_argument("--target-tensor-parallel-size", dest="target_tp", type=int, default=1)
    conv.add_argument("--target-pipeline-parallel-size", dest="target_pp", type=int, default=1)
    conv.add_argument("--target-expert-parallel-size", dest="target_ep", type=int, default=1)
    conv.set_defaults(func=cmd_convert)


def _vision_choices(args: argparse.Namespace) -> dict | None:
    """The model.vision keys of --image-token-id and --vision-select-layer (None: neither)."""
    out = {}
    if args.image_token_id is not None:
        out["image_token_id"] = args.image_token_id
    if args.vision_select_layer is not None:
        out["select_layer"] = args.vision_select_layer
    return out or None


def _import_megatron(args: argparse.Namespace) -> int:
    import tomli_w

    from meshtrain.services.checkpoint.megatron.torch_dist import import_megatron
    from meshtrain.services.checkpoint.reader import read_manifest

    flags = {
        name: getattr(args, name)
        for name in _MEGATRON_IMPORT
        if name not in ("iteration", "ckpt_format")
    }
    flags["seq_length"] = args.seq_length
    url = import_megatron(args.src, args.dst, iteration=args.iteration, flags=flags, seed=args.seed)
    meta = read_manifest(args.dst, 0)["metadata"]
    print(
        f"imported {args.src} as {url} (model weights; Megatron's optimizer state is not imported)"
    )
    for note in meta["imported_from"]["notes"]:
        print(f"note: {note}")
    print(
        f"continue with: meshtrain train --load {args.dst} --data-path PREFIX and these settings, "
        "plus data.tokenizer set to the tokenizer the model was trained with:\n"
    )
    print(tomli_w.dumps({"model": meta["config"]["model"]}))
    return 0


# Options of one format only, by their argparse dest; the other format refuses them.
_HF_EXPORT = ["tokenizer", "architecture"]
_HF_IMPORT = ["revision", "cache_dir", "vision_tower", "image_token_id", "vision_select_layer"]
_MEGATRON_IMPORT = [
    "iteration",
    "ckpt_format",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "openai_gelu",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "max_position_embeddings",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "make_vocab_size_divisible_by",
    "untie_embeddings_and_output_weights",
    "vocab_size",
]


def _check_format(
    fmt: str, args: argparse.Namespace, hf_only: list[str], megatron_only: list[str]
) -> None:
    if fmt not in ("hf", "megatron"):
        raise CheckpointError(f"--format {fmt!r} is not supported; use 'hf' or 'megatron'")
    other = megatron_only if fmt == "hf" else hf_only
    given = [
        f"--{name.replace('_', '-')}" for name in other if getattr(args, name, None) is not None
    ]
    if given:
        raise CheckpointError(
            f"{', '.join(given)} do{'es' if len(given) == 1 else ''} not apply to --format {fmt}"
        )
