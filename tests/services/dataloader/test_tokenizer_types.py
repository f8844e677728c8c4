"""Megatron's tokenizer types (--tokenizer-type and its file flags): the ids they give, their
specs, the data-config keys and the preprocessing CLI flags that name them.

Every file is made in the test: a byte-level BPE vocab.json/merges.txt pair trained on a few
lines, a SentencePiece model trained on them, tiktoken ranks written out by hand.
"""

import base64
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from meshtrain.services.cli import main
from meshtrain.services.common.errors import ConfigError, DataError
from meshtrain.services.common.tokenizer_files import EOD_TOKEN
from meshtrain.services.dataloader.config import DataConfig
from meshtrain.services.dataloader.indexed import IndexedDataset
from meshtrain.services.dataloader.tokenizers.base import (
    HFTokenizer,
    SentencePieceTokenizer,
    absolute_spec,
    build_tokenizer,
    train_bpe,
)
from meshtrain.services.dataloader.tokenizers.megatron import (
    GPT2BPETokenizer,
    MegatronTiktokenTokenizer,
    NullTokenizer,
    megatron_spec,
)

# Unicode, whitespace runs, contractions, digits, CR/LF and a no-break space: the cases where a
# byte-level BPE's split pattern and byte mapping could differ from GPT-2's.
TEXTS = [
    "Hello world, hello  there!\n\n  Indented   code\tand tabs",
    "Ünïcödé — 日本語 🙂 it's we'll they've DON'T 12345 678.9",
    "def f(x):\n    return x  +  1\r\n",
    "   leading spaces and trailing   ",
    "",
    " ",
    "\n\n\n",
    "a  b   c    d",
    "Ωmega σ ς x\u00a0y \u3000z",
    "🙂🙂 🙂x",
    "a\r\nb\rc",
]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """vocab.json + merges.txt of a 400-token byte-level BPE, saved as GPT-2's files are."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("gpt2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 20, trainer=trainer)
    vocab, merges = tok.model.save(str(folder))
    assert Path(merges).read_text().startswith("#version")
    return vocab, merges


def _reference_gpt2_encode(text: str, vocab_file: str, merge_file: str) -> list[int]:
    """GPT-2's encoder written out in plain Python (its split regex, its byte -> symbol map, and
    merges applied lowest rank first), independent of the `tokenizers` library."""
    import regex

    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    lines = [m for m in Path(merge_file).read_text(encoding="utf-8").split("\n")[1:] if m]
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(lines)}
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbol, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbol[b] = chr(b)
        else:
            symbol[b] = chr(256 + extra)
            extra += 1
    pattern = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )
    ids = []
    for piece in pattern.findall(text):
        word = [symbol[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(word, word[1:]))]
            best = min(pairs)[0]
            if best == len(ranks):
                break
            first, second = lines[best].split(" ")
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids.extend(vocab[w] for w in word)
    return ids


def test_gpt2bpe_matches_transformers_gpt2_tokenizer(gpt2_files):
    """transformers' GPT2Tokenizer runs on the same `tokenizers` library, so GPT-2's algorithm is
    also written out in plain Python and compared."""
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_files
    ours = GPT2BPETokenizer(vocab, merges)
    theirs = GPT2Tokenizer(vocab, merges)
    assert ours.eod_id == theirs.convert_tokens_to_ids(EOD_TOKEN)
    assert ours.vocab_size == len(theirs)
    for text in TEXTS + ["".join(TEXTS)]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ids == _reference_gpt2_encode(text, vocab, merges), text
        assert ours.decode(ids) == text
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    # as Megatron's GPT-2 tokenizer: the special token's text inside a document is plain text
    assert ours.eod_id not in ours.encode(f"a {EOD_TOKEN} b")
    assert ours.decode([ours.eod_id]) == EOD_TOKEN


def test_gpt2bpe_spec_round_trip(gpt2_files, tmp_path, monkeypatch):
    vocab, merges = gpt2_files
    spec = megatron_spec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert spec == f"gpt2bpe:{Path(vocab).resolve()},{Path(merges).resolve()}"
    tok = build_tokenizer(spec)
    assert isinstance(tok, GPT2BPETokenizer) and tok.spec == spec
    assert build_tokenizer(tok.spec).encode(TEXTS[1]) == tok.encode(TEXTS[1])
    # a relative spec becomes absolute, as the other kinds' do
    monkeypatch.chdir(Path(vocab).parent)
    assert absolute_spec("gpt2bpe:vocab.json,merges.txt") == spec
    with pytest.raises(DataError, match="gpt2bpe:VOCAB_JSON,MERGES_TXT"):
        build_tokenizer(f"gpt2bpe:{vocab}")


def test_gpt2bpe_bad_files(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    with pytest.raises(DataError, match="needs --merge-file"):
        megatron_spec("GPT2BPETokenizer", vocab_file=vocab, prefix="--")
    with pytest.raises(DataError, match="needs data.vocab_file"):
        megatron_spec("GPT2BPETokenizer", merge_file=merges, prefix="data.")
    with pytest.raises(DataError, match="--merge-file='nope.txt' does not exist"):
        megatron_spec("GPT2BPETokenizer", vocab_file=vocab, merge_file="nope.txt", prefix="--")
    with pytest.raises(
        DataError, match="--tokenizer-model is not read by --tokenizer-type=GPT2BPETokenizer"
    ):
        megatron_spec(
            "GPT2BPETokenizer",
            vocab_file=vocab,
            merge_file=merges,
            tokenizer_model=vocab,
            prefix="--",
        )
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(
        json.dumps({k: v for k, v in json.loads(Path(vocab).read_text()).items() if k != EOD_TOKEN})
    )
    with pytest.raises(DataError, match=r"no <\|endoftext\|> token"):
        GPT2BPETokenizer(no_eod, merges)
    bad = tmp_path / "merges.txt"
    bad.write_text("#version: 0.2\nab\n")
    with pytest.raises(DataError, match=r"merges.txt:2: a merge line is two tokens"):
        GPT2BPETokenizer(vocab, bad)
    bad.write_text("#version: 0.2\nzz qq\n")
    with pytest.raises(DataError, match="merges do not fit the vocabulary"):
        GPT2BPETokenizer(vocab, bad)
    with pytest.raises(DataError, match="not one of GPT2BPETokenizer.*meshtrain trains GPT"):
        megatron_spec("BertWordPieceLowerCase", vocab_file=vocab)


def _megatron_null_tokenizer():
    """megatron-core's NullTokenizer, loaded from its file (it imports nothing of megatron)."""
    import megatron

    path = Path(megatron.__path__[0]) / "core/tokenizers/text/libraries/null_tokenizer.py"
    spec = importlib.util.spec_from_file_location("megatron_null_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NullTokenizer


def test_null_tokenizer_follows_megatron_core():
    reference = _megatron_null_tokenizer()(100)
    tok = build_tokenizer(megatron_spec("NullTokenizer", vocab_size=100))
    assert isinstance(tok, NullTokenizer) and tok.spec == "null:100"
    assert (tok.vocab_size, tok.eod_id) == (reference.vocab_size, reference.eod) == (101, 100)
    text = "5 0 99 17 100"
    assert tok.encode(text) == reference.text_to_ids(text) == [5, 0, 99, 17, 100]
    assert tok.decode(tok.encode(text)) == reference.ids_to_text([5, 0, 99, 17, 100]) == text
    assert tok.encode("  3\n\t4 ") == [3, 4] and tok.encode("") == []
    assert build_tokenizer(tok.spec).spec == tok.spec and absolute_spec(tok.spec) == tok.spec
    with pytest.raises(DataError, match="'x7' is not an integer id"):
        tok.encode("1 x7")
    with pytest.raises(DataError, match="id 101 is outside its vocabulary of 101"):
        tok.encode("101")
    with pytest.raises(DataError, match="needs --vocab-size"):
        megatron_spec("NullTokenizer", prefix="--")
    with pytest.raises(DataError, match="null:VOCAB_SIZE"):
        build_tokenizer("null:ten")


def _ranks(extra: list[bytes]) -> list[bytes]:
    return [bytes([i]) for i in range(256)] + extra


MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"  ", b"    ", b"\xc3\xa9"]


def _write_tiktoken(path, tokens):
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


def _write_megatron_json(path, tokens):
    path.write_text(
        json.dumps(
            [
                {
                    "rank": r,
                    "token_bytes": base64.b64encode(t).decode(),
                    "token_str": t.decode("utf-8", errors="replace"),
                }
                for r, t in enumerate(tokens)
            ]
        )
    )
    return path


def test_tiktokenizer_matches_megatron_core(tmp_path):
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

    tokens = _ranks(MERGES)
    as_json = _write_megatron_json(tmp_path / "vocab.json", tokens)
    as_tiktoken = _write_tiktoken(tmp_path / "vocab.tiktoken", tokens)
    texts = ["the thing in the theatre", "    indented\n  café", "ÿ \x00 bytes 🙂"]
    for pattern in ("v1", "v2"):
        reference = TikTokenTokenizer(
            str(as_json), pattern=pattern, num_special_tokens=1000, vocab_size=1000 + len(tokens)
        )
        for path in (as_json, as_tiktoken):
            spec = megatron_spec(
                "TikTokenizer", tokenizer_model=str(path), tiktoken_pattern=pattern
            )
            tok = build_tokenizer(spec)
            assert isinstance(tok, MegatronTiktokenTokenizer) and tok.spec == spec
            assert (
                (tok.vocab_size, tok.eod_id)
                == (reference.vocab_size, reference.eod)
                == (1000 + len(tokens), 2)
            )
            for text in texts:
                assert tok.encode(text) == reference.text_to_ids(text), (pattern, text)
                assert tok.decode(tok.encode(text)) == text
    # the special-token block and the vocabulary cut, as Megatron's flags set them
    small = build_tokenizer(
        megatron_spec(
            "TikTokenizer",
            tokenizer_model=str(as_tiktoken),
            tiktoken_num_special_tokens=10,
            vocab_size=10 + 256 + 2,
        )
    )
    assert small.vocab_size == 268 and small.spec.endswith("num_special_tokens=10,vocab_size=268")
    assert small.encode("the") == [10 + 256, 10 + ord("e")]  # "th", "he" kept, "the" (rank 258) cut
    # special-token text inside a document is plain text: only a document's end is EOD
    assert 2 not in small.encode("a </s> b")


def test_tiktokenizer_errors(tmp_path):
    path = _write_tiktoken(tmp_path / "v.tiktoken", _ranks(MERGES))
    with pytest.raises(DataError, match="--tiktoken-pattern='v3' is not one of v1, v2"):
        megatron_spec("TikTokenizer", tokenizer_model=str(path), tiktoken_pattern="v3", prefix="--")
    with pytest.raises(DataError, match="vocab_size=2000 needs 1000 ranks"):
        megatron_spec("TikTokenizer", tokenizer_model=str(path), vocab_size=2000)
    with pytest.raises(DataError, match="fewer than the 7 named special tokens"):
        megatron_spec("TikTokenizer", tokenizer_model=str(path), tiktoken_num_special_tokens=3)
    shuffled = tmp_path / "bad.json"
    _write_megatron_json(shuffled, [bytes([1]), bytes([0])] + _ranks([])[2:])
    with pytest.raises(DataError, match="entry 0 must be the single byte 0x00"):
        megatron_spec("TikTokenizer", tokenizer_model=str(shuffled))
    with pytest.raises(DataError, match="'size=3' is not one of pattern="):
        build_tokenizer(f"megatron-tiktoken:{path},size=3")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("sp")
    lines = [t for t in TEXTS if t.strip()] * 30
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(folder / "sp"),
        vocab_size=120,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
        num_threads=1,
    )
    return folder / "sp.model"


@pytest.mark.parametrize(
    "kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
)
def test_sentencepiece_type(sp_model, kind):
    from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
        SentencePieceTokenizer as MegatronSentencePiece,
    )

    spec = megatron_spec(kind, tokenizer_model=str(sp_model))
    assert spec == f"sentencepiece:{sp_model.resolve()}"
    tok = build_tokenizer(spec)
    reference = MegatronSentencePiece(str(sp_model))
    assert isinstance(tok, SentencePieceTokenizer) and tok.spec == spec
    assert tok.eod_id == reference.eos_id and tok.vocab_size == reference.vocab_size
    for text in TEXTS:
        assert tok.encode(text) == reference.text_to_ids(text), text
    with pytest.raises(DataError, match="--vocab-file is not read by --tokenizer-type=" + kind):
        megatron_spec(kind, tokenizer_model=str(sp_model), vocab_file=str(sp_model), prefix="--")


def test_huggingface_type(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(TEXTS) * 10)
    train_bpe([corpus], 300, tmp_path / "tok" / "tokenizer.json")
    for model in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        tok = build_tokenizer(megatron_spec("HuggingFaceTokenizer", tokenizer_model=str(model)))
        assert (
            isinstance(tok, HFTokenizer)
            and tok.path == (tmp_path / "tok" / "tokenizer.json").resolve()
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        DataError, match="data.tokenizer_model='.*empty' is a folder without a tokenizer.json"
    ):
        megatron_spec(
            "HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "empty"), prefix="data."
        )


def test_data_config_keys(gpt2_files):
    vocab, merges = gpt2_files
    config = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert config.tokenizer == megatron_spec(
        "GPT2BPETokenizer", vocab_file=vocab, merge_file=merges
    )
    # a resolved config (a run's config.toml) names the tokenizer both ways, the same one
    again = DataConfig(
        tokenizer=config.tokenizer,
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=vocab,
        merge_file=merges,
        data_path=["x"],
    )
    assert again.tokenizer == config.tokenizer
    assert (
        DataConfig(tokenizer_type="NullTokenizer", vocab_size=50, data_path=["x"]).tokenizer
        == "null:50"
    )
    relative = DataConfig(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=os.path.relpath(vocab),
        merge_file=os.path.relpath(merges),
    )
    assert (
        relative.vocab_file == str(Path(vocab).resolve()) and relative.tokenizer == config.tokenizer
    )
    with pytest.raises(ConfigError, match="both name the tokenizer"):
        DataConfig(tokenizer="byte", tokenizer_type="NullTokenizer", vocab_size=50)
    with pytest.raises(
        ConfigError, match="data.tokenizer_type=GPT2BPETokenizer needs data.merge_file"
    ):
        DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab)
    with pytest.raises(ConfigError, match="data.merge_file is given without data.tokenizer_type"):
        DataConfig(tokenizer="byte", merge_file=merges)
    with pytest.raises(ConfigError, match="data.tokenizer_type='GPT2' is not one of"):
        DataConfig(tokenizer_type="GPT2")


def test_preprocess_cli_with_megatron_flags(gpt2_files, tmp_path, capsys):
    vocab, merges = gpt2_files
    docs = ["first  document\n", "Ünïcödé 🙂 second", "third, with <|endoftext|> in it"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    common = [
        "data",
        "preprocess",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--quiet",
        "--append-eod",
    ]
    assert (
        main(
            common
            + [
                "--output-prefix",
                str(tmp_path / "out"),
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                vocab,
                "--merge-file",
                merges,
            ]
        )
        == 0
    )
    tok = GPT2BPETokenizer(vocab, merges)
    ds = IndexedDataset(tmp_path / "out")
    want = [tok.encode(d) + [tok.eod_id] for d in docs]
    assert ds.num_documents == 3
    assert np.array_equal(ds.read_tokens(0, ds.num_tokens), np.concatenate(want))
    (tmp_path / "ids.jsonl").write_text(json.dumps({"text": "1 2 3"}) + "\n")
    assert (
        main(
            [
                "data",
                "preprocess",
                "--input",
                str(tmp_path / "ids.jsonl"),
                "--quiet",
                "--append-eod",
                "--output-prefix",
                str(tmp_path / "null"),
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "10",
            ]
        )
        == 0
    )
    null = IndexedDataset(tmp_path / "null")
    assert null.read_tokens(0, null.num_tokens).tolist() == [1, 2, 3, 10]
    capsys.readouterr()
    for extra, match in [
        (
            ["--tokenizer", "byte", "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"],
            "both name the tokenizer",
        ),
        (
            ["--tokenizer", "byte", "--merge-file", merges],
            "--merge-file is given without --tokenizer-type",
        ),
        ([], "name the tokenizer: --tokenizer SPEC, or Megatron's --tokenizer-type"),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab], "needs --merge-file"),
    ]:
        assert main(common + ["--output-prefix", str(tmp_path / "bad")] + extra) != 0
        assert match in capsys.readouterr().err
        assert not (tmp_path / "bad.bin").exists()


def test_hf_export_tokenizer_of_megatron_types(gpt2_files, caplog):
    """A run's gpt2bpe tokenizer exports as a tokenizer.json with the same ids; the kinds with no
    tokenizer.json form export without one, but with their EOD id."""
    from tokenizers import Tokenizer

    from meshtrain.services.checkpoint.hf import tokenizer as hf_tokenizer
    from meshtrain.services.common.model_config import ModelConfig

    vocab, merges = gpt2_files
    spec = megatron_spec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ours = build_tokenizer(spec)
    model = ModelConfig(
        vocab_size=512, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32
    )
    path = hf_tokenizer.tokenizer_file(spec, "test")
    exported = Tokenizer.from_file(str(path))
    for text in TEXTS:
        assert exported.encode(text, add_special_tokens=False).ids == ours.encode(text)
    assert hf_tokenizer.eod_id(path, spec, model, "test") == ours.eod_id
    config = hf_tokenizer.tokenizer_config(path, model, "test")
    assert config["eos_token"] == config["bos_token"] == EOD_TOKEN
    assert hf_tokenizer.tokenizer_file("null:100", "test") is None
    assert "no Hugging Face tokenizer.json form" in caplog.text
    assert hf_tokenizer.eod_id(None, "null:100", model, "test") == 100


def test_huggingface_type_eod_from_eos_token(tmp_path):
    """A model's own tokenizer without <|endoftext|> (Llama's, Mistral's) ends documents with the
    eos_token of its tokenizer_config.json, as Megatron's HuggingFaceTokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate("abcdefgh ")}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    folder = tmp_path / "model"
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    with pytest.raises(DataError, match="nor an eos_token"):
        build_tokenizer(megatron_spec("HuggingFaceTokenizer", tokenizer_model=str(folder)))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tok = build_tokenizer(megatron_spec("HuggingFaceTokenizer", tokenizer_model=str(folder)))
    assert tok.eod_id == 2 and tok.encode("bad") == [4, 3, 6]
