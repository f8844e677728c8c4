"""`meshtrain generate`: sample text from a committed checkpoint on one process.

The model is rebuilt from the checkpoint's recorded `config.model` and loaded with the
layout-free loader, so a checkpoint saved under any tensor/data-parallel layout loads here.
With `--chat` the prompt is a user message rendered by the checkpoint tokenizer's chat
template with the assistant's generation prompt (as transformers' `apply_chat_template(...,
add_generation_prompt=True)`), generation stops at the template's end-of-turn token, and the
answer alone is printed. Only the text goes to stdout; logs go to stderr. Several samples are
each preceded by a line `--- sample I of N ---` (a sample's text may hold blank lines of its
own); `--json` prints one JSON object a line instead, for a program to read. A vision-language
checkpoint (one with `model.vision`) reads `--image` files, preprocessed as its training data
was (`image_prompt.py`), in the places of the prompt's `<image>` tags (or before the prompt).
"""

from __future__ import annotations

import argparse
import logging
import sys

from meshtrain.services.checkpoint.cli import missing_local_root
from meshtrain.services.common.errors import CheckpointError, ConfigError
from meshtrain.services.common.sampling import check_sampling

log = logging.getLogger(__name__)


def register(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Sample a continuation of --prompt from a committed checkpoint; "
        "prints prompt + continuation to stdout.",
    )
    g.add_argument("--load", required=True, metavar="ROOT", help="checkpoint root")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for a vision-language checkpoint (repeat for several): it takes the place "
        "of the prompt's next <image> tag, or goes before the prompt when it has none",
    )
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    g.add_argument(
        "--seed", type=int, default=None, help="seed of the sampler (reproducible samples)"
    )
    g.add_argument(
        "--ckpt-step", type=int, default=None, help="which step (default: newest committed)"
    )
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer spec (default: the one the checkpoint records; 'byte' for bytes)",
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="--prompt is a user message: render it with the tokenizer's chat template and the "
        "assistant's generation prompt, stop at the template's end of turn, print the answer",
    )
    g.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    g.add_argument(
        "--chat-template",
        default="auto",
        help="with --chat: auto (the tokenizer's own), chatml, llama3 or a .jinja file",
    )
    g.add_argument(
        "--num-samples",
        type=int,
        default=1,
        help="samples to draw; more than one: each after a line '--- sample I of N ---'",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object a line per sample: {"sample", "text", "completion"}',
    )
    g.set_defaults(func=cmd_generate)


def _tokenizer_spec(args: argparse.Namespace, step: int, manifest: dict) -> str:
    """--tokenizer, else the files the checkpoint carries, else the spec it records."""
    if args.tokenizer:
        return args.tokenizer
    from meshtrain.services.checkpoint.tokenizer_store import tokenizer_spec

    metadata = manifest.get("metadata", {})
    spec = tokenizer_spec(args.load, step, metadata, manifest) or (
        (metadata.get("config") or {}).get("data") or {}
    ).get("tokenizer")
    if not spec:
        raise ConfigError(f"{args.load}: the checkpoint records no tokenizer; pass --tokenizer")
    return spec


def cmd_generate(args: argparse.Namespace) -> int:
    # Check the cheap things first, so a typo fails before torch loads or a checkpoint is read.
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 0 or args.num_samples < 1:
        raise ConfigError("--max-new-tokens must be >= 0 and --num-samples >= 1")
    if (args.system is not None or args.chat_template != "auto") and not args.chat:
        raise ConfigError("--system and --chat-template need --chat")
    if missing_local_root(args.load):
        raise CheckpointError(f"no committed checkpoint under {args.load}")

    import torch

    from meshtrain.services.trainer.generate import generate

    model, config, metadata, step, tokenizer, device = _load_model(args)
    ids, images, stops = _prompt_ids(args, model, config, metadata, step, tokenizer, device)
    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=device).manual_seed(args.seed)
    prompt = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)  # (n, s)
    out = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=generator,
        images=images,
        eod_id=stops,
    )
    _print_rows(args, out.tolist(), ids, images is not None, stops, tokenizer)
    return 0


def _load_model(args: argparse.Namespace):
    """(the model of checkpoint --ckpt-step (unset: the newest) under --load on --device, in
    eval mode, its ModelConfig, the manifest's metadata, the step, the tokenizer, the device)."""
    import torch

    from meshtrain.services.checkpoint.convert import model_config, tensor_specs
    from meshtrain.services.checkpoint.reader import list_checkpoints, read_manifest
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
    from meshtrain.services.trainer.checkpointing import load_checkpoint
    from meshtrain.services.trainer.model import GPT

    steps = list_checkpoints(args.load)
    if not steps:
        raise CheckpointError(f"no committed checkpoint under {args.load}")
    step = args.ckpt_step if args.ckpt_step is not None else steps[-1]
    if step not in steps:
        raise CheckpointError(
            f"no committed checkpoint of step {step} under {args.load} (have {steps})"
        )
    manifest = read_manifest(args.load, step)
    metadata = manifest.get("metadata", {})
    config = model_config(metadata, tensor_specs(manifest), f"{args.load} step {step}")
    tokenizer = build_tokenizer(_tokenizer_spec(args, step, manifest))

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    model = GPT(config)
    load_checkpoint(args.load, model, step=step)
    model.to(device).eval()
    log.info(
        "loaded %s step %d (%d parameters) on %s", args.load, step, model.num_parameters(), device
    )
    return model, config, metadata, step, tokenizer, device


def _prompt_ids(
    args: argparse.Namespace, model, config, metadata: dict, step: int, tokenizer, device
):
    """(the prompt's token ids, its images (repeated for each sample) or None, the ids that end
    a chat answer or None), the prompt cut to the model's positions."""
    from meshtrain.services.trainer.generate import context_length

    images = None
    stops: list[int] | None = None
    if args.image and args.chat:
        raise ConfigError("--image with --chat: give the image prompt as plain text")
    if args.image:
        if config.vision is None:
            raise ConfigError(f"--image: {args.load} step {step} is a text-only model (no vision)")
        from meshtrain.services.trainer.image_prompt import expand_prompt, load_images

        data = (metadata.get("config") or {}).get("data") or {}
        images = load_images(
            args.image,
            config.vision,
            data.get("image_resize", "crop"),
            data.get("image_normalization"),
        ).to(device)
        ids = expand_prompt(args.prompt, len(args.image), tokenizer, config.vision)
        images = images.repeat(args.num_samples, 1, 1, 1)  # each row's images, row by row
    elif args.chat:
        ids, stops = _chat_prompt(args, tokenizer)
    else:
        ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ConfigError("--prompt encodes to no tokens")
    limit = context_length(model)
    if images is not None and len(ids) >= limit:
        raise ConfigError(
            f"the prompt with its images takes {len(ids)} tokens, and the model has {limit} "
            "positions: shorten --prompt"
        )
    if len(ids) >= limit:
        # Keep the most recent context, with room for at least one new token.
        log.warning(
            "prompt of %d tokens exceeds the model's %d positions: keeping its last %d",
            len(ids),
            limit,
            limit - 1,
        )
        ids = ids[-(limit - 1) :]
    return ids, images, stops


def _print_rows(
    args: argparse.Namespace, rows: list, ids: list[int], has_images: bool, stops, tokenizer
) -> None:
    """Print each sample: the prompt as given and its continuation, or a chat's answer alone."""
    if has_images:  # the placeholders are no text: print the prompt as it was given
        prompt_ids = tokenizer.encode(args.prompt)
        rows = [prompt_ids + row[len(ids) :] for row in rows]
        _print_samples(rows, len(prompt_ids), tokenizer.decode, args.json)
    elif stops is not None:  # the answer alone, without its end-of-turn marker
        rows = [_until_stop(row[len(ids) :], stops) for row in rows]
        _print_samples(rows, 0, tokenizer.decode, args.json)
    else:
        _print_samples(rows, len(ids), tokenizer.decode, args.json)


def _chat_prompt(args: argparse.Namespace, tokenizer) -> tuple[list[int], list[int]]:
    """(ids of --prompt as a user message (after --system) rendered with the chat template and
    the assistant's generation prompt, the ids that end the answer: the template's end of turn
    and the tokenizer's end of document). The special tokens the template writes are parsed
    as such, as in training (`meshtrain data preprocess --chat`)."""
    from meshtrain.services.dataloader.chat import BadRow, end_of_turn_id, load_chat_template

    template = load_chat_template(args.chat_template, tokenizer)
    messages = [{"role": "user", "content": args.prompt}]
    if args.system is not None:
        messages.insert(0, {"role": "system", "content": args.system})
    try:
        text = template.render(messages, add_generation_prompt=True)
        end = end_of_turn_id(template, tokenizer)
    except BadRow as e:
        raise ConfigError(f"--chat: {e}") from None
    stops = [tokenizer.eod_id] if end is None else [end, tokenizer.eod_id]
    log.info("chat prompt %r; the answer ends at token ids %s", text, stops)
    return tokenizer.encode_with_special_tokens(text), stops


def _until_stop(ids: list[int], stops: list[int]) -> list[int]:
    """`ids` up to (not including) the first stop id."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i]
    return ids


def _print_samples(rows: list[list[int]], prompt_len: int, decode, as_json: bool) -> None:
    """Write each sample (prompt + continuation) to stdout: bare when it is the only one, else
    after a `--- sample I of N ---` line; as_json: one JSON object a line, which also carries
    the continuation alone."""
    import json

    for i, row in enumerate(rows, 1):
        if as_json:
            sample = {"sample": i, "text": decode(row), "completion": decode(row[prompt_len:])}
            sys.stdout.write(json.dumps(sample, ensure_ascii=False) + "\n")
            continue
        if len(rows) > 1:
            sys.stdout.write(f"--- sample {i} of {len(rows)} ---\n")
        sys.stdout.write(decode(row) + "\n")
    sys.stdout.flush()
