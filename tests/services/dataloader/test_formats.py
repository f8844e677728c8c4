"""tiktoken and SentencePiece tokenizers, Parquet input,
and `--workers N` giving identical output."""

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.indexed import IndexedDataset
from meshtrain.services.dataloader.preprocess import preprocess_files
from meshtrain.services.dataloader.tokenizers.base import ByteTokenizer, build_tokenizer

TEXT = "the theme of the thesis is that the theatre there is theirs. " * 3


def _tiktoken_file(path):
    """256 byte tokens plus a few merges; tiktoken needs every merge's halves ranked lower."""
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"he", b"is"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return path


def test_tiktoken_roundtrip_and_merges(tmp_path):
    tok = build_tokenizer(str(_tiktoken_file(tmp_path / "tiny.tiktoken")))
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert 258 in ids and len(ids) < len(TEXT.encode())  # " the" merged
    assert tok.eod_id == 261 and tok.vocab_size == 262
    assert build_tokenizer(tok.spec).encode(TEXT) == ids


def test_tiktoken_bad_file(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64 at all\n")
    with pytest.raises(DataError, match="bad.tiktoken:1"):
        build_tokenizer(str(bad))


@pytest.mark.parametrize(
    "extra,match",
    [
        ([(b"th", 5)], r"bad.tiktoken:257: rank 5 is already given on line 6"),  # tiktoken panicked
        ([(b"th", -1)], r"bad.tiktoken:257: rank -1 is outside"),  # OverflowError
        ([(b"th", 2**32)], r"bad.tiktoken:257: rank 4294967296 is outside"),
        (
            [(b"th", 256), (b"th", 257)],
            r"bad.tiktoken:258: token b'th' is already given \(rank 256\)",
        ),
    ],
)
def test_tiktoken_inconsistent_ranks_name_the_line(tmp_path, extra, match):
    lines = [(bytes([i]), i) for i in range(256)] + extra
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in lines))
    with pytest.raises(DataError, match=match):
        build_tokenizer(str(bad))


def test_tiktoken_without_every_single_byte_is_refused_when_loaded(tmp_path):
    """tiktoken panicked (a BaseException) on the first text holding a byte it has no token for."""
    bad = tmp_path / "bad.tiktoken"
    bad.write_text(
        "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256) if i != 0x63)
    )
    with pytest.raises(
        DataError, match=r"bad.tiktoken: .* no token for 1 of the 256 single bytes \(0x63\)"
    ):
        build_tokenizer(str(bad))


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("spm")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} {TEXT}" for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "m"), vocab_size=80, model_type="bpe", minloglevel=2
    )
    return d / "m.model"


def test_sentencepiece_roundtrip(spm_model):
    tok = build_tokenizer(str(spm_model))
    ids = tok.encode("the theme of the thesis")
    assert tok.decode(ids) == "the theme of the thesis"
    assert tok.vocab_size == 80 and 0 <= tok.eod_id < 80
    assert tok.encode_batch(["the", "theme"]) == [tok.encode("the"), tok.encode("theme")]


def test_parquet_input(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"doc {i} " * (i % 5 + 1) for i in range(30)]
    pq.write_table(
        pa.table({"text": texts, "n": list(range(30))}), tmp_path / "in.parquet", row_group_size=7
    )
    prefix = preprocess_files([tmp_path / "in.parquet"], tmp_path / "out", ByteTokenizer())
    ds = IndexedDataset(prefix)
    assert ds.num_documents == 30
    assert bytes(ds[4][:-1].astype(np.uint8)).decode() == texts[4]
    with pytest.raises(DataError, match="no column 'body'"):
        preprocess_files(
            [tmp_path / "in.parquet"], tmp_path / "o2", ByteTokenizer(), json_key="body"
        )


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    """pyarrow is the `parquet` extra: without it, a .parquet input says what to install."""
    (tmp_path / "in.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(
        __import__("sys").modules, "pyarrow", None
    )  # `import pyarrow` raises ImportError
    with pytest.raises(
        DataError, match=r"in.parquet: reading Parquet needs pyarrow.*meshtrain\[parquet\]"
    ):
        preprocess_files([tmp_path / "in.parquet"], tmp_path / "out", ByteTokenizer())


def test_a_null_in_the_parquet_text_column_is_an_error_naming_the_row(tmp_path):
    # it used to be dropped silently (3 rows, 2 documents) where JSONL's null is a DataError
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"doc {i}" for i in range(1500)]  # the null sits in the second 1024-row read
    texts[1100] = None
    pq.write_table(pa.table({"text": texts}), tmp_path / "in.parquet")
    with pytest.raises(
        DataError, match=r"in.parquet: row 1100 \(counting from 0\): 'text' is null"
    ):
        preprocess_files([tmp_path / "in.parquet"], tmp_path / "out", ByteTokenizer())
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin").exists()


def test_workers_give_identical_output(tmp_path):
    """Two spawned workers must write the very bytes one process writes (batch order is fixed)."""
    import meshtrain.services.dataloader.preprocess as pre

    rng = np.random.default_rng(0)
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(
            json.dumps({"text": "x" * int(rng.integers(0, 50)) + f" doc {i}"}) + "\n"
            for i in range(700)
        )  # > 2 batches of 256 documents
    one = preprocess_files([tmp_path / "in.jsonl"], tmp_path / "one", ByteTokenizer(), workers=1)
    two = preprocess_files([tmp_path / "in.jsonl"], tmp_path / "two", ByteTokenizer(), workers=2)
    for ext in (".bin", ".idx"):
        assert Path(one + ext).read_bytes() == Path(two + ext).read_bytes()
    assert pre._BATCH_DOCS < 700


def test_bad_json_line_names_file_and_line(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"in.jsonl:2"):
        preprocess_files([tmp_path / "in.jsonl"], tmp_path / "o", ByteTokenizer())
