"""benchmarks/train_throughput.py on CPU: the script end to end with --variant (the GPU rows are on the H200)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_variant_runs_meshtrain_again_with_its_flags_in_the_same_process(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "benchmarks/train_throughput.py", "--config", "deploy/configs/tiny.toml",
           "--steps", "2", "--warmup", "1", "--skip-baseline", "--run-dir", str(tmp_path / "run"), "--out", str(out),
           "--variant=--train.bf16_weight_copies=false --optim.lr=1e-2", "--bf16",
           "--data.tokenizer=byte", "--data.default_corpus_bytes=400000", f"--data.cache_dir={tmp_path / 'cache'}",
           "--model.num_layers=2", "--model.hidden_size=64", "--model.seq_length=64"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    variant = "meshtrain --train.bf16_weight_copies=false --optim.lr=1e-2"
    rows = result["results"]
    assert set(rows) == {"meshtrain", variant}
    assert rows["meshtrain"]["bf16_weight_copies"] and not rows[variant]["bf16_weight_copies"]
    assert not rows["meshtrain"]["gradient_accumulation_fusion"]
    assert rows["meshtrain"]["loss_first"] == rows[variant]["loss_first"]  # same data and init
    assert rows["meshtrain"]["loss_last"] != rows[variant]["loss_last"]  # its learning rate: the flags reached it
    for row in rows.values():  # each timed step's own time, and the mean from the total
        assert len(row["step_times_s"]) == 2 and all(t > 0 for t in row["step_times_s"])
        assert row["step_time_median_s"] == pytest.approx(sum(row["step_times_s"]) / 2)
        assert row["step_time_s"] >= row["step_time_median_s"] * 0.99
    assert result["ratio_vs_variant"] == pytest.approx(rows["meshtrain"]["tokens_per_s"] / rows[variant]["tokens_per_s"])
    assert f"ratio meshtrain / {variant}:" in done.stdout


def test_variant_needs_an_override(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--config", "deploy/configs/tiny.toml",
                           "--variant= "], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--variant needs one process and at least one override" in done.stderr
