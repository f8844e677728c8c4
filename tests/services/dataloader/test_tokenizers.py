"""Byte and Hugging Face tokenizers, BPE training, and tokenizer specs."""

import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.common.tokenizer_files import EOD_TOKEN
from meshtrain.services.dataloader.tokenizers.base import (
    ByteTokenizer,
    HFTokenizer,
    absolute_spec,
    build_tokenizer,
    train_bpe,
)

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Ünïcödé — 日本語 text, emoji 🙂 and tabs\tand newlines\n" * 3,
]


@pytest.fixture
def corpus(tmp_path):
    files = []
    for i, t in enumerate(TEXTS * 4):
        p = tmp_path / f"f{i}.txt"
        p.write_text(t * (i + 1), encoding="utf-8")
        files.append(str(p))
    return files


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eod_id == 256 and tok.spec == "byte"
    for t in TEXTS:
        ids = tok.encode(t)
        assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == t
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.decode(tok.encode("a") + [256] + tok.encode("b")) == "a" + EOD_TOKEN + "b"
    with pytest.raises(DataError, match="257"):
        tok.decode([300])


def test_train_bpe_round_trip_and_determinism(tmp_path, corpus):
    tok = train_bpe(corpus, 300, tmp_path / "a" / "tokenizer.json")
    assert isinstance(tok, HFTokenizer)
    assert 257 <= tok.vocab_size <= 300
    assert tok.decode([tok.eod_id]) == EOD_TOKEN
    for t in TEXTS:
        ids = tok.encode(t)
        assert tok.decode(ids) == t
        assert EOD_TOKEN not in tok.decode(ids)
    # merges actually compress the training text
    assert len(tok.encode(TEXTS[1])) < len(TEXTS[1].encode())
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    # same files, fresh trainer: the saved tokenizer must be byte-identical
    again = train_bpe(corpus, 300, tmp_path / "b" / "tokenizer.json")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    assert again.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_build_tokenizer_specs(tmp_path, corpus):
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    tok = train_bpe(corpus, 280, tmp_path / "tok" / "tokenizer.json")
    by_file = build_tokenizer(tok.spec)
    by_dir = build_tokenizer(tmp_path / "tok")
    assert by_file.encode(TEXTS[0]) == by_dir.encode(TEXTS[0]) == tok.encode(TEXTS[0])
    with pytest.raises(DataError, match="does not exist.*byte"):
        build_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="byte"):
        build_tokenizer("gpt2")


def test_hf_tokenizer_errors(tmp_path):
    from tokenizers import Tokenizer, models

    no_eod = tmp_path / "no_eod.json"
    Tokenizer(models.BPE()).save(str(no_eod))
    with pytest.raises(DataError, match=r"no_eod.json.*endoftext"):
        HFTokenizer(no_eod)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        HFTokenizer(bad)
    with pytest.raises(DataError, match="missing"):
        HFTokenizer(tmp_path / "absent.json")


def test_train_bpe_errors(tmp_path):
    with pytest.raises(DataError, match="missing"):
        train_bpe([str(tmp_path / "absent.txt")], 300, tmp_path / "t.json")
    with pytest.raises(DataError, match="too small"):
        train_bpe([str(tmp_path / "absent.txt")], 100, tmp_path / "t.json")


def test_the_eod_text_inside_a_document_is_text_not_a_document_end(tmp_path, corpus):
    # Only document ends get EOD; code or docs that mention the token keep it as characters
    # (as the byte tokenizer and tiktoken's encode_ordinary do).
    tok = train_bpe(corpus, 300, tmp_path / "tokenizer.json")
    text = f"print('{EOD_TOKEN}')"
    for ids in (tok.encode(text), tok.encode_batch([text])[0]):
        assert tok.eod_id not in ids and tok.decode(ids) == text


def test_absolute_spec_names_the_same_file_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("byte") == "byte"
    assert absolute_spec("tok/tokenizer.json") == str(tmp_path / "tok" / "tokenizer.json")
    assert absolute_spec("tiktoken:enc.tiktoken") == f"tiktoken:{tmp_path / 'enc.tiktoken'}"
    assert absolute_spec("sentencepiece:sp.model") == f"sentencepiece:{tmp_path / 'sp.model'}"
    assert absolute_spec("/abs/tokenizer.json") == "/abs/tokenizer.json"


def test_a_missing_tokenizer_file_is_named_as_missing(tmp_path):
    with pytest.raises(DataError, match="does not exist") as e:
        build_tokenizer(tmp_path / "nope.json")
    assert "not understood" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match="holds no tokenizer.json"):
        build_tokenizer(tmp_path)


def test_a_corpus_too_small_for_the_vocabulary_asked_is_named_in_a_warning(tmp_path, caplog):
    """The embedded corpus trained 27,233 of the 50,257 tokens asked without a word: a BPE
    stops merging when its text runs out of pairs, and the log now says so with both numbers."""
    text = tmp_path / "tiny.txt"
    text.write_text("the cat sat on the mat\n" * 20)
    with caplog.at_level("WARNING", logger="meshtrain.services.dataloader.tokenizers.base"):
        tok = train_bpe([text], 50257, tmp_path / "tok.json")
    assert tok.vocab_size < 50257
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        f"trained with {tok.vocab_size} tokens, fewer than the 50257 asked for" in m
        and "too small for that many merges" in m
        for m in warned
    ), warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="meshtrain.services.dataloader.tokenizers.base"):
        train_bpe([text], 260, tmp_path / "small.json")  # reached: nothing to say
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
