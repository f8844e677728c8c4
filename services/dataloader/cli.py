"""`meshtrain data ...`: build datasets and tokenizers from the command line.

    meshtrain data preprocess --input 'docs/*.jsonl' --output-prefix data/docs --tokenizer byte --append-eod
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
from meshtrain.services.common.security import add_server_arguments


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


def tokenizer_spec_from_args(args: argparse.Namespace) -> str:
    """The tokenizer spec of `--tokenizer`, or of Megatron's `--tokenizer-type` and its file flags."""
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
        help="files or glob patterns; each must match a file, and a file matched twice is read once",
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
    pre.set_defaults(func=cmd_preprocess)
    tt = dsub.add_parser(
        "train-tokenizer", help="train a byte-level BPE on local text/JSONL/Parquet files"
    )
    tt.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files or glob patterns, read as preprocess reads them (JSONL/Parquet: the --json-key text)",
    )
    tt.add_argument("--json-key", default="text")
    tt.add_argument("--vocab-size", type=int, required=True)
    tt.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    tt.set_defaults(func=cmd_train_tokenizer)
    sv = dsub.add_parser("serve", help="run a DataService worker (gRPC) until SIGTERM")
    add_serve_arguments(sv)
    sv.set_defaults(func=cmd_serve)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` flags (kept here so building the CLI never imports grpc)."""
    p.add_argument("--port", type=int, default=0, help="TCP port (0: pick a free one and print it)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for all)")
    p.add_argument("--max-streams", type=int, default=32, help="concurrent streams served")
    p.add_argument("--grace", type=float, default=5.0, help="seconds streams get on SIGTERM")
    p.add_argument(
        "--max-index-gib",
        type=float,
        default=None,
        help="memory (GiB) building one request's sample index may take, and all builds "
        "at once; a request needing more is refused (default: half the RAM; indices already cached "
        "count for nothing)",
    )
    p.add_argument(
        "--max-samples",
        type=int,
        default=2**32,
        help="largest num_samples a request may name (default 2^32)",
    )
    p.add_argument(
        "--index-cache-dir",
        default=None,
        help="the one folder where sample indices are cached, never beside the datasets "
        "(default: index/ in $MESHTRAIN_CACHE, else ~/.cache/meshtrain)",
    )
    p.add_argument(
        "--index-cache-gib",
        type=float,
        default=32.0,
        help="disk the cached indices may take; the least recently used ones no stream reads "
        "are evicted (default 32)",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=300.0,
        help="seconds a stream's client may take no message before the stream is cancelled "
        "(it reconnects where it left off when it reads again; 0: never; default 300)",
    )
    p.add_argument(
        "--max-streams-per-client",
        type=int,
        default=16,
        help="streams one client host may hold at once (0: no limit; default 16)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics (requests, bytes, latency, queue depth) on this "
        "port at /metrics (0: any free port, printed); off unless given",
    )
    p.add_argument(
        "--announce",
        default=None,
        metavar="DIR",
        help="once serving, announce this worker in the folder DIR (on a shared file system); "
        "trainers given dir:DIR find every worker announced there, joined later ones too",
    )
    p.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="the host name or address trainers reach this worker by, for --announce "
        "(default: --host, or this machine's name when bound to all interfaces)",
    )
    add_server_arguments(p)  # --token-file, --tls-cert, --tls-key, --tls-client-ca, --insecure


def cmd_serve(args: argparse.Namespace) -> int:
    from meshtrain.services.dataloader.rpc.server import run

    return run(args)
