"""Tokenizers named the way Megatron-LM names them (`--tokenizer-type`), and their spec strings.

Megatron picks a tokenizer with `--tokenizer-type` plus `--vocab-file`, `--merge-file`,
`--tokenizer-model` or `--vocab-size`. `megatron_spec(...)` turns those settings into a meshtrain
tokenizer spec (the one string that travels in configs, over gRPC and into checkpoints), and
`build_tokenizer` in `base.py` turns the spec back into a tokenizer:

    GPT2BPETokenizer      gpt2bpe:VOCAB_JSON,MERGES_TXT       byte-level BPE, EOD <|endoftext|>
    HuggingFaceTokenizer  PATH (tokenizer.json or its folder)  as `--tokenizer PATH`
    SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer
                          sentencepiece:PATH                  EOD = the model's end of sentence
    TikTokenizer          megatron-tiktoken:PATH,pattern=v2,num_special_tokens=1000,vocab_size=N
    NullTokenizer         null:VOCAB_SIZE                     text is integer ids; EOD = VOCAB_SIZE

The ids match Megatron's for the same files: GPT-2's BPE is checked against `transformers`'
GPT2Tokenizer, the null tokenizer follows megatron-core's `NullTokenizer` (ids 0..V-1 given in
the text, EOD = V, vocabulary V + 1) and TikTokenizer megatron-core's `TikTokenTokenizer`
(a block of special tokens first, `</s>` = 2 as EOD, the merge ranks shifted past them). One
difference is deliberate: special-token text inside a document (`<|endoftext|>`, `</s>`) is
encoded as ordinary text, so only a document's end gets an EOD.

    spec = megatron_spec("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    build_tokenizer(spec).encode("hello")
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Iterable

from meshtrain.services.common.errors import DataError
from meshtrain.services.common.tokenizer_files import EOD_TOKEN, read_gpt2_merges, read_gpt2_vocab
from meshtrain.services.dataloader.tokenizers.base import (
    RustTokenizer,
    Tokenizer,
    read_tiktoken_ranks,
)

#: Megatron's --tokenizer-type values meshtrain reads, each with the file flags it needs.
TOKENIZER_TYPES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}
# The flag each data-config key stands for, for error messages a command-line user can act on.
FLAG_OF = {
    "vocab_file": "--vocab-file",
    "merge_file": "--merge-file",
    "tokenizer_model": "--tokenizer-model",
    "vocab_size": "--vocab-size",
    "tiktoken_pattern": "--tiktoken-pattern",
    "tiktoken_num_special_tokens": "--tiktoken-num-special-tokens",
}

# megatron-core's TikTokenTokenizer: its split patterns, the special tokens it puts first (padded
# with <SPECIAL_i> up to num_special_tokens), and its default vocabulary. The patterns must be
# exactly these for the ids to match.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
TIKTOKEN_SPECIALS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB = 2**17
TIKTOKEN_DEFAULT_SPECIALS = 1000


def _check_path_for_spec(path: str, what: str) -> None:
    if "," in path:
        raise DataError(
            f"{what} {path!r} holds a ',', which separates the parts of a tokenizer spec; "
            "rename or link the file"
        )


def megatron_spec(
    tokenizer_type: str,
    *,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int | None = None,
    prefix: str = "",
) -> str:
    """The tokenizer spec for Megatron's tokenizer settings.

    Only the settings a type reads may be given: a file flag a type does not read (a merge file
    for a SentencePiece model) is refused rather than ignored, since it is usually a sign that
    the wrong type was named.

    Args:
        tokenizer_type: one of TOKENIZER_TYPES.
        vocab_file, merge_file: GPT-2's `vocab.json` and `merges.txt`.
        tokenizer_model: a tokenizer.json (or its folder), a SentencePiece `.model`, or for
            TikTokenizer a `.tiktoken` file or megatron-core's JSON vocabulary.
        vocab_size: NullTokenizer's ids (EOD is `vocab_size`); TikTokenizer's vocabulary
            (default: all the file's ranks, at most 2^17, specials included).
        tiktoken_pattern: TikTokenizer's split pattern, `v1` or `v2` (default `v2`).
        tiktoken_num_special_tokens: TikTokenizer's special-token block (default 1000).
        prefix: put before each key in error messages (`data.`), or "--" to name flags.

    Returns:
        A spec `build_tokenizer` accepts. Paths are made absolute.
    """

    def name(key: str) -> str:
        return FLAG_OF[key] if prefix == "--" else prefix + key

    type_key = "--tokenizer-type" if prefix == "--" else prefix + "tokenizer_type"
    if tokenizer_type not in TOKENIZER_TYPES:
        hint = (
            " (BERT and T5 tokenizers are not supported: meshtrain trains GPT models)"
            if tokenizer_type.startswith("Bert")
            else ""
        )
        raise DataError(
            f"{type_key}={tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}{hint}"
        )
    given = {
        "vocab_file": vocab_file,
        "merge_file": merge_file,
        "tokenizer_model": tokenizer_model,
        "vocab_size": vocab_size,
        "tiktoken_pattern": tiktoken_pattern,
        "tiktoken_num_special_tokens": tiktoken_num_special_tokens,
    }
    needed = TOKENIZER_TYPES[tokenizer_type]
    optional: tuple[str, ...] = ()
    if tokenizer_type == "TikTokenizer":
        optional = ("vocab_size", "tiktoken_pattern", "tiktoken_num_special_tokens")
    for key in needed:
        if given[key] is None or given[key] == "":
            raise DataError(f"{type_key}={tokenizer_type} needs {name(key)}")
    for key, value in given.items():
        if value is not None and value != "" and key not in needed and key not in optional:
            raise DataError(
                f"{name(key)} is not read by {type_key}={tokenizer_type} "
                f"(it reads {', '.join(name(k) for k in needed + optional)})"
            )
    for key in ("vocab_file", "merge_file", "tokenizer_model"):
        path = given[key]
        if path and not os.path.exists(path):
            raise DataError(f"{name(key)}={path!r} does not exist")

    # (`needed` above: each type's own settings are given)
    if tokenizer_type == "GPT2BPETokenizer":
        assert vocab_file and merge_file
        vocab, merges = os.path.abspath(vocab_file), os.path.abspath(merge_file)
        _check_path_for_spec(vocab, name("vocab_file"))
        _check_path_for_spec(merges, name("merge_file"))
        return f"gpt2bpe:{vocab},{merges}"
    if tokenizer_type == "NullTokenizer":
        assert vocab_size is not None
        if vocab_size < 1:
            raise DataError(
                f"{name('vocab_size')}={vocab_size} must be >= 1 for {type_key}=NullTokenizer"
            )
        return f"null:{vocab_size}"
    assert tokenizer_model
    model = os.path.abspath(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "tokenizer.json")):
            raise DataError(
                f"{name('tokenizer_model')}={tokenizer_model!r} is a folder without a "
                "tokenizer.json"
            )
        return model
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        # megatron-core reads all three with one SentencePiece wrapper: no BOS added, EOD = eos
        return f"sentencepiece:{model}"
    # TikTokenizer
    _check_path_for_spec(model, name("tokenizer_model"))
    pattern = tiktoken_pattern or "v2"
    if pattern not in TIKTOKEN_PATTERNS:
        raise DataError(
            f"{name('tiktoken_pattern')}={pattern!r} is not one of {', '.join(TIKTOKEN_PATTERNS)}"
        )
    specials = (
        TIKTOKEN_DEFAULT_SPECIALS
        if tiktoken_num_special_tokens is None
        else tiktoken_num_special_tokens
    )
    spec = f"megatron-tiktoken:{model},pattern={pattern},num_special_tokens={specials}"
    if vocab_size is not None:
        spec += f",vocab_size={vocab_size}"
    # built once here so a bad combination is reported with the flags' names, and the spec
    # records the vocabulary the file gave
    try:
        return MegatronTiktokenTokenizer.from_spec(spec).spec
    except DataError as e:
        raise DataError(
            f"{type_key}=TikTokenizer, {name('tokenizer_model')}={tokenizer_model!r}: {e}"
        ) from None


class GPT2BPETokenizer(RustTokenizer):
    """GPT-2's byte-level BPE from its `vocab.json` + `merges.txt`; EOD is `<|endoftext|>`."""

    name = "gpt2bpe"

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike):
        """Args:
        vocab_file: JSON object token -> id (byte-level symbols, as GPT-2's).
        merge_file: one merge `A B` per line, in priority order; a `#version` line is skipped.
        """
        from tokenizers import Tokenizer as HFRaw
        from tokenizers import decoders, models, pre_tokenizers

        self.vocab_file, self.merge_file = Path(vocab_file), Path(merge_file)
        vocab = read_gpt2_vocab(self.vocab_file)
        merges = read_gpt2_merges(self.merge_file)
        if EOD_TOKEN not in vocab:
            raise DataError(
                f"{self.vocab_file}: vocabulary has no {EOD_TOKEN} token to mark document ends"
            )
        try:
            model = models.BPE(vocab, merges)
        except Exception as e:  # the Rust side raises a bare Exception naming the bad merge
            raise DataError(
                f"{self.merge_file}: merges do not fit the vocabulary {self.vocab_file} ({e})"
            ) from e
        tok = HFRaw(model)
        # GPT-2's split regex, no leading space added, bytes mapped to printable symbols
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self._eod = vocab[EOD_TOKEN]
        self._vocab = max(vocab.values()) + 1

    @property
    def spec(self) -> str:
        return f"gpt2bpe:{self.vocab_file},{self.merge_file}"

    def save_tokenizer_json(self, path: str | os.PathLike) -> None:
        """Write the same tokenizer as a Hugging Face `tokenizer.json` (for exports), with
        `<|endoftext|>` marked special so transformers takes it for bos/eos."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFRaw

        copy = HFRaw.from_str(self._tok.to_str())
        copy.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
        copy.save(str(path))


class NullTokenizer(Tokenizer):
    """Megatron's null tokenizer: a text is its token ids written as whitespace-separated integers.

    Ids 0..`vocab_size`-1 are the given ones and `vocab_size` is EOD, so the vocabulary holds
    `vocab_size` + 1 ids, as megatron-core's NullTokenizer.
    """

    name = "null"

    def __init__(self, vocab_size: int):
        """Args:
        vocab_size: ids a text may hold (EOD comes after them).
        """
        if vocab_size < 1:
            raise DataError(f"null tokenizer: vocab_size={vocab_size} must be >= 1")
        self._ids = int(vocab_size)

    @property
    def spec(self) -> str:
        return f"null:{self._ids}"

    @property
    def vocab_size(self) -> int:
        return self._ids + 1

    @property
    def eod_id(self) -> int:
        return self._ids

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                i = int(word)
            except ValueError:
                raise DataError(
                    f"null tokenizer: {word[:40]!r} is not an integer id (its text is "
                    "whitespace-separated ids)"
                ) from None
            if not 0 <= i <= self._ids:
                raise DataError(
                    f"null tokenizer: id {i} is outside its vocabulary of {self._ids + 1}"
                )
            ids.append(i)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def read_megatron_tiktoken_json(path: Path) -> dict[bytes, int]:
    """megatron-core's TikTokenizer vocabulary: a JSON list of {"rank", "token_bytes" (base64),
    "token_str"}, rank i at position i, the first 256 being the single bytes in order."""
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a JSON vocabulary ({e})") from None
    if not isinstance(items, list) or not items:
        raise DataError(
            f"{path}: a TikTokenizer vocabulary is a non-empty JSON list of "
            '{"rank", "token_bytes", "token_str"} objects'
        )
    ranks: dict[bytes, int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, dict) or set(item) != {"rank", "token_bytes", "token_str"}:
            raise DataError(f"{path}: entry {i} is not a {{rank, token_bytes, token_str}} object")
        if item["rank"] != i:
            raise DataError(
                f"{path}: entry {i} has rank {item['rank']!r}; ranks must be 0, 1, 2, ... in order"
            )
        try:
            token = base64.b64decode(item["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError) as e:
            raise DataError(f"{path}: entry {i}: token_bytes is not base64 ({e})") from None
        if i < 256 and token != bytes([i]):
            raise DataError(
                f"{path}: entry {i} must be the single byte 0x{i:02x} (the first 256 ranks are "
                "the bytes)"
            )
        if token in ranks:
            raise DataError(f"{path}: entry {i} repeats the token of rank {ranks[token]}")
        ranks[token] = i
    return ranks


class MegatronTiktokenTokenizer(Tokenizer):
    """megatron-core's TikTokenizer: `num_special_tokens` special ids first (`<unk>`, `<s>`,
    `</s>`, ... then `<SPECIAL_i>`), the merge ranks after them; EOD is `</s>` (id 2)."""

    name = "megatron-tiktoken"

    def __init__(
        self,
        path: str | os.PathLike,
        pattern: str = "v2",
        num_special_tokens: int = TIKTOKEN_DEFAULT_SPECIALS,
        vocab_size: int | None = None,
    ):
        """Args:
        path: a `.tiktoken` ranks file or megatron-core's JSON vocabulary (`*.json`).
        pattern: the split pattern, `v1` or `v2`.
        num_special_tokens: size of the special-token block (at least the 7 named ones).
        vocab_size: ids in all, specials included; ranks past it are dropped. Default: all
            the file's ranks, at most 2^17 ids in all.
        """
        import tiktoken

        self.path = Path(path)
        if pattern not in TIKTOKEN_PATTERNS:
            raise DataError(
                f"tiktoken pattern {pattern!r} is not one of {', '.join(TIKTOKEN_PATTERNS)}"
            )
        if num_special_tokens < len(TIKTOKEN_SPECIALS):
            raise DataError(
                f"num_special_tokens={num_special_tokens} is fewer than the "
                f"{len(TIKTOKEN_SPECIALS)} named special tokens {', '.join(TIKTOKEN_SPECIALS)}"
            )
        if not self.path.is_file():
            raise DataError(f"{self.path}: TikTokenizer vocabulary file is missing")
        if self.path.suffix == ".json":
            ranks = read_megatron_tiktoken_json(self.path)
        else:
            ranks = read_tiktoken_ranks(self.path)
        top = max(ranks.values()) + 1
        if vocab_size is None:
            vocab_size = min(TIKTOKEN_DEFAULT_VOCAB, num_special_tokens + top)
        inner = vocab_size - num_special_tokens
        if inner < 256:
            raise DataError(
                f"vocab_size={vocab_size} leaves {inner} ids after {num_special_tokens} special "
                "tokens; the 256 single bytes need at least 256"
            )
        if inner > top:
            raise DataError(
                f"vocab_size={vocab_size} needs {inner} ranks after {num_special_tokens} special "
                f"tokens, but {self.path} has ranks only up to {top - 1}"
            )
        kept = {t: r + num_special_tokens for t, r in ranks.items() if r < inner}
        missing = [i for i in range(256) if bytes([i]) not in kept]
        if missing:
            raise DataError(
                f"{self.path}: the first {inner} ranks lack {len(missing)} of the 256 single bytes "
                f"(e.g. 0x{missing[0]:02x}); text holding them could not be encoded"
            )
        specials = list(TIKTOKEN_SPECIALS) + [
            f"<SPECIAL_{i}>" for i in range(len(TIKTOKEN_SPECIALS), num_special_tokens)
        ]
        self.pattern, self.num_special_tokens, self._vocab = pattern, num_special_tokens, vocab_size
        try:
            self._enc = tiktoken.Encoding(
                name=self.path.stem,
                pat_str=TIKTOKEN_PATTERNS[pattern],
                mergeable_ranks=kept,
                special_tokens={t: i for i, t in enumerate(specials)},
            )
        except ValueError as e:
            raise DataError(f"{self.path}: not a usable TikTokenizer vocabulary ({e})") from e

    @classmethod
    def from_spec(cls, spec: str) -> "MegatronTiktokenTokenizer":
        """The tokenizer of a `megatron-tiktoken:PATH,key=value,...` spec."""
        body = spec[len("megatron-tiktoken:") :]
        path, *options = body.split(",")
        # the constructor's defaults, for the options the spec leaves out
        pattern, num_special_tokens, vocab_size = "v2", TIKTOKEN_DEFAULT_SPECIALS, None
        seen: set[str] = set()
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("pattern", "num_special_tokens", "vocab_size") or key in seen:
                raise DataError(
                    f"tokenizer spec {spec!r}: {option!r} is not one of pattern=, "
                    "num_special_tokens=, vocab_size= (each once)"
                )
            seen.add(key)
            if key == "pattern":
                pattern = value
                continue
            try:
                number = int(value)
            except ValueError:
                raise DataError(
                    f"tokenizer spec {spec!r}: {key}={value!r} is not an integer"
                ) from None
            if key == "num_special_tokens":
                num_special_tokens = number
            else:
                vocab_size = number
        return cls(path, pattern, num_special_tokens, vocab_size)

    @property
    def spec(self) -> str:
        return (
            f"megatron-tiktoken:{self.path},pattern={self.pattern},"
            f"num_special_tokens={self.num_special_tokens},vocab_size={self._vocab}"
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eod_id(self) -> int:
        return TIKTOKEN_SPECIALS.index("</s>")

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


def build_megatron_tokenizer(spec: str) -> Tokenizer | None:
    """The tokenizer of a `gpt2bpe:`, `null:` or `megatron-tiktoken:` spec; None for other specs."""
    if spec.startswith("gpt2bpe:"):
        paths = spec[len("gpt2bpe:") :].split(",")
        if len(paths) != 2 or not all(paths):
            raise DataError(f"tokenizer spec {spec!r}: expected gpt2bpe:VOCAB_JSON,MERGES_TXT")
        return GPT2BPETokenizer(*paths)
    if spec.startswith("null:"):
        try:
            size = int(spec[len("null:") :])
        except ValueError:
            raise DataError(
                f"tokenizer spec {spec!r}: expected null:VOCAB_SIZE (an integer)"
            ) from None
        return NullTokenizer(size)
    if spec.startswith("megatron-tiktoken:"):
        return MegatronTiktokenTokenizer.from_spec(spec)
    return None


def absolute_megatron_spec(spec: str) -> str | None:
    """`spec` with its files made absolute, for the specs `build_megatron_tokenizer` reads; None
    for others."""
    if spec.startswith("gpt2bpe:"):
        paths = spec[len("gpt2bpe:") :].split(",")
        return "gpt2bpe:" + ",".join(os.path.abspath(p) for p in paths)
    if spec.startswith("null:"):
        return spec
    if spec.startswith("megatron-tiktoken:"):
        path, sep, options = spec[len("megatron-tiktoken:") :].partition(",")
        return f"megatron-tiktoken:{os.path.abspath(path)}{sep}{options}"
    return None
