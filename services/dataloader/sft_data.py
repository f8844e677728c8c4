"""The on-disk SFT dataset: chat JSONL preprocessed into tokens, a loss mask beside them, and
metadata that records how they were made.

`preprocess_chat` renders each conversation with a chat template (`chat.py`) and writes
`PREFIX.bin/.idx` (the tokens, one document per conversation ending with EOD, a Megatron
indexed dataset like any other), `PREFIX_lossmask.bin/.idx` (uint8, the same sequence
lengths: 1 on assistant tokens, 0 elsewhere and on the EOD) and `PREFIX.sft.json` (written
last: the tokenizer and its digest, the template and its digest, counts, and the rows dropped
per reason). Bad rows (invalid JSON, an unknown role, an empty conversation, no assistant
turn, non-string content, a conversation over `max_tokens`) are named by file and line; the
`bad_rows` policy either stops there ("stop") or drops and counts them ("drop").
`open_sft_parts` reopens the three and checks them against each other and the tokenizer.

    stats = preprocess_chat(["chats.jsonl"], "data/chats", tok, template="chatml", max_tokens=2049)
    tokens, mask, meta = open_sft_parts("data/chats")
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.common.tokenizer_files import spec_files
from meshtrain.services.dataloader.chat import (
    BadRow,
    check_conversation,
    load_chat_template,
    render_conversation,
)
from meshtrain.services.dataloader.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    check_output_prefix,
    is_remote,
    local_path,
)
from meshtrain.services.dataloader.tokenizers.base import Tokenizer

BAD_ROW_POLICIES = ("stop", "drop")
MASK_SUFFIX = "_lossmask"
META_SUFFIX = ".sft.json"
FORMAT_NAME = "meshtrain-sft"
FORMAT_VERSION = 1


def mask_prefix(prefix: str) -> str:
    """The prefix of the loss-mask dataset beside the tokens of `prefix`."""
    return str(prefix) + MASK_SUFFIX


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """SHA-256 of what a tokenizer maps text with: its files' bytes (or its spec when it has
    none), its vocabulary size and EOD id; recorded so a dataset is trained with its own."""
    h = hashlib.sha256(f"{tokenizer.name}|{tokenizer.vocab_size}|{tokenizer.eod_id}".encode())
    files = spec_files(tokenizer.spec)
    if not files:
        h.update(tokenizer.spec.encode())
    for name, path in files.items():
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@dataclass
class ChatStats:
    """What `preprocess_chat` wrote and dropped."""

    prefix: str
    conversations: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> rows


def _rows(path: Path, messages_key: str):
    """(line number, messages or BadRow) of each non-blank line of a JSONL file."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                yield lineno, BadRow("invalid_json", f"not a JSON object ({e})")
                continue
            try:
                yield lineno, check_conversation(row, messages_key)
            except BadRow as e:
                yield lineno, e


def preprocess_chat(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    template: str = "auto",
    messages_key: str = "messages",
    max_tokens: int | None = None,
    bad_rows: str = "stop",
    progress: bool = False,
) -> ChatStats:
    """Render chat JSONL files into an SFT dataset (tokens, loss mask, metadata).

    Args:
        inputs: `.jsonl` files, one conversation per line (blank lines skipped).
        output_prefix: dataset path without extension.
        tokenizer: encodes the rendered text (special tokens parsed).
        template: "auto" (the tokenizer's own chat_template), "chatml", "llama3" or a .jinja
            file (see `chat.load_chat_template`).
        messages_key: the key of each row's message list.
        max_tokens: the most tokens a conversation may take with its EOD (a training run's
            seq_length + 1: longer ones are bad rows); None: no limit.
        bad_rows: "stop" (raise DataError naming file:line and why) or "drop" (skip and count).

    Returns:
        ChatStats; the drop counts are also in `PREFIX.sft.json`.
    """
    if bad_rows not in BAD_ROW_POLICIES:
        raise DataError(f"bad_rows={bad_rows!r} is not one of {BAD_ROW_POLICIES}")
    if max_tokens is not None and max_tokens < 2:
        raise DataError(f"max_tokens={max_tokens} must be >= 2 (a token and the EOD)")
    if not inputs:
        raise DataError(f"no chat files to preprocess into {output_prefix}")
    prefix = str(output_prefix)
    check_output_prefix(prefix)
    if is_remote(prefix):
        raise DataError(f"output prefix {prefix!r}: SFT datasets are written to a local path")
    chat_template = load_chat_template(template, tokenizer)
    from tqdm import tqdm

    stats = ChatStats(prefix)
    bar = tqdm(unit=" conversations", disable=not progress, desc=Path(prefix).name)
    with (
        IndexedDatasetWriter(prefix, best_dtype(tokenizer.vocab_size)) as tokens_out,
        IndexedDatasetWriter(mask_prefix(prefix), np.uint8) as mask_out,
    ):
        for path in inputs:
            for lineno, row in _rows(Path(path), messages_key):
                bar.update(1)
                try:
                    if isinstance(row, BadRow):
                        raise row
                    ids, mask = render_conversation(chat_template, tokenizer, row)
                    ids.append(tokenizer.eod_id)  # the document boundary: never a label
                    mask.append(0)
                    if max_tokens is not None and len(ids) > max_tokens:
                        raise BadRow(
                            "too_long",
                            f"the conversation takes {len(ids)} tokens with its EOD, over "
                            f"max_tokens={max_tokens} (seq_length + 1); it would be cut",
                        )
                except BadRow as e:
                    if bad_rows == "stop":
                        raise DataError(
                            f"{path}:{lineno}: {e.reason}: {e} (--bad-rows drop skips such rows)"
                        ) from None
                    stats.dropped[e.reason] += 1
                    continue
                tokens_out.add_document(ids)
                mask_out.add_document(mask)
                stats.conversations += 1
                stats.tokens += len(ids)
                stats.assistant_tokens += sum(mask)
        if stats.conversations == 0:
            dropped = ", ".join(f"{n} {r}" for r, n in sorted(stats.dropped.items()))
            raise DataError(
                f"no conversations to write to {prefix}"
                + (f": every row was dropped ({dropped})" if dropped else ": the inputs are empty")
            )
    bar.close()
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tokenizer": tokenizer.spec,
        "tokenizer_digest": tokenizer_digest(tokenizer),
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "chat_template": chat_template.name,
        "chat_template_digest": chat_template.digest,
        "messages_key": messages_key,
        "max_tokens": max_tokens,
        "bad_rows": bad_rows,
        "conversations": stats.conversations,
        "tokens": stats.tokens,
        "assistant_tokens": stats.assistant_tokens,
        "dropped": dict(sorted(stats.dropped.items())),
        "inputs": [str(p) for p in inputs],
    }
    meta_path = Path(local_path(prefix) + META_SUFFIX)
    tmp = meta_path.with_name(meta_path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, meta_path)  # written last: a dataset with it is complete
    return stats


def read_sft_meta(prefix: str) -> dict:
    """The `PREFIX.sft.json` of an SFT dataset.

    Raises:
        DataError: missing (not an SFT dataset, or an unfinished one), or not this format.
    """
    path = str(prefix) + META_SUFFIX
    try:
        if is_remote(prefix):
            import fsspec

            with fsspec.open(path, "rb") as f:
                blob = f.read()
        else:
            blob = Path(local_path(path)).read_bytes()
    except FileNotFoundError:
        raise DataError(
            f"{path} is missing: {prefix} is not an SFT dataset (make one with "
            "`meshtrain data preprocess --chat`), or its preprocessing did not finish"
        ) from None
    try:
        meta = json.loads(blob)
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DataError(f"{path}: not a {FORMAT_NAME} metadata file")
    if meta.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: version {meta.get('version')}, this reader knows {FORMAT_VERSION}"
        )
    return meta


def check_sft_tokenizer(meta: dict, tokenizer: Tokenizer, prefix: str) -> None:
    """Raise DataError unless `tokenizer` is the one the dataset was made with."""
    if meta.get("tokenizer_digest") != tokenizer_digest(tokenizer):
        raise DataError(
            f"SFT dataset {prefix} was made with tokenizer {meta.get('tokenizer')} (chat template "
            f"{meta.get('chat_template')!r}), not with {tokenizer.spec}: train with the same "
            "tokenizer, or preprocess again"
        )


def open_sft_parts(prefix: str) -> tuple[IndexedDataset, IndexedDataset, dict]:
    """(tokens, loss mask, metadata) of an SFT dataset, checked against each other.

    Raises:
        DataError: a part is missing, the mask is not uint8, or its sequences do not have the
            tokens' lengths.
    """
    meta = read_sft_meta(prefix)
    tokens = IndexedDataset(prefix)
    mask = IndexedDataset(mask_prefix(prefix))
    if mask.dtype != np.uint8:
        raise DataError(f"{mask.prefix}: loss mask dtype {mask.dtype}, expected uint8")
    if len(mask) != len(tokens) or not np.array_equal(
        mask.sequence_lengths, tokens.sequence_lengths
    ):
        raise DataError(
            f"{mask.prefix}: the loss mask's sequences do not have the lengths of {prefix}'s "
            "tokens (the files are from different runs)"
        )
    if int(meta.get("eod_id", -1)) < 0:
        raise DataError(f"{prefix}{META_SUFFIX}: no eod_id")
    return tokens, mask, meta
