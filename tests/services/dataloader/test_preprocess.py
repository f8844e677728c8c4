"""Preprocessing text into indexed datasets, the stdlib corpus, and the cached default dataset."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader import preprocess
from meshtrain.services.dataloader.indexed import IndexedDataset
from meshtrain.services.dataloader.preprocess import (
    default_corpus_files,
    prepare_default_dataset,
    preprocess_files,
)
from meshtrain.services.dataloader.tokenizers.base import ByteTokenizer, build_tokenizer, train_bpe


def test_preprocess_jsonl_and_text(tmp_path):
    docs = ["first doc", "", "second — ünïcode", "third\nwith lines"]
    jl = tmp_path / "a.jsonl"
    jl.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    txt = tmp_path / "b.py"
    txt.write_bytes(b"print('hi')\n\xff\n")  # invalid UTF-8 is replaced, not fatal
    tok = ByteTokenizer()
    prefix = preprocess_files([jl, txt], tmp_path / "out" / "ds", tok)
    ds = IndexedDataset(prefix)
    expected = [tok.encode(d) + [256] for d in docs] + [tok.encode("print('hi')\n\ufffd\n") + [256]]
    assert ds.dtype == np.uint16 and len(ds) == len(expected)
    assert [ds[i].tolist() for i in range(len(ds))] == expected


def test_text_files_keep_their_line_ends_byte_for_byte(tmp_path):
    # a text-mode read used to store CRLF and a lone CR as LF: the tokens were not the file's
    raw = b"a\r\nb\rc\n"
    (tmp_path / "win.txt").write_bytes(raw)
    ds = IndexedDataset(
        preprocess_files([tmp_path / "win.txt"], tmp_path / "ds", ByteTokenizer(), append_eod=False)
    )
    assert ds[0].tolist() == list(raw)


@pytest.mark.parametrize("workers", [1, 2])
def test_json_escaped_lone_surrogates_become_replacement_characters(tmp_path, workers):
    jl = tmp_path / "a.jsonl"
    jl.write_text(
        '{"text": "bad \\ud800 x"}\n{"text": "pair \\ud83d\\ude00"}\n'
    )  # web text has these
    sample = tmp_path / "sample.txt"
    sample.write_text("bad pair x " * 50)
    hf = train_bpe([sample], 300, tmp_path / "tokenizer.json")
    for name, tok in (("byte", ByteTokenizer()), ("hf", hf)):
        ds = IndexedDataset(
            preprocess_files([jl], tmp_path / f"{name}{workers}", tok, workers=workers)
        )
        assert [ds[i].tolist() for i in range(len(ds))] == [
            tok.encode("bad \ufffd x") + [tok.eod_id],
            tok.encode("pair \U0001f600") + [tok.eod_id],
        ]


def test_preprocess_without_eod_skips_empty_documents(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"content": "ab"}\n{"content": ""}\n{"content": "c"}\n')
    ds = IndexedDataset(
        preprocess_files(
            [jl], tmp_path / "ds", ByteTokenizer(), json_key="content", append_eod=False
        )
    )
    assert [ds[i].tolist() for i in range(len(ds))] == [[97, 98], [99]]


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"text": "ok"}\n{broken\n', r"a.jsonl:2"),
        ('{"body": "x"}\n', r"a.jsonl:1.*'text'"),
        ('{"text": 5}\n', r"a.jsonl:1.*int"),
    ],
)
def test_preprocess_bad_json_names_file_and_line(tmp_path, content, match):
    jl = tmp_path / "a.jsonl"
    jl.write_text(content)
    with pytest.raises(DataError, match=match):
        preprocess_files([jl], tmp_path / "ds", ByteTokenizer())
    assert not (tmp_path / "ds.idx").exists() and not (tmp_path / "ds.bin").exists()


def _zip(data: bytes) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.jsonl", data)
    return buf.getvalue()


@pytest.mark.parametrize(
    "name,compress,kind",
    [
        ("a.jsonl.gz", "gzip", "gzip"),
        ("a.jsonl.bz2", "bz2", "bzip2"),
        ("a.jsonl.xz", "lzma", "xz"),
        ("a.jsonl", "gzip", "gzip"),
        ("a.zip", None, "zip"),
    ],
)
def test_compressed_input_is_an_error_not_binary_noise(tmp_path, name, compress, kind):
    """A `.jsonl.gz` used to be read as one text document:
    its compressed bytes became the tokens."""
    import importlib

    data = b'{"text": "hello world"}\n'
    path = tmp_path / name
    path.write_bytes(importlib.import_module(compress).compress(data) if compress else _zip(data))
    with pytest.raises(DataError, match=rf"{name}: is {kind}-compressed; decompress it first"):
        preprocess_files([path], tmp_path / "ds", ByteTokenizer())
    assert not (tmp_path / "ds.idx").exists() and not (tmp_path / "ds.bin").exists()


def test_text_that_merely_starts_like_bzip2_is_text(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"BZh91AY is not a bzip2 block")
    ds = IndexedDataset(
        preprocess_files([tmp_path / "a.txt"], tmp_path / "ds", ByteTokenizer(), append_eod=False)
    )
    assert ds[0].tolist() == list(b"BZh91AY is not a bzip2 block")


def test_preprocess_missing_input(tmp_path):
    with pytest.raises(DataError, match="nope.txt"):
        preprocess_files([tmp_path / "nope.txt"], tmp_path / "ds", ByteTokenizer())
    with pytest.raises(DataError, match="no input files"):  # it used to write an empty dataset
        preprocess_files([], tmp_path / "ds", ByteTokenizer())
    assert list(tmp_path.iterdir()) == []


def test_default_corpus_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = default_corpus_files(300_000)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert sum(f.stat().st_size for f in files) <= 300_000
    skipped = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    assert not any(skipped & set(r.split("/")[:-1]) for r in rel)
    # a bigger budget extends the same ordered list
    more = default_corpus_files(600_000)
    assert more[: len(files)] == files and len(more) > len(files)


def _no_temp_dirs(cache):
    return [p.name for p in Path(cache).iterdir() if p.name.startswith(".tmp")] == []


def test_prepare_default_dataset_byte_cached(tmp_path):
    cache = tmp_path / "cache"
    d = prepare_default_dataset(cache, tokenizer="byte", max_bytes=200_000)
    assert d.tokenizer_spec == "byte" and d.vocab_size == 257 and d.eod_id == 256
    ds = IndexedDataset(d.prefix)
    files = default_corpus_files(200_000)
    assert len(ds) == len(files)
    first = files[0].read_text(encoding="utf-8", errors="replace")
    assert ds[0].tolist() == list(first.encode()) + [256]
    mtime = Path(d.prefix + ".bin").stat().st_mtime_ns
    again = prepare_default_dataset(cache, tokenizer="byte", max_bytes=200_000)
    assert again == d and Path(d.prefix + ".bin").stat().st_mtime_ns == mtime
    assert _no_temp_dirs(cache)
    # a different recipe is a different cache entry
    other = prepare_default_dataset(cache, tokenizer="byte", max_bytes=100_000)
    assert Path(other.prefix).parent != Path(d.prefix).parent


def test_prepare_default_dataset_bpe(tmp_path):
    d = prepare_default_dataset(tmp_path, tokenizer="bpe", vocab_size=400, max_bytes=100_000)
    tok = build_tokenizer(d.tokenizer_spec)
    assert d.tokenizer_spec.endswith("tokenizer.json") and tok.vocab_size == d.vocab_size <= 400
    assert tok.eod_id == d.eod_id
    ds = IndexedDataset(d.prefix)
    first = default_corpus_files(100_000)[0].read_text(encoding="utf-8", errors="replace")
    assert tok.decode(ds[0][:-1].tolist()) == first and ds[0][-1] == d.eod_id


def test_failed_build_leaves_no_cache(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(preprocess, "preprocess_files", boom)
    with pytest.raises(RuntimeError):
        prepare_default_dataset(tmp_path, tokenizer="byte", max_bytes=50_000)
    assert list(tmp_path.iterdir()) == []


def test_prepare_default_dataset_bad_tokenizer(tmp_path):
    with pytest.raises(DataError, match="'bpe', 'byte'"):
        prepare_default_dataset(tmp_path, tokenizer="gpt2")


@pytest.mark.parametrize(
    "inputs,prefix,match",
    [
        ([], "ds", "no input files"),
        (["empty.jsonl"], "ds", r"no documents in .*empty.jsonl: every input is empty"),
        (
            ["blank.txt"],
            "ds",
            r"no documents in .*blank.txt: every input is empty or holds only empty documents",
        ),
        (["a.txt"], "afile/ds", r"output prefix .*afile/ds.*afile is a file, not a folder"),
        (["a.txt"], "sub/", r"output prefix .*sub/' is a folder; name the dataset inside it"),
        (["a.txt"], "sub", r"output prefix .*sub' is a folder; name the dataset inside it"),
        (
            ["a.txt"],
            "s3://bucket/ds",
            r"output prefix 's3://bucket/ds': datasets are written to local files only",
        ),
        (["a.txt", "ds.bin"], "ds", r"input .*ds.bin' is a file of the output dataset"),
    ],
)
def test_bad_inputs_and_outputs_are_named_and_nothing_is_written(
    tmp_path, monkeypatch, inputs, prefix, match
):
    """Each of these used to go through: an empty input made a dataset of 0 documents; a
    prefix under a file was a FileExistsError traceback; a folder prefix wrote hidden `sub/.bin`;
    an `s3://` prefix wrote a local folder named `s3:`; an earlier run's output matched by
    `--input 'corpus/*'` was read as two documents of binary noise."""
    monkeypatch.chdir(tmp_path)
    Path("empty.jsonl").write_text("")
    Path("blank.txt").write_text("")
    Path("a.txt").write_text("some text")
    Path("afile").write_text("x")
    Path("sub").mkdir()
    preprocess_files(["a.txt"], "ds", ByteTokenizer())  # an earlier run's output, for the last case
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(DataError, match=match):
        preprocess_files(
            [tmp_path / name for name in inputs],
            prefix if "://" in prefix else f"{tmp_path}/{prefix}",
            ByteTokenizer(),
            append_eod="blank" not in inputs[0] if inputs else True,
        )
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert IndexedDataset(str(tmp_path / "ds"))[0].tolist()[:-1] == list(
        b"some text"
    )  # the earlier one, whole


_KILLED_CHILD = """
import os, signal, sys
from meshtrain.services.dataloader import indexed
from meshtrain.services.dataloader.preprocess import preprocess_files
from meshtrain.services.dataloader.tokenizers.base import ByteTokenizer
where, src, prefix = sys.argv[1:]
if where == "writing":
    add = indexed.IndexedDatasetWriter.add_document
    def add_then_die(self, tokens):
        add(self, tokens)
        os.kill(os.getpid(), signal.SIGKILL)
    indexed.IndexedDatasetWriter.add_document = add_then_die
else:  # between renaming the new .bin and the new .idx into place
    replace = os.replace
    def replace_then_die(a, b):
        replace(a, b)
        if str(b).endswith(".bin"):
            os.kill(os.getpid(), signal.SIGKILL)
    indexed.os.replace = replace_then_die
preprocess_files([src], prefix, ByteTokenizer(), append_eod=False)
"""


@pytest.mark.parametrize("where", ["writing", "between_renames"])
def test_a_run_killed_midway_never_leaves_a_pair_that_looks_complete(tmp_path, where):
    """SIGKILL of a preprocess over an earlier dataset of the same prefix: the prefix holds the
    earlier dataset whole, or no `.idx` at all. Killed between the two renames, the new `.bin`
    used to sit beside the earlier `.idx`; with the same total size it opened as a dataset and
    gave the new tokens cut at the old documents' boundaries."""
    import subprocess
    import sys

    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text('{"text": "abc"}\n{"text": "defgh"}\n')
    new.write_text('{"text": "ABCDE"}\n{"text": "FGH"}\n')  # same bytes in all, other boundaries
    prefix = tmp_path / "ds"
    preprocess_files([old], prefix, ByteTokenizer(), append_eod=False)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_CHILD, where, str(new), str(prefix)],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    if (tmp_path / "ds.idx").exists():
        ds = IndexedDataset(str(prefix))
        assert [bytes(ds[i].tolist()) for i in range(len(ds))] == [b"abc", b"defgh"]
    else:
        assert where == "between_renames"
    # and the next run writes the new dataset whole
    ds = IndexedDataset(preprocess_files([new], prefix, ByteTokenizer(), append_eod=False))
    assert [bytes(ds[i].tolist()) for i in range(len(ds))] == [b"ABCDE", b"FGH"]


def test_bytes_that_are_not_utf8_are_replaced_and_named(tmp_path, caplog):
    """A Latin-1 file's accented letters all became U+FFFD with nothing said (Megatron's
    preprocess refuses such a file outright); they are still replaced, as documented, but a
    warning names the file and the first line. Line numbering still counts CR and CRLF ends."""
    jl, txt = tmp_path / "latin1.jsonl", tmp_path / "latin1.txt"
    jl.write_bytes(
        b'{"text": "fine"}\r\n{"text": "caf\xe9"}\r{"text": "ol\xe9"}\n'
        b'{"text": "ok \xef\xbf\xbd"}\n'
    )
    txt.write_bytes(b"line one\nna\xefve\n")
    with caplog.at_level("WARNING", logger="meshtrain.data"):
        ds = IndexedDataset(
            preprocess_files([jl, txt], tmp_path / "ds", ByteTokenizer(), append_eod=False)
        )
    assert [bytes(ds[i].tolist()).decode() for i in range(len(ds))] == [
        "fine",
        "caf\ufffd",
        "ol\ufffd",
        "ok \ufffd",
        "line one\nna\ufffdve\n",
    ]
    warnings = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith(f"{jl}:2: bytes that are not UTF-8 replaced with U+FFFD (2 lines")
        for m in warnings
    )
    assert any(
        m.startswith(f"{txt}:2: bytes that are not UTF-8 replaced with U+FFFD") for m in warnings
    )
    with pytest.raises(
        DataError, match=r"latin1.jsonl:3: not a JSON object"
    ):  # lone CR ends line 2
        jl.write_bytes(b'{"text": "a"}\r\n{"text": "b"}\r{broken\n')
        preprocess_files([jl], tmp_path / "ds2", ByteTokenizer())


def test_a_jsonl_file_with_a_byte_order_mark_is_read_and_a_line_that_is_no_object_is_named(
    tmp_path,
):
    """Windows tools (PowerShell's Out-File, Excel's CSV-to-JSON) start UTF-8 files with a BOM:
    the file was refused at line 1 ("Unexpected UTF-8 BOM"). A line holding a JSON list was
    reported as having no key 'text'."""
    jl = tmp_path / "bom.jsonl"
    jl.write_bytes(b'\xef\xbb\xbf{"text": "bom"}\n{"text": "two"}\n')
    ds = IndexedDataset(preprocess_files([jl], tmp_path / "ds", ByteTokenizer(), append_eod=False))
    assert [bytes(ds[i].tolist()) for i in range(len(ds))] == [b"bom", b"two"]
    jl.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(
        DataError, match=r"bom.jsonl:2: is a JSON list, not an object with key 'text'"
    ):
        preprocess_files([jl], tmp_path / "ds2", ByteTokenizer())


@pytest.mark.e2e
def test_a_killed_preprocess_leaves_temp_files_the_next_one_removes(tmp_path):
    # Reproduced: `meshtrain data preprocess` SIGKILLed while writing left OUT.bin.tmp-PID-ID
    # (dataset-sized) forever; the next run to the same prefix wrote its dataset beside it.
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from meshtrain.services.dataloader.indexed import IndexedDatasetWriter

    from .conftest import REPO

    words = [f"w{i:04d}" for i in range(2000)]
    with open(tmp_path / "big.jsonl", "w") as f:  # ~80 MB: seconds of tokenizing on 2 cores
        f.writelines(
            json.dumps({"text": " ".join(words[(i * 7 + k * 13) % 2000] for k in range(60))}) + "\n"
            for i in range(200_000)
        )
    (tmp_path / "small.jsonl").write_text(json.dumps({"text": "small"}) + "\n")
    out = tmp_path / "out" / "all"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def preprocess_cli(source):
        return [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "data",
            "preprocess",
            "--input",
            str(tmp_path / source),
            "--output-prefix",
            str(out),
            "--tokenizer",
            "byte",
            "--quiet",
        ]

    live = IndexedDatasetWriter(out)  # a live writer's (this process's) temp file, which stays
    killed = subprocess.Popen(
        preprocess_cli("big.jsonl"), cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size > 1_000_000 for p in out.parent.glob("all.bin.tmp-*")):
        assert killed.poll() is None, (
            f"preprocess ended ({killed.returncode}) before it was killed: {killed.stderr.read()}"
        )
        assert time.monotonic() < deadline, "preprocess wrote no temp file in 120 s"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    left = [p for p in out.parent.glob("all.*.tmp-*") if f"-{killed.pid}-" in p.name]
    assert left

    # Not the killed writer's, so kept too: another host's, a name of another form.
    elsewhere = out.parent / f"all.bin.tmp-not-{socket.gethostname()}-1-{'0' * 32}"
    other = out.parent / "all.bin.tmp-keep-me"
    for p in (elsewhere, other):
        p.write_bytes(b"x")
    try:
        again = subprocess.run(
            preprocess_cli("small.jsonl")[:-1],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert again.returncode == 0, again.stderr
        for p in left:
            assert not p.exists()
            assert f"removed {p}, left by a writer of {out} that was killed" in again.stderr, (
                again.stderr
            )
        assert live._bin_tmp.exists() and elsewhere.exists() and other.exists()
    finally:
        live.abort()
    assert IndexedDataset(out).num_documents == 1
