"""The files behind a tokenizer spec, the spec pointed at copies of them, and what the files
say without building a tokenizer: its end-of-document id, and GPT-2's BPE as a `tokenizer.json`.

A run names its tokenizer by a spec (the dataloader's `tokenizers.py` builds tokenizers from
specs) that holds absolute paths: a `tokenizer.json` or its folder, a `.tiktoken` ranks file, a
SentencePiece `.model`, GPT-2's `vocab.json` + `merges.txt`. A checkpoint that recorded only the
spec stops working when those files move or change, so checkpoints carry the files themselves
(`checkpoint/tokenizer_store.py`): `spec_files` lists what to carry (`companion_files` what a
tokenizer.json keeps beside it: its tokenizer_config.json and chat template), and `rebase_spec`
turns the recorded spec into one that names the copies, wherever they were unpacked. A Hugging
Face export (`checkpoint/hf/tokenizer.py`) needs the run's end-of-document id and a
`tokenizer.json`: `spec_eod_id`, `eos_token` and `gpt2bpe_tokenizer_json` read them from the
files with the tokenizer libraries themselves, the same ids the dataloader's tokenizers give.

    files = spec_files("gpt2bpe:/data/vocab.json,/data/merges.txt")
    # {'vocab.json': ..., 'merges.txt': ...}
    rebase_spec("gpt2bpe:/data/vocab.json,/data/merges.txt", files, "/tmp/tok")
    # 'gpt2bpe:/tmp/tok/vocab.json,/tmp/tok/merges.txt'
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from meshtrain.services.common.errors import DataError

EOD_TOKEN = "<|endoftext|>"
BYTE_EOD_ID = 256  # the byte tokenizer's: ids 0..255 are the bytes, 256 ends a document
# megatron-core's TikTokenizer puts its special tokens first: <unk>, <s>, </s>, ...; </s> is EOD
MEGATRON_TIKTOKEN_EOD_ID = 2


def _paths(spec: str) -> list[str]:
    """The path strings exactly as they appear in `spec`, in order."""
    if spec == "byte" or spec.startswith("null:"):
        return []
    if spec.startswith("gpt2bpe:"):
        return spec[len("gpt2bpe:") :].split(",")
    if spec.startswith("megatron-tiktoken:"):
        return [spec[len("megatron-tiktoken:") :].split(",")[0]]
    for prefix in ("tiktoken:", "sentencepiece:"):
        if spec.startswith(prefix):
            return [spec[len(prefix) :]]
    return [spec]


def spec_files(spec: str) -> dict[str, Path]:
    """The files the tokenizer of `spec` is read from, by the name each is carried under (its
    file name; `tokenizer.json` for a folder spec), in the order the spec names them.

    Raises:
        DataError: a file the spec names is missing, or two of its files share a name.
    """
    files: dict[str, Path] = {}
    for text in _paths(str(spec)):
        path = Path(text)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer spec {spec!r} names {str(path)!r}, which is not a file")
        if path.name in files:
            raise DataError(f"tokenizer spec {spec!r} names two files called {path.name!r}")
        files[path.name] = path
    return files


# What a Hugging Face tokenizer keeps beside its tokenizer.json: its special tokens' roles
# (eos_token, which is the end of document of a model's own tokenizer) and its chat template.
COMPANIONS = ("tokenizer_config.json", "chat_template.jinja")


def companion_files(spec: str) -> dict[str, Path]:
    """The files beside a `tokenizer.json` spec that belong to it (`COMPANIONS` that exist),
    by name; none for other specs. They travel with the tokenizer.json (checkpoints carry them,
    exports ship the chat template) but are not named by the spec.

    Raises:
        DataError: as `spec_files`.
    """
    if _paths(str(spec)) != [str(spec)]:  # prefixed specs: tiktoken, SentencePiece, GPT-2 BPE
        return {}
    (path,) = spec_files(spec).values()
    if path.suffix != ".json":
        return {}
    return {name: path.parent / name for name in COMPANIONS if (path.parent / name).is_file()}


def rebase_spec(spec: str, names: list[str] | dict[str, Path], folder: str | os.PathLike) -> str:
    """`spec` naming `folder/NAME` for each of its files instead of where they were.

    Args:
        spec: the spec as recorded.
        names: the carried names, in the spec's order (`spec_files(spec)`'s keys).
        folder: where the carried files were unpacked.

    Raises:
        DataError: `names` does not match the files the spec names.
    """
    spec = str(spec)
    paths = _paths(spec)
    names = list(names)
    if len(paths) != len(names):
        raise DataError(
            f"tokenizer spec {spec!r} names {len(paths)} files, but {len(names)} were carried "
            f"({names})"
        )
    if not paths:
        return spec
    moved = [str(Path(folder) / name) for name in names]
    if spec.startswith("gpt2bpe:"):
        return "gpt2bpe:" + ",".join(moved)
    if spec.startswith("megatron-tiktoken:"):
        rest = spec[len("megatron-tiktoken:") :].split(",", 1)
        return "megatron-tiktoken:" + ",".join([moved[0], *rest[1:]])
    for prefix in ("tiktoken:", "sentencepiece:"):
        if spec.startswith(prefix):
            return prefix + moved[0]
    return moved[0]


def spec_eod_id(spec: str) -> int:
    """The end-of-document id of a spec with no `tokenizer.json` form: `null:V` (V),
    `megatron-tiktoken:PATH,...` (`</s>`, id 2), a tiktoken ranks file (the id after the largest
    rank) or a SentencePiece model (its end-of-sentence id).

    Raises:
        DataError: the spec is of another kind, or its file cannot be read.
    """
    if spec.startswith("null:"):
        try:
            size = int(spec[len("null:") :])
        except ValueError:
            size = 0
        if size < 1:
            raise DataError(f"tokenizer spec {spec!r}: expected null:VOCAB_SIZE (an integer >= 1)")
        return size
    if spec.startswith("megatron-tiktoken:"):
        path = Path(spec[len("megatron-tiktoken:") :].split(",")[0])
        if not path.is_file():
            raise DataError(f"{path}: TikTokenizer vocabulary file is missing")
        return MEGATRON_TIKTOKEN_EOD_ID
    if spec.startswith("tiktoken:"):
        return _largest_tiktoken_rank(Path(spec[len("tiktoken:") :])) + 1
    if spec.startswith("sentencepiece:"):
        return _sentencepiece_eos_id(Path(spec[len("sentencepiece:") :]))
    if spec.endswith(".tiktoken"):
        return _largest_tiktoken_rank(Path(spec)) + 1
    if spec.endswith(".model"):
        return _sentencepiece_eos_id(Path(spec))
    raise DataError(f"tokenizer spec {spec!r} has a tokenizer.json form; read its EOD from that")


def _largest_tiktoken_rank(path: Path) -> int:
    """The largest rank of a tiktoken BPE file (one `BASE64_TOKEN RANK` pair per line)."""
    if not path.is_file():
        raise DataError(f"{path}: tiktoken BPE file is missing")
    ranks = []
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected two fields")
            ranks.append(int(parts[1]))
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: not a 'BASE64_TOKEN RANK' line ({e})") from None
    if not ranks:
        raise DataError(f"{path}: tiktoken BPE file has no tokens")
    return max(ranks)


def _sentencepiece_eos_id(path: Path) -> int:
    """A SentencePiece model's end-of-sentence id."""
    import sentencepiece as spm

    if not path.is_file():
        raise DataError(f"{path}: SentencePiece model is missing")
    try:
        eos = spm.SentencePieceProcessor(model_file=str(path)).eos_id()
    except (RuntimeError, OSError) as e:
        raise DataError(f"{path}: not a valid SentencePiece model ({e})") from e
    if eos < 0:
        raise DataError(f"{path}: SentencePiece model has no end-of-sentence id for EOD")
    return int(eos)


def eos_token(config_path: Path) -> str | None:
    """The `eos_token` a Hugging Face `tokenizer_config.json` names, or None (no file, no key):
    the end of document of a model's own tokenizer.json that has no `<|endoftext|>`."""
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{config_path}: not valid JSON ({e})") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):  # an AddedToken written out: {"content": "</s>", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def gpt2bpe_tokenizer_json(spec: str, path: str | os.PathLike) -> None:
    """Write the tokenizer of a `gpt2bpe:VOCAB_JSON,MERGES_TXT` spec (GPT-2's byte-level BPE) as
    a Hugging Face `tokenizer.json` at `path`, with `<|endoftext|>` marked special so
    transformers takes it for bos/eos.

    Raises:
        DataError: the spec or its files are not GPT-2's vocabulary and merges.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    paths = spec[len("gpt2bpe:") :].split(",") if spec.startswith("gpt2bpe:") else []
    if len(paths) != 2 or not all(paths):
        raise DataError(f"tokenizer spec {spec!r}: expected gpt2bpe:VOCAB_JSON,MERGES_TXT")
    vocab_file, merge_file = Path(paths[0]), Path(paths[1])
    vocab = read_gpt2_vocab(vocab_file)
    if EOD_TOKEN not in vocab:
        raise DataError(f"{vocab_file}: vocabulary has no {EOD_TOKEN} token to mark document ends")
    try:
        tokenizer = Tokenizer(models.BPE(vocab, read_gpt2_merges(merge_file)))
    except Exception as e:  # the Rust side raises a bare Exception naming the bad merge
        raise DataError(f"{merge_file}: merges do not fit the vocabulary {vocab_file} ({e})") from e
    # GPT-2's split regex, no leading space added, bytes mapped to printable symbols
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    tokenizer.save(str(path))


def read_gpt2_vocab(path: Path) -> dict[str, int]:
    """GPT-2's `vocab.json`: a JSON object token -> id."""
    if not path.is_file():
        raise DataError(f"{path}: vocab file is missing")
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a JSON vocabulary ({e})") from None
    if not isinstance(vocab, dict) or not all(
        isinstance(v, int) and v >= 0 for v in vocab.values()
    ):
        raise DataError(f"{path}: a vocab file is a JSON object of token -> non-negative id")
    if len(set(vocab.values())) != len(vocab):
        raise DataError(f"{path}: two tokens share an id")
    return vocab


def read_gpt2_merges(path: Path) -> list[tuple[str, str]]:
    """GPT-2's `merges.txt`: one merge `A B` per line in priority order, after an optional
    `#version` line."""
    if not path.is_file():
        raise DataError(f"{path}: merge file is missing")
    merges = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise DataError(
                f"{path}:{lineno}: a merge line is two tokens separated by one space, got {line!r}"
            )
        merges.append((parts[0], parts[1]))
    return merges
