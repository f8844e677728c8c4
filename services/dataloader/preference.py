"""Preference pairs for DPO: JSONL -> an indexed dataset with a prompt-length sidecar -> batches.

    write_pairs("pairs.jsonl", "data/prefs", build_tokenizer("byte"), max_length=513)
    source = PreferenceBatchSource(PreferencePairs("data/prefs"), seq_length=512, ...)
    source.micro_batches(step)   # [PreferenceBatch], a pure function of (seed, step, dp rank)

Input: one JSON object a line, `{"prompt": str, "chosen": str, "rejected": str}` (TRL's
"standard" preference format), or with a chat template its conversational format (`prompt` a
list of messages, `chosen` and `rejected` lists of assistant messages) rendered as SFT renders
chats. Each sequence is prompt + completion + EOD; the loss counts the
completion and its EOD only. On disk (`PREFIX.bin/.idx`, Megatron's format) pair i is documents
2i (chosen) and 2i+1 (rejected); `PREFIX.pairs.json` holds each sequence's prompt length and
what preprocessing dropped or truncated, checked against the `.idx` fingerprint on load. Pairs
longer than `max_length` keep the end of their prompt (truncation "keep_end", TRL's
truncation_mode) or are dropped ("drop"); a pair whose completion alone is too long is dropped
and counted. The order is a seeded permutation of the pairs per epoch, and the micro-batches of
(step, dp rank) follow from it alone, so a resumed run reads exactly what it would have.
A micro-batch of B pairs is 2B sequences, chosen first then rejected, padded to seq_length.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.chat import BadRow, ChatTemplate, check_conversation
from meshtrain.services.dataloader.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from meshtrain.services.dataloader.tokenizers.base import Tokenizer

FORMAT = "meshtrain-pairs/1"
REFERENCE_FORMAT = "meshtrain-reference-logps/1"
TRUNCATIONS = ("keep_end", "drop")


def _text(row: dict, key: str, line: int, path: str) -> str:
    value = row.get(key)
    if isinstance(value, list):
        raise DataError(
            f"{path}:{line}: {key!r} is a list of messages (the conversational form), which "
            "preprocess-pairs renders with --chat (the tokenizer's chat template) only"
        )
    if not isinstance(value, str):
        raise DataError(f"{path}:{line}: {key!r} must be a string, got {type(value).__name__}")
    return value


def render_chat_pair(
    template: ChatTemplate, row: dict, line: int, path: str
) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) texts of a conversational pair (TRL's conversational preference
    format: `prompt` a list of messages, `chosen` and `rejected` lists of assistant messages).
    The prompt is rendered with the assistant's generation prompt, each completion is the rest
    of the whole conversation's rendering (the answer and its end-of-turn marker).

    Raises:
        DataError: a malformed row, or a template that renders the prompt differently as a
            prefix of the whole conversation, naming the file and line.
    """
    parts = {}
    for key in ("prompt", "chosen", "rejected"):
        value = row.get(key)
        if isinstance(value, str):  # `prompt` alone as text: the user's message
            value = [{"role": "user" if key == "prompt" else "assistant", "content": value}]
        parts[key] = value
    try:
        prompt = check_conversation({"messages": parts["prompt"]}, "messages", need_answer=False)
        start = template.render(prompt, add_generation_prompt=True)
        texts = []
        for key in ("chosen", "rejected"):
            answer = check_conversation({"messages": parts[key]}, "messages", need_answer=False)
            if any(m["role"] != "assistant" for m in answer):
                raise BadRow("bad_message", f"{key!r} holds messages other than the assistant's")
            full = template.render(prompt + answer)
            if not full.startswith(start):
                raise BadRow(
                    "template_prefix",
                    f"chat template {template.name!r}: the prompt with the generation prompt "
                    f"does not render as a prefix of the conversation with {key!r}",
                )
            texts.append(full[len(start) :])
    except BadRow as e:
        raise DataError(f"{path}:{line}: {e.reason}: {e}") from None
    return start, texts[0], texts[1]


def tokenize_pair(
    tokenizer: Tokenizer,
    prompt: str,
    chosen: str,
    rejected: str,
    max_length: int,
    truncation: str,
    special_tokens: bool = False,
) -> tuple[list[int], list[int], int, bool] | None:
    """(chosen ids, rejected ids, prompt length, truncated) of one pair; None if dropped.

    Each sequence is prompt + completion + EOD, at most `max_length` tokens. `special_tokens`:
    special tokens written in the texts (a chat template's markers) become their ids."""
    encode = tokenizer.encode_with_special_tokens if special_tokens else tokenizer.encode
    p = encode(prompt)
    c = encode(chosen) + [tokenizer.eod_id]
    r = encode(rejected) + [tokenizer.eod_id]
    over = len(p) + max(len(c), len(r)) - max_length
    truncated = over > 0
    if truncated:
        # keep at least one prompt token: the first completion token is predicted from it
        if truncation == "drop" or over > len(p) - 1:
            return None
        p = p[over:]
    return p + c, p + r, len(p), truncated


def write_pairs(
    input_path: str | os.PathLike,
    prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    max_length: int,
    truncation: str = "keep_end",
    chat_template: ChatTemplate | None = None,
) -> dict:
    """Tokenize a JSONL of pairs into PREFIX.bin/.idx and PREFIX.pairs.json; returns the summary
    (pairs kept, dropped, truncated).

    `chat_template`: the rows are conversations (`render_chat_pair`), rendered with it and
    tokenized with their special tokens, as `meshtrain data preprocess --chat` does.

    Raises:
        DataError: a malformed line, naming the file and line; no pair left.
    """
    if truncation not in TRUNCATIONS:
        raise DataError(f"truncation {truncation!r}; allowed: {', '.join(TRUNCATIONS)}")
    if max_length < 3:
        raise DataError(f"max_length={max_length} leaves no room for a prompt and a completion")
    prompt_lengths: list[int] = []
    dropped = truncated = 0
    path = str(input_path)
    with (
        IndexedDatasetWriter(prefix, best_dtype(tokenizer.vocab_size)) as writer,
        open(path) as f,
    ):
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_no}: expected an object with prompt/chosen/rejected")
            if chat_template is not None:
                prompt, chosen_text, rejected_text = render_chat_pair(
                    chat_template, row, line_no, path
                )
            else:
                prompt, chosen_text, rejected_text = (
                    _text(row, k, line_no, path) for k in ("prompt", "chosen", "rejected")
                )
            pair = tokenize_pair(
                tokenizer,
                prompt,
                chosen_text,
                rejected_text,
                max_length,
                truncation,
                special_tokens=chat_template is not None,
            )
            if pair is None:
                dropped += 1
                continue
            chosen, rejected, plen, cut = pair
            truncated += cut
            writer.add_document(chosen)
            writer.add_document(rejected)
            prompt_lengths += [plen, plen]
        if not prompt_lengths:
            raise DataError(f"{path}: no preference pair fits max_length={max_length}")
    summary = {
        "format": FORMAT,
        "pairs": len(prompt_lengths) // 2,
        "dropped": dropped,
        "truncated": truncated,
        "max_length": max_length,
        "truncation": truncation,
        "chat_template": None if chat_template is None else chat_template.name,
        "fingerprint": IndexedDataset(prefix).fingerprint,
        "prompt_lengths": prompt_lengths,
    }
    Path(f"{prefix}.pairs.json").write_text(json.dumps(summary))
    return {k: v for k, v in summary.items() if k != "prompt_lengths"}


class PreferencePairs:
    """The pairs under a prefix: sequence tokens, prompt lengths, and the reference column."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        meta_path = Path(f"{prefix}.pairs.json")
        if not meta_path.exists():
            raise DataError(
                f"{meta_path} is missing: {prefix} is not preference data (write it with "
                "`meshtrain data preprocess-pairs`)"
            )
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise DataError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        self.data = IndexedDataset(prefix)
        if meta["fingerprint"] != self.data.fingerprint or len(self.data) != 2 * meta["pairs"]:
            raise DataError(f"{meta_path} does not describe {prefix}.bin/.idx (rewritten since?)")
        self.prompt_lengths = np.asarray(meta["prompt_lengths"], dtype=np.int64)
        self.num_pairs = int(meta["pairs"])
        self.max_length = int(meta["max_length"])

    def sequence(self, i: int) -> np.ndarray:
        return np.asarray(self.data[i], dtype=np.int64)

    @property
    def reference_path(self) -> Path:
        return Path(f"{self.prefix}.ref_logps.npy")

    @property
    def reference_meta_path(self) -> Path:
        return Path(f"{self.prefix}.ref_logps.json")

    def reference(self) -> np.ndarray:
        """The precomputed reference log-probs, (2 * pairs,) float32, checked against the data
        and against the checksum their commit recorded.

        Raises:
            DataError: none written (or a pass that did not finish), written for other data, or
                a file changed or cut short since.
        """
        path, meta_path = self.reference_path, self.reference_meta_path
        if not path.exists() or not meta_path.exists():
            raise DataError(
                f"{path} is missing (or its pass did not finish): dpo.reference='precomputed' "
                "reads the reference log-probs `meshtrain dpo reference --config CONFIG` writes "
                "beside the data"
            )
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != REFERENCE_FORMAT or meta.get("fingerprint") != (
            self.data.fingerprint
        ):
            raise DataError(
                f"{path} was computed for other data than {self.prefix}: recompute it with "
                "`meshtrain dpo reference`"
            )
        try:
            values = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{path} is unreadable ({e}): recompute it") from None
        if values.shape != (2 * self.num_pairs,) or values.dtype != np.float32:
            raise DataError(
                f"{path}: expected {2 * self.num_pairs} float32 values (two per pair), got "
                f"{values.shape} {values.dtype}: recompute it"
            )
        if hashlib.sha256(values.tobytes()).hexdigest() != meta.get("sha256"):
            raise DataError(f"{path} is not the file its pass committed (changed since?)")
        return values

    def reference_source(self) -> str | None:
        """The model the committed reference column was computed with, as its pass recorded it."""
        if not self.reference_meta_path.exists():
            return None
        return json.loads(self.reference_meta_path.read_text()).get("model")

    def write_reference(self, values: np.ndarray, source: str) -> None:
        """Store the reference log-probs of every sequence (what `reference` reads).

        The values go to a temporary file renamed into place, and the sidecar, written last
        the same way, is the commit: it holds the values' checksum, so an interrupted write
        leaves nothing `reference` accepts (the old sidecar is removed first).
        """
        values = np.asarray(values, dtype=np.float32)
        if values.shape != (2 * self.num_pairs,):
            raise DataError(
                f"{self.prefix}: {values.shape} reference values for {self.num_pairs} pairs "
                f"(need {2 * self.num_pairs})"
            )
        meta = {
            "format": REFERENCE_FORMAT,
            "fingerprint": self.data.fingerprint,
            "model": source,
            "sequences": int(values.size),
            "sha256": hashlib.sha256(values.tobytes()).hexdigest(),
        }
        self.reference_meta_path.unlink(missing_ok=True)
        _write_atomic(self.reference_path, lambda f: np.save(f, values))
        _write_atomic(self.reference_meta_path, lambda f: f.write(json.dumps(meta).encode()))


def _write_atomic(path: Path, write) -> None:
    """`write(file)` into a temporary file beside `path`, flushed to disk, renamed onto it."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class PreferenceBatch:
    """One micro-batch of pairs: 2B sequences, chosen[0..B) then rejected[0..B)."""

    tokens: torch.Tensor  # (2B, seq) int64
    labels: torch.Tensor  # (2B, seq) int64
    loss_mask: torch.Tensor  # (2B, seq) float32: 1 on completion tokens (and their EOD)
    reference: torch.Tensor | None  # (2B,) float32 precomputed reference sums, or None
    sequences: np.ndarray  # (2B,) the sequence numbers (for writing a reference column)
    step: int
    microbatch: int


class PreferenceBatchSource:
    """One data-parallel rank's micro-batches of pairs (see the module docstring).

    Args:
        micro_batch_size, global_batch_size: in pairs, as TRL's batch sizes count them.
    """

    def __init__(
        self,
        pairs: PreferencePairs,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 1234,
        reference: np.ndarray | None = None,
    ):
        if pairs.max_length > seq_length + 1:
            raise DataError(
                f"{pairs.prefix} holds sequences of up to {pairs.max_length} tokens; "
                f"model.seq_length={seq_length} takes {seq_length + 1} (inputs and the last label):"
                " preprocess with a smaller --max-length or raise model.seq_length"
            )
        self.pairs, self.seq_length = pairs, seq_length
        self.mbs, self.gbs, self.dp_rank, self.dp_size = (
            micro_batch_size,
            global_batch_size,
            dp_rank,
            dp_size,
        )
        self.seed, self.reference = seed, reference

    @property
    def num_micro_batches(self) -> int:
        return self.gbs // (self.mbs * self.dp_size)

    def pair_indices(self, step: int) -> np.ndarray:
        """This rank's pairs of global batch `step`, in order: epochs of seeded permutations."""
        n = self.pairs.num_pairs
        per_rank = self.gbs // self.dp_size
        start = step * self.gbs + self.dp_rank * per_rank
        positions = np.arange(start, start + per_rank)
        out = np.empty(per_rank, dtype=np.int64)
        for epoch in np.unique(positions // n):
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(n)
            here = positions // n == epoch
            out[here] = order[positions[here] % n]
        return out

    def micro_batches(self, step: int) -> list[PreferenceBatch]:
        idx = self.pair_indices(step)
        return [
            self.batch(idx[m * self.mbs : (m + 1) * self.mbs], step, m)
            for m in range(self.num_micro_batches)
        ]

    def batch(self, pairs: np.ndarray, step: int = 0, microbatch: int = 0) -> PreferenceBatch:
        """The micro-batch of these pair numbers (chosen sequences, then rejected)."""
        seqs = np.concatenate([2 * pairs, 2 * pairs + 1])  # chosen..., rejected...
        s = self.seq_length
        tokens = np.zeros((len(seqs), s), dtype=np.int64)
        labels = np.zeros((len(seqs), s), dtype=np.int64)
        mask = np.zeros((len(seqs), s), dtype=np.float32)
        for row, i in enumerate(seqs):
            seq = self.pairs.sequence(int(i))
            n = len(seq) - 1
            tokens[row, :n], labels[row, :n] = seq[:-1], seq[1:]
            # label j is token j+1: it counts where token j+1 is past the prompt
            mask[row, self.pairs.prompt_lengths[i] - 1 : n] = 1.0
        ref = None
        if self.reference is not None:
            ref = torch.from_numpy(self.reference[seqs].astype(np.float32))
        return PreferenceBatch(
            torch.from_numpy(tokens),
            torch.from_numpy(labels),
            torch.from_numpy(mask),
            ref,
            seqs,
            step,
            microbatch,
        )
