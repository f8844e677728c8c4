"""The `meshtrain` command as a user runs it: train, resume, inspect, preprocess, errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "deploy" / "configs" / "tiny.toml")


def meshtrain(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "services.cli", *map(str, args)], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.e2e
def test_train_then_resume_with_tiny_config(tmp_path):
    small = ["--data.default_corpus_bytes=300000", f"--data.cache_dir={tmp_path / 'cache'}",
             "--data.default_vocab_size=512", "--data.split=80,20,0", "--eval-interval", "4", "--eval-iters", "2",
             "--log.plot=false"]
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    first = meshtrain("train", "--config", TINY, "--train-iters", 4, "--save", ckpt, "--run-dir", run, *small)
    assert first.returncode == 0, first.stderr
    assert f"checkpoint    : {ckpt}/step_00000004" in first.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 4
    listed = meshtrain("ckpt", "list", ckpt)
    assert listed.stdout.split() == ["4"]
    second = meshtrain("train", "--config", TINY, "--train-iters", 8, "--load", ckpt, "--save", ckpt,
                       "--run-dir", tmp_path / "run2", *small)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr and "at step 4" in second.stderr
    assert meshtrain("ckpt", "list", ckpt).stdout.split() == ["4", "8"]
    inspect = meshtrain("ckpt", "inspect", ckpt)
    assert "layers.attention.qkv.weight" in inspect.stdout and "iteration: 8" in inspect.stdout


@pytest.mark.e2e
def test_user_errors_exit_2_with_the_key_named(tmp_path):
    bad = meshtrain("train", "--config", TINY, "--model.hidden_sz=3")
    assert bad.returncode == 2 and "model.hidden_sz" in bad.stderr and "Traceback" not in bad.stderr
    tp = meshtrain("train", "--pipeline-model-parallel-size", "2")
    assert tp.returncode == 2 and "not built yet" in tp.stderr
    missing = meshtrain("train", "--config", tmp_path / "nope.toml")
    assert missing.returncode == 2 and "nope.toml" in missing.stderr
    empty = meshtrain("ckpt", "inspect", tmp_path)
    assert empty.returncode == 2 and "no committed checkpoint" in empty.stderr


@pytest.mark.e2e
def test_help_config_lists_keys():
    out = meshtrain("train", "--help-config")
    assert out.returncode == 0 and "--model.hidden_size" in out.stdout and "--tensor-model-parallel-size" in out.stdout


@pytest.mark.e2e
def test_preprocess_and_train_tokenizer(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"document number {i} " * 20}) for i in range(30)) + "\n")
    out = meshtrain("data", "preprocess", "--input", docs, "--output-prefix", tmp_path / "ds", "--tokenizer", "byte",
                    "--append-eod")
    assert out.returncode == 0, out.stderr
    from services.dataloader.indexed import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "ds"))
    assert len(ds) == 30 and ds[0][-1] == 256  # EOD appended
    tok = meshtrain("data", "train-tokenizer", "--input", docs, "--vocab-size", 300, "--output", tmp_path / "t.json")
    assert tok.returncode == 0, tok.stderr and (tmp_path / "t.json").exists()
    none = meshtrain("data", "preprocess", "--input", tmp_path / "*.nothing", "--output-prefix", tmp_path / "x",
                     "--tokenizer", "byte")
    assert none.returncode == 2 and "matches no file" in none.stderr


@pytest.mark.e2e
@pytest.mark.dist
def test_nproc_per_node_launches_tensor_parallel_ranks(tmp_path):
    small = ["--data.default_corpus_bytes=300000", f"--data.cache_dir={tmp_path / 'cache'}", "--data.tokenizer=byte",
             "--data.split=80,20,0", "--eval-interval", "0", "--log.plot=false", "--train-iters", "3",
             "--micro-batch-size", "4", "--global-batch-size", "8", "--num-layers", "2"]
    run = tmp_path / "run"
    out = meshtrain("train", "--nproc-per-node", "2", "--config", TINY, "--tensor-model-parallel-size", "2",
                    "--sequence-parallel", "--run-dir", run, *small)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh tp=2 dp=1 (world 2)" in out.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 3
    assert meshtrain("ckpt", "list", run / "checkpoints").stdout.split() == ["3"]


def _losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.mark.e2e
def test_sigterm_saves_exits_0_and_resume_continues_identically(tmp_path):
    """Preemption: SIGTERM mid-run commits a checkpoint and exits 0; the next launch resumes from
    it and the losses of both parts equal an uninterrupted run's exactly (CPU, fp32)."""
    import signal
    import time

    small = ["--data.default_corpus_bytes=300000", f"--data.cache_dir={tmp_path / 'cache'}", "--data.tokenizer=byte",
             "--data.split=80,20,0", "--eval-interval", "0", "--log.plot=false", "--log-interval", "1",
             "--train-iters", "150", "--num-layers", "1", "--hidden-size", "32", "--seq-length", "32",
             "--micro-batch-size", "4", "--global-batch-size", "4"]
    whole = meshtrain("train", "--config", TINY, "--run-dir", tmp_path / "whole", *small)
    assert whole.returncode == 0, whole.stderr[-2000:]
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "train", "--config", TINY, "--save", str(ckpt),
                             "--run-dir", str(tmp_path / "a"), *small], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "a" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    steps = meshtrain("ckpt", "list", ckpt).stdout.split()
    assert len(steps) == 1 and 5 <= int(steps[0]) < 150, (steps, err[-1000:])
    stopped = int(steps[0])
    resumed = meshtrain("train", "--config", TINY, "--load", ckpt, "--save", ckpt, "--run-dir", tmp_path / "b", *small)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    first, second, reference = _losses(tmp_path / "a"), _losses(tmp_path / "b"), _losses(tmp_path / "whole")
    assert max(first) == stopped and min(second) == stopped + 1 and max(second) == 150
    combined = {**{s: v for s, v in first.items() if s <= stopped}, **second}
    assert combined == reference
