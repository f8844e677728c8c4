"""Tokenizers: a UTF-8 byte tokenizer, Hugging Face `tokenizer.json` files, and BPE training.

Every tokenizer has the same small surface (`vocab_size`, `eod_id`, `encode`, `encode_batch`,
`decode`, `spec`) so preprocessing and the trainer never care which one they hold. A tokenizer
is named by a *spec* string: `"byte"`, the path of a Hugging Face `tokenizer.json` (or a folder
holding one), a tiktoken BPE file (`*.tiktoken`, or `tiktoken:PATH`), or a SentencePiece model
(`*.model`, or `sentencepiece:PATH`), or one of Megatron's tokenizer types
(`gpt2bpe:VOCAB_JSON,MERGES_TXT`, `null:VOCAB_SIZE`, `megatron-tiktoken:PATH,...`; see
`megatron.py`); `build_tokenizer(spec)` turns a spec back into a tokenizer, which is
how the spec travels in configs and over the wire.

    tok = train_bpe(["a.txt", "b.txt"], vocab_size=4096, output_path="out/tokenizer.json")
    build_tokenizer(tok.spec).encode("hello")
"""

from __future__ import annotations

import abc
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from meshtrain.services.common.errors import DataError
from meshtrain.services.common.tokenizer_files import EOD_TOKEN, eos_token
from meshtrain.services.dataloader.inputs import iter_documents, refuse_compressed

if TYPE_CHECKING:
    import tokenizers

log = logging.getLogger(__name__)

# Bounded memory while training: files are fed to the trainer in pieces of about this size.
_TRAIN_CHUNK_CHARS = 1 << 20


class Tokenizer(abc.ABC):
    """Abstract base: what preprocessing and training need from a tokenizer."""

    #: short human-readable kind, e.g. "byte" or "hf"
    name: str = "tokenizer"

    @property
    @abc.abstractmethod
    def spec(self) -> str:
        """The string `build_tokenizer` accepts to rebuild this tokenizer."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, specials included."""

    @property
    @abc.abstractmethod
    def eod_id(self) -> int:
        """Id of the end-of-document token appended after each document."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of one text."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode several texts; subclasses may do it in parallel.

        Args:
            texts: documents to encode.

        Returns:
            One id list per text, in order.
        """
        return [self.encode(t) for t in texts]

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """Token ids of a text in which special tokens (a chat template's `<|im_start|>`, ...)
        are written out and must become their ids; `encode` reads them as plain text, so that a
        document that mentions one never gets it.

        Raises:
            DataError: this kind of tokenizer cannot parse special tokens out of text.
        """
        raise DataError(
            f"{self}: chat templates need a tokenizer that parses special tokens out of text "
            "(a Hugging Face tokenizer.json, tiktoken, or 'byte')"
        )

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of a sequence of ids."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus end-of-document 256 (vocabulary 257)."""

    name = "byte"

    @property
    def spec(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_special_tokens(self, text: str) -> list[int]:
        # no special tokens: a chat template's markers are bytes like any other text
        return self.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; EOD renders as `<|endoftext|>`, invalid UTF-8 as U+FFFD."""
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eod_id:
                parts.append(run.decode("utf-8", errors="replace"))
                parts.append(EOD_TOKEN)
                run = bytearray()
            elif 0 <= i < 256:
                run.append(i)
            else:
                raise DataError(f"byte tokenizer: id {i} is outside its vocabulary of 257")
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


class RustTokenizer(Tokenizer):
    """A tokenizer run by the Hugging Face `tokenizers` library: subclasses set `_tok` (a
    `tokenizers.Tokenizer`), `_vocab` and `_eod`."""

    _tok: tokenizers.Tokenizer
    _vocab: int
    _eod: int

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eod_id(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # The Rust side parallelizes over the batch. The `_fast` variant skips the character
        # offsets (which nothing here uses): the same ids, more tokens/s on one core (measured:
        # BENCHMARKS.md, 'Data service').
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def encode_with_special_tokens(self, text: str) -> list[int]:
        # a second handle on the same model that parses special tokens: `_tok` must not
        special = getattr(self, "_special_tok", None)
        if special is None:
            import tokenizers as hf

            special = hf.Tokenizer.from_str(self._tok.to_str())
            special.encode_special_tokens = False
            self._special_tok = special
        return special.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HFTokenizer(RustTokenizer):
    """A Hugging Face `tokenizers` `tokenizer.json`; EOD is its `<|endoftext|>` token, else the
    `eos_token` of the `tokenizer_config.json` beside it."""

    name = "hf"

    def __init__(self, path: str | os.PathLike):
        """Args:
        path: the `tokenizer.json` file.
        """
        import tokenizers as hf  # the Hugging Face package, not this module

        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: tokenizer file is missing")
        try:
            self._tok = hf.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise DataError(f"{self.path}: not a valid Hugging Face tokenizer.json ({e})") from e
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            # a model's own tokenizer (Llama's, Mistral's) ends documents with its eos_token, as
            # Megatron's HuggingFaceTokenizer does
            eos = eos_token(self.path.parent / "tokenizer_config.json")
            eod = None if eos is None else self._tok.token_to_id(eos)
        if eod is None:
            raise DataError(
                f"{self.path}: tokenizer has no {EOD_TOKEN} token, nor an eos_token (in a "
                "tokenizer_config.json beside it) that it holds, to mark document ends"
            )
        self._eod = int(eod)
        # A document that merely mentions "<|endoftext|>" (code, docs) must not get a document
        # boundary in its middle: special tokens in the text are encoded as text, as the byte
        # tokenizer and tiktoken's encode_ordinary do. EOD comes only from document ends.
        self._tok.encode_special_tokens = True
        self._vocab = int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def spec(self) -> str:
        return str(self.path)


# The split pattern of tiktoken's cl100k encoding: a .tiktoken file holds only the merge
# ranks, so the pre-tokenization regex has to come from somewhere; this is the common one.
TIKTOKEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one `BASE64_TOKEN RANK` pair per line.

    Args:
        path: the `.tiktoken` file.

    Returns:
        token bytes -> merge rank.
    """
    import base64
    import binascii

    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: tiktoken BPE file is missing")
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    for lineno, line in enumerate(p.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected two fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise DataError(f"{p}:{lineno}: not a 'BASE64_TOKEN RANK' line ({e})") from None
        # tiktoken's Rust core panics (a BaseException, with a Rust dump) on a repeated rank and
        # overflows on one outside u32; a repeated token would silently drop one of the ranks
        if not 0 <= rank < 2**32 - 1:
            raise DataError(f"{p}:{lineno}: rank {rank} is outside [0, 2^32 - 1)")
        if rank in line_of_rank:
            raise DataError(
                f"{p}:{lineno}: rank {rank} is already given on line {line_of_rank[rank]}"
            )
        if token in ranks:
            raise DataError(f"{p}:{lineno}: token {token!r} is already given (rank {ranks[token]})")
        ranks[token] = rank
        line_of_rank[rank] = lineno
    if not ranks:
        raise DataError(f"{p}: tiktoken BPE file has no tokens")
    # every text breaks down to single bytes: without one, encoding text that holds it panics
    missing = [i for i in range(256) if bytes([i]) not in ranks]
    if missing:
        shown = ", ".join(f"0x{i:02x}" for i in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise DataError(
            f"{p}: tiktoken BPE file has no token for {len(missing)} of the 256 single bytes "
            f"({shown}); text holding them could not be encoded"
        )
    return ranks


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE ranks file; `<|endoftext|>` gets the id after the largest rank."""

    name = "tiktoken"

    def __init__(self, path: str | os.PathLike):
        """Args:
        path: the `.tiktoken` ranks file.
        """
        import tiktoken

        self.path = Path(path)
        ranks = read_tiktoken_ranks(self.path)
        self._eod = max(ranks.values()) + 1
        try:
            self._enc = tiktoken.Encoding(
                name=self.path.stem,
                pat_str=TIKTOKEN_PATTERN,
                mergeable_ranks=ranks,
                special_tokens={EOD_TOKEN: self._eod},
            )
        except ValueError as e:
            raise DataError(f"{self.path}: not a usable tiktoken BPE file ({e})") from e

    @property
    def spec(self) -> str:
        return f"tiktoken:{self.path}"

    @property
    def vocab_size(self) -> int:
        return self._eod + 1

    @property
    def eod_id(self) -> int:
        return self._eod

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # one thread: preprocessing scales with --workers processes, which tiktoken's own
        # thread pool would oversubscribe
        return self._enc.encode_ordinary_batch(list(texts), num_threads=1)

    def encode_with_special_tokens(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`; EOD is the model's end-of-sentence id."""

    name = "sentencepiece"

    def __init__(self, path: str | os.PathLike):
        """Args:
        path: the SentencePiece model file.
        """
        import sentencepiece as spm

        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: SentencePiece model is missing")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise DataError(f"{self.path}: not a valid SentencePiece model ({e})") from e
        if self._sp.eos_id() < 0:
            raise DataError(f"{self.path}: SentencePiece model has no end-of-sentence id for EOD")

    @property
    def spec(self) -> str:
        return f"sentencepiece:{self.path}"

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod_id(self) -> int:
        return int(self._sp.eos_id())

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def _iter_text_chunks(files: list[str | os.PathLike], json_key: str = "text") -> Iterator[str]:
    """Yield the files' text as preprocess reads it: each JSONL line's (or Parquet row's)
    `json_key` field, one document at a time; any other file's text in pieces of about
    `_TRAIN_CHUNK_CHARS`, split at line ends."""
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise DataError(f"{path}: BPE training file is missing")
        if path.suffix in (".jsonl", ".json", ".parquet"):
            # the documents, not the lines: trained on those, the merges would learn the JSON
            # around the text ('{"text": "'), which the documents preprocess stores never hold
            yield from iter_documents(path, json_key)
            continue
        refuse_compressed(path)
        buf: list[str] = []
        size = 0
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                buf.append(line)
                size += len(line)
                if size >= _TRAIN_CHUNK_CHARS:
                    yield "".join(buf)
                    buf, size = [], 0
        if buf:
            yield "".join(buf)


def train_bpe(
    files: list[str | os.PathLike],
    vocab_size: int,
    output_path: str | os.PathLike,
    json_key: str = "text",
) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style) on text files and save it as `tokenizer.json`.

    Args:
        files: read as `meshtrain data preprocess` reads them: `.jsonl`/`.json` (the text under
            `json_key` of each line) and `.parquet` (column `json_key`) files, any other file as
            UTF-8 text (undecodable bytes become U+FFFD). A gzip, bzip2, xz, zstd or zip file is
            an error.
        vocab_size: target vocabulary including the 256 byte symbols and `<|endoftext|>`.
        output_path: where to write the `tokenizer.json`.
        json_key: the field (or Parquet column) holding the text.

    Returns:
        The trained tokenizer, loaded back from `output_path`.
    """
    from tokenizers import Tokenizer as HFRaw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise DataError(
            f"BPE vocab_size {vocab_size} is too small: 256 bytes + {EOD_TOKEN} need 257 ids "
            "plus merges"
        )
    if not files:
        raise DataError("train_bpe: no training files given")
    tok = HFRaw(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        # all 256 byte symbols, so any input encodes even if a byte never occurs in training
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chars = 0

    def counted() -> Iterator[str]:
        nonlocal chars
        for chunk in _iter_text_chunks(files, json_key):
            chars += len(chunk)
            yield chunk

    tok.train_from_iterator(counted(), trainer=trainer)
    trained = tok.get_vocab_size()
    if trained < vocab_size:
        # BPE merges only pairs that occur in the text: a small text runs out of them.
        log.warning(
            "BPE tokenizer trained with %d tokens, fewer than the %d asked for: its training "
            "text (%d characters) is too small for that many merges (it ran out of pairs to "
            "merge after %d); give it more text or ask for a smaller vocabulary",
            trained,
            vocab_size,
            chars,
            trained - 257,
        )
    out = Path(output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return HFTokenizer(out)


def absolute_spec(spec: str | os.PathLike) -> str:
    """`spec` with its file or folder made absolute, so it names the same tokenizer from any
    working directory (a run records its tokenizer in its checkpoints, which `meshtrain ckpt
    export` reads from wherever it is run). `"byte"` is returned as it is.
    """
    s = str(spec)
    if s == "byte":
        return s
    from meshtrain.services.dataloader.tokenizers.megatron import absolute_megatron_spec

    megatron = absolute_megatron_spec(s)
    if megatron is not None:
        return megatron
    for kind in ("tiktoken:", "sentencepiece:"):
        if s.startswith(kind):
            return kind + os.path.abspath(s[len(kind) :])
    return os.path.abspath(s)


def build_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """Turn a tokenizer spec into a tokenizer.

    Args:
        spec: see the module docstring for the accepted forms.

    Returns:
        A ByteTokenizer, HFTokenizer, TiktokenTokenizer, SentencePieceTokenizer, or one of
        `megatron.py`'s GPT2BPETokenizer, NullTokenizer, MegatronTiktokenTokenizer.
    """
    s = str(spec)
    if s == "byte":
        return ByteTokenizer()
    from meshtrain.services.dataloader.tokenizers.megatron import build_megatron_tokenizer

    megatron = build_megatron_tokenizer(s)
    if megatron is not None:
        return megatron
    if s.startswith("tiktoken:"):
        return TiktokenTokenizer(s[len("tiktoken:") :])
    if s.startswith("sentencepiece:"):
        return SentencePieceTokenizer(s[len("sentencepiece:") :])
    path = Path(s)
    if path.is_file():
        if path.suffix == ".tiktoken":
            return TiktokenTokenizer(path)
        if path.suffix == ".model":
            return SentencePieceTokenizer(path)
        return HFTokenizer(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json")
    # A spec that is not a keyword is a path; a mistyped one is far likelier than an unknown
    # format, so say the path is missing rather than list the formats.
    if not path.exists():
        raise DataError(
            f"tokenizer file {s!r} does not exist: check the path, or pass "
            f"--tokenizer byte for the built-in byte tokenizer"
        )
    if path.is_dir():
        raise DataError(
            f"tokenizer folder {s!r} holds no tokenizer.json: name the tokenizer file itself"
        )
    raise DataError(
        f"tokenizer spec {s!r} is not understood: expected 'byte', a tokenizer.json (or its "
        "folder), a .tiktoken file or tiktoken:PATH, a SentencePiece .model or "
        "sentencepiece:PATH, gpt2bpe:VOCAB_JSON,MERGES_TXT, null:VOCAB_SIZE or "
        "megatron-tiktoken:PATH"
    )
