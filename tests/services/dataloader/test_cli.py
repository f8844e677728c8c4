"""`meshtrain data ...` commands through the real CLI entry point, and their error exits."""

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from meshtrain.services.cli import main
from meshtrain.services.dataloader.indexed import IndexedDataset

from .conftest import REPO, free_port


def _jsonl(path, n=300):
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"text": f"document {i} " + "words " * (i % 13)}) + "\n" for i in range(n)
        )
    return path


def test_preprocess_workers_and_tokenizer(tmp_path, capsys):
    _jsonl(tmp_path / "a.jsonl")
    _jsonl(tmp_path / "b.jsonl", 50)
    assert (
        main(
            [
                "data",
                "train-tokenizer",
                "--input",
                str(tmp_path / "*.jsonl"),
                "--vocab-size",
                "300",
                "--output",
                str(tmp_path / "tok.json"),
            ]
        )
        == 0
    )
    for w in (1, 2):
        assert (
            main(
                [
                    "data",
                    "preprocess",
                    "--input",
                    str(tmp_path / "*.jsonl"),
                    "--output-prefix",
                    str(tmp_path / f"out{w}"),
                    "--tokenizer",
                    str(tmp_path / "tok.json"),
                    "--append-eod",
                    "--workers",
                    str(w),
                    "--quiet",
                ]
            )
            == 0
        )
    a, b = IndexedDataset(tmp_path / "out1"), IndexedDataset(tmp_path / "out2")
    assert a.num_documents == 350
    assert np.array_equal(a.read_tokens(0, a.num_tokens), b.read_tokens(0, b.num_tokens))
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,match",
    [
        (["--input", "nothing-*.jsonl", "--tokenizer", "byte"], "matches no file"),
        (
            ["--input", "{jsonl}", "--tokenizer", "nope.bin"],
            "tokenizer file 'nope.bin' does not exist",
        ),
        (["--input", "{jsonl}", "--tokenizer", "byte", "--json-key", "body"], "no key 'body'"),
        (["--input", "{jsonl}", "--tokenizer", "byte", "--workers", "0"], "workers=0"),
    ],
)
def test_preprocess_bad_input_exits_2_with_message(tmp_path, capsys, args, match):
    jsonl = str(_jsonl(tmp_path / "in.jsonl", 3))
    args = [a.replace("{jsonl}", jsonl) for a in args]
    assert main(["data", "preprocess", "--output-prefix", str(tmp_path / "o"), *args]) == 2
    assert match in capsys.readouterr().err


def test_train_tokenizer_refuses_a_compressed_input_as_preprocess_does(tmp_path, capsys):
    """A `.txt.gz` used to train a BPE on its compressed bytes and exit 0."""
    import gzip

    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"hello world\n" * 500))
    assert (
        main(
            [
                "data",
                "train-tokenizer",
                "--input",
                str(tmp_path / "a.txt.gz"),
                "--vocab-size",
                "300",
                "--output",
                str(tmp_path / "tok.json"),
            ]
        )
        == 2
    )
    assert "a.txt.gz: is gzip-compressed; decompress it first" in capsys.readouterr().err
    assert not (tmp_path / "tok.json").exists()


def test_preprocess_a_directory_as_input_is_an_error_not_an_empty_dataset(tmp_path, capsys):
    (tmp_path / "indir" / "sub").mkdir(parents=True)
    _jsonl(tmp_path / "indir" / "sub" / "a.jsonl", 3)
    assert (
        main(
            [
                "data",
                "preprocess",
                "--input",
                str(tmp_path / "indir"),
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer",
                "byte",
                "--quiet",
            ]
        )
        == 2
    )
    assert "matches no regular file" in capsys.readouterr().err
    assert not (tmp_path / "o.idx").exists() and not (tmp_path / "o.bin").exists()


def test_preprocess_reads_a_file_matched_by_two_patterns_once(tmp_path):
    _jsonl(tmp_path / "a.jsonl", 3)
    _jsonl(tmp_path / "b.jsonl", 5)
    # b.jsonl by the glob, by its own name and by a path naming it differently: read once
    assert (
        main(
            [
                "data",
                "preprocess",
                "--input",
                str(tmp_path / "*.jsonl"),
                str(tmp_path / "b.jsonl"),
                str(tmp_path / "." / "b.jsonl"),
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer",
                "byte",
                "--quiet",
            ]
        )
        == 0
    )
    assert IndexedDataset(tmp_path / "o").num_documents == 3 + 5


def test_an_existing_file_with_glob_characters_in_its_name_is_that_file(tmp_path):
    """'shard[1].jsonl' as a pattern matches 'shard1.jsonl' (or nothing): a name the shell passed
    as is used to be refused, or to read another file."""
    (tmp_path / "shard[1].jsonl").write_text(json.dumps({"text": "bracket"}) + "\n")
    (tmp_path / "shard1.jsonl").write_text(json.dumps({"text": "plain"}) + "\n")
    assert (
        main(
            [
                "data",
                "preprocess",
                "--input",
                str(tmp_path / "shard[1].jsonl"),
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer",
                "byte",
                "--quiet",
            ]
        )
        == 0
    )
    ds = IndexedDataset(tmp_path / "o")
    assert [ds[i].tolist() for i in range(len(ds))] == [list(b"bracket")]
    # a pattern is still a pattern
    assert (
        main(
            [
                "data",
                "preprocess",
                "--input",
                str(tmp_path / "shard[0-9].jsonl"),
                "--output-prefix",
                str(tmp_path / "p"),
                "--tokenizer",
                "byte",
                "--quiet",
            ]
        )
        == 0
    )
    ds = IndexedDataset(tmp_path / "p")
    assert [ds[i].tolist() for i in range(len(ds))] == [list(b"plain")]


@pytest.mark.e2e
def test_serve_command_listens_and_stops_on_sigterm():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtrain.services.cli", "data", "serve", "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == f"listening on 127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_train_tokenizer_learns_from_the_jsonl_text_not_the_json_around_it(tmp_path):
    """It reads JSONL as preprocess does (the --json-key field): trained on the raw lines, its
    merges learnt the JSON syntax ('{"', '": "') that no stored document holds."""
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(
            json.dumps({"body": f"plain words number {i % 7} and more plain words"}) + "\n"
            for i in range(400)
        )
    out = tmp_path / "tok.json"
    assert (
        main(
            [
                "data",
                "train-tokenizer",
                "--input",
                str(tmp_path / "a.jsonl"),
                "--vocab-size",
                "300",
                "--json-key",
                "body",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    merged = [
        t
        for t in json.loads(out.read_text())["model"]["vocab"]
        if len(t) > 1 and t != "<|endoftext|>"
    ]
    assert merged and not [t for t in merged if "{" in t or '"' in t or "body" in t], merged
    assert "words" in merged or "Ġwords" in merged  # the text's own words were learnt
    # a line without the key is refused as preprocess refuses it
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"text": "no body here"}) + "\n")
    assert (
        main(
            [
                "data",
                "train-tokenizer",
                "--input",
                str(tmp_path / "b.jsonl"),
                "--vocab-size",
                "300",
                "--json-key",
                "body",
                "--output",
                str(tmp_path / "t2.json"),
            ]
        )
        == 2
    )


def _children(pid: int) -> set[int]:
    found = set()
    for task in __import__("pathlib").Path(f"/proc/{pid}/task").iterdir():
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


@pytest.mark.parametrize(
    "sig,workers", [(signal.SIGTERM, 1), (signal.SIGTERM, 2), (signal.SIGKILL, 2)]
)
@pytest.mark.e2e
def test_preprocess_stopped_by_sigterm_leaves_no_files_and_no_workers(tmp_path, sig, workers):
    """SIGTERM (`kill`, scancel, a closed job) killed a `data preprocess` outright: it left its
    partial `.bin.tmp-*` copy of the tokens behind, and with --workers N its N tokenizing
    processes ran on as orphans, forever (reproduced: still there ten minutes later). It now
    stops as Ctrl-C does: temporary files removed, workers shut down, exit 143. SIGKILLed
    (the OOM killer), it cannot clean up, but its workers now exit within seconds."""
    import os
    import time

    big = tmp_path / "big.jsonl"
    big.write_text(
        "".join(
            json.dumps({"text": f"lorem ipsum dolor sit amet {i} " * 20}) + "\n"
            for i in range(400_000)
        )
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "data",
            "preprocess",
            "--tokenizer",
            "byte",
            "--quiet",
            "--input",
            str(big),
            "--output-prefix",
            str(out / "ds"),
            "--workers",
            str(workers),
        ],
        cwd=REPO,
        stderr=open(tmp_path / "err", "w"),
    )  # noqa: SIM115
    deadline = time.monotonic() + 60
    # tokens written: the workers are up
    while not (out.is_dir() and any(f.stat().st_size > (1 << 20) for f in out.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
        time.sleep(0.01)
    children = _children(proc.pid)
    proc.send_signal(sig)
    survivors = set()
    try:
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        while (
            survivors := {pid for pid in children if os.path.exists(f"/proc/{pid}")}
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for pid in children:  # whatever the outcome, leave no process of this test behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    err = (tmp_path / "err").read_text()
    assert not survivors, f"processes {survivors} outlived the preprocess they worked for"
    if sig == signal.SIGKILL:
        assert proc.returncode == -9 and not (out / "ds.idx").exists()
        return
    assert proc.returncode == 143, err[-2000:]
    assert "SIGTERM" in err and "Traceback" not in err, err[-2000:]
    assert list(out.iterdir()) == []
