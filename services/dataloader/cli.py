"""`meshtrain data ...`: build datasets and tokenizers from the command line.

    meshtrain data preprocess --input 'docs/*.jsonl' --output-prefix data/docs --tokenizer byte \
        --append-eod
    meshtrain data preprocess --chat --input chats.jsonl --output-prefix data/chats \
        --tokenizer tok/ --chat-template chatml --seq-length 2048 --bad-rows drop
    meshtrain data preprocess --input docs.jsonl --output-prefix data/docs --append-eod \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
    meshtrain data train-tokenizer --input 'docs/*.txt' --vocab-size 8192 --output tok.json
    meshtrain data serve --port 7001        # a DataService worker (gRPC), until SIGTERM
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import sys
from pathlib import Path

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.config import ServeConfig, add_serve_arguments


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named by paths or glob patterns, in order, each once.

    A path that exists is taken as written, not as a pattern. A pattern matching no regular
    file (nothing, or only directories) is an error: it used to give an empty dataset. A file
    matched by several patterns (`'d/*.jsonl' d/b.jsonl`) is read once, where it first
    appears, so overlapping patterns do not repeat its documents.

    Args:
        patterns: paths or glob patterns (`**` recurses), as given to `--input`.

    Returns:
        The files, in pattern order, each pattern's matches sorted.
    """
    files: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        # A path that exists as written is that file, glob characters or not: the shell passes
        # a tab-completed 'shard[1].jsonl' as is, and as a pattern it matched nothing, or
        # 'shard1.jsonl' instead.
        matches = (
            [pattern] if os.path.exists(pattern) else sorted(glob.glob(pattern, recursive=True))
        )
        if not matches:
            raise DataError(f"--input {pattern!r} matches no file")
        regular = [Path(m) for m in matches if Path(m).is_file()]
        if not regular:
            raise DataError(
                f"--input {pattern!r} matches no regular file, only {matches[0]!r}"
                f"{' and others' if len(matches) > 1 else ''} (a directory? name its "
                f"files, e.g. '{matches[0].rstrip('/')}/**/*.jsonl')"
            )
        for path in regular:
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(path)
    return files


class _Stopped(BaseException):
    """A SIGTERM or SIGHUP, raised in the main thread as Ctrl-C's KeyboardInterrupt is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame) -> None:
    raise _Stopped(signum)


def cmd_preprocess(args: argparse.Namespace) -> int:
    from meshtrain.services.dataloader.preprocess import preprocess_files
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer

    if args.chat:
        return _preprocess_chat(args)
    chat_only = [
        flag
        for flag, value in (
            ("--chat-template", args.chat_template),
            ("--messages-key", args.messages_key),
            ("--seq-length", args.seq_length),
            ("--bad-rows", args.bad_rows),
        )
        if value is not None
    ]
    if chat_only:
        raise DataError(f"{chat_only[0]} applies to chat data: add --chat")
    tokenizer = build_tokenizer(tokenizer_spec_from_args(args))
    # Killed outright by SIGTERM, a run left its partial .bin.tmp-* behind, and its --workers
    # processes ran on as orphans; raised here, the writer and the pool clean up as for Ctrl-C.
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        prefix = preprocess_files(
            expand_inputs(args.input),
            args.output_prefix,
            tokenizer,
            json_key=args.json_key,
            append_eod=args.append_eod,
            workers=args.workers,
            progress=not args.quiet,
        )
    except _Stopped as e:
        name = signal.Signals(e.signum).name
        print(
            f"meshtrain: {name}: preprocessing stopped; nothing written to {args.output_prefix}",
            file=sys.stderr,
        )
        return 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


def _preprocess_chat(args: argparse.Namespace) -> int:
    """`data preprocess --chat`: chat JSONL into tokens, loss mask and metadata."""
    from meshtrain.services.dataloader.sft_data import mask_prefix, preprocess_chat
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer

    if args.workers != 1:
        raise DataError("--workers: chat preprocessing renders in one process; leave it out")
    if args.seq_length is not None and args.seq_length < 1:
        raise DataError(f"--seq-length {args.seq_length} must be >= 1")
    tokenizer = build_tokenizer(tokenizer_spec_from_args(args))
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        stats = preprocess_chat(
            expand_inputs(args.input),
            args.output_prefix,
            tokenizer,
            template=args.chat_template or "auto",
            messages_key=args.messages_key or "messages",
            max_tokens=None if args.seq_length is None else args.seq_length + 1,
            bad_rows=args.bad_rows or "stop",
            progress=not args.quiet,
        )
    except _Stopped as e:
        name = signal.Signals(e.signum).name
        print(
            f"meshtrain: {name}: preprocessing stopped; nothing written to {args.output_prefix}",
            file=sys.stderr,
        )
        return 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    prefix = stats.prefix
    print(
        f"wrote {prefix}.bin/.idx, {mask_prefix(prefix)}.bin/.idx and {prefix}.sft.json: "
        f"{stats.conversations} conversations, {stats.tokens} tokens "
        f"({stats.assistant_tokens} trained on)"
    )
    for reason, n in sorted(stats.dropped.items()):
        print(f"dropped {n} rows: {reason}")
    return 0


def tokenizer_spec_from_args(args: argparse.Namespace) -> str:
    """The tokenizer spec of `--tokenizer`, or of Megatron's `--tokenizer-type` and its file
    flags."""
    from meshtrain.services.dataloader.tokenizers.megatron import FLAG_OF, megatron_spec

    megatron = {key: getattr(args, key) for key in FLAG_OF}
    if args.tokenizer_type is None:
        if args.tokenizer is None:
            raise DataError(
                "name the tokenizer: --tokenizer SPEC, or Megatron's --tokenizer-type with its "
                "--vocab-file/--merge-file/--tokenizer-model/--vocab-size"
            )
        given = [FLAG_OF[key] for key, value in megatron.items() if value is not None]
        if given:
            raise DataError(f"{given[0]} is given without --tokenizer-type, which reads it")
        return args.tokenizer
    if args.tokenizer is not None:
        raise DataError(
            "--tokenizer and --tokenizer-type both name the tokenizer; give one of them"
        )
    return megatron_spec(args.tokenizer_type, **megatron, prefix="--")


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from meshtrain.services.dataloader.tokenizers.base import train_bpe

    tok = train_bpe(
        [str(p) for p in expand_inputs(args.input)], args.vocab_size, args.output, args.json_key
    )
    print(f"wrote {args.output} (vocabulary {tok.vocab_size})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `data` and its subcommands to the top-level parser."""
    d = sub.add_parser("data", help="build datasets and tokenizers")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    pre = dsub.add_parser(
        "preprocess", help="tokenize text/JSONL/Parquet files into PREFIX.bin/.idx"
    )
    pre.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files or glob patterns; each must match a file, and a file matched twice is read "
        "once",
    )
    pre.add_argument("--output-prefix", required=True)
    pre.add_argument(
        "--tokenizer",
        default=None,
        help="'byte', a tokenizer.json, a .tiktoken file or a SentencePiece .model "
        "(or Megatron's --tokenizer-type and its file flags instead)",
    )
    pre.add_argument(
        "--tokenizer-type",
        default=None,
        help="Megatron's name: GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, "
        "GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer or NullTokenizer",
    )
    pre.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    pre.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    pre.add_argument(
        "--tokenizer-model",
        default=None,
        help="the tokenizer.json (or folder), SentencePiece .model or TikTokenizer vocabulary",
    )
    pre.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer's ids (EOD is this id), or TikTokenizer's vocabulary",
    )
    pre.add_argument(
        "--tiktoken-pattern",
        default=None,
        choices=["v1", "v2"],
        help="TikTokenizer's split pattern (default v2)",
    )
    pre.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=None,
        help="TikTokenizer's special ids before the merge ranks (default 1000)",
    )
    pre.add_argument("--json-key", default="text")
    pre.add_argument(
        "--append-eod", action="store_true", help="end each document with the EOD token"
    )
    pre.add_argument(
        "--workers", type=int, default=1, help="tokenizing processes (same output for any N)"
    )
    pre.add_argument("--quiet", action="store_true", help="no progress bar")
    chat = pre.add_argument_group("chat data (supervised fine-tuning)")
    chat.add_argument(
        "--chat",
        action="store_true",
        help="the inputs are chat JSONL ({'messages': [{'role', 'content'}, ...]} a line): "
        "render each with a chat template and write a loss mask on the assistant tokens",
    )
    chat.add_argument(
        "--chat-template",
        default=None,
        help="'auto' (default: the tokenizer's own chat_template), 'chatml', 'llama3', or a "
        ".jinja file",
    )
    chat.add_argument(
        "--messages-key", default=None, help="the key of each row's messages (default messages)"
    )
    chat.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="the training seq_length: a conversation over seq_length + 1 tokens (with its EOD) "
        "is a bad row",
    )
    chat.add_argument(
        "--bad-rows",
        choices=["stop", "drop"],
        default=None,
        help="stop at the first bad row naming file:line (default), or drop and count them",
    )
    pre.set_defaults(func=cmd_preprocess)
    pp = dsub.add_parser(
        "preprocess-pairs",
        help="tokenize a JSONL of preference pairs (prompt, chosen, rejected) for DPO",
    )
    pp.add_argument("--input", required=True, help="JSONL: one {prompt, chosen, rejected} a line")
    pp.add_argument("--output-prefix", required=True)
    pp.add_argument("--tokenizer", required=True, help="the run's data.tokenizer")
    pp.add_argument(
        "--max-length",
        type=int,
        required=True,
        help="tokens of prompt + completion + EOD (at most the run's model.seq_length + 1)",
    )
    pp.add_argument(
        "--truncation",
        choices=["keep_end", "drop"],
        default="keep_end",
        help="a pair over --max-length: keep its prompt's end, or drop it",
    )
    pp.add_argument(
        "--chat",
        action="store_true",
        help="rows are conversations (prompt: messages; chosen, rejected: assistant messages), "
        "rendered with the chat template as `preprocess --chat` renders them",
    )
    pp.add_argument(
        "--chat-template",
        default=None,
        help="with --chat: auto (the tokenizer's own, default), chatml, llama3 or a .jinja file",
    )
    pp.set_defaults(func=cmd_preprocess_pairs)
    tt = dsub.add_parser(
        "train-tokenizer", help="train a byte-level BPE on local text/JSONL/Parquet files"
    )
    tt.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files or glob patterns, read as preprocess reads them "
        "(JSONL/Parquet: the --json-key text)",
    )
    tt.add_argument("--json-key", default="text")
    tt.add_argument("--vocab-size", type=int, required=True)
    tt.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    tt.set_defaults(func=cmd_train_tokenizer)
    sv = dsub.add_parser("serve", help="run a DataService worker (gRPC) until SIGTERM")
    add_serve_arguments(sv)
    sv.set_defaults(func=cmd_serve)


def cmd_preprocess_pairs(args: argparse.Namespace) -> int:
    if args.chat_template is not None and not args.chat:
        raise DataError("--chat-template needs --chat")
    from meshtrain.services.dataloader.chat import load_chat_template
    from meshtrain.services.dataloader.preference import write_pairs
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer)
    template = load_chat_template(args.chat_template or "auto", tokenizer) if args.chat else None
    summary = write_pairs(
        args.input,
        args.output_prefix,
        tokenizer,
        args.max_length,
        args.truncation,
        chat_template=template,
    )
    print(
        f"{args.output_prefix}: {summary['pairs']} pairs ({summary['truncated']} truncated, "
        f"{summary['dropped']} dropped over --max-length={args.max_length})"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    config = ServeConfig.from_args(args)  # checked before the server's modules load
    from meshtrain.services.dataloader.rpc.server import run

    return run(config)
