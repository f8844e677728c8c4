"""benchmarks/train_throughput.py on CPU: the script end to end with --variant
(the GPU rows are on the H200)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_variant_runs_meshtrain_again_with_its_flags_in_the_same_process(tmp_path):
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/train_throughput.py",
        "--config",
        "deploy/configs/tiny.toml",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--skip-baseline",
        "--run-dir",
        str(tmp_path / "run"),
        "--out",
        str(out),
        "--variant=--train.bf16_weight_copies=false --optim.lr=1e-2",
        "--bf16",
        "--data.tokenizer=byte",
        "--data.default_corpus_bytes=400000",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--model.num_layers=2",
        "--model.hidden_size=64",
        "--model.seq_length=64",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    variant = "meshtrain --train.bf16_weight_copies=false --optim.lr=1e-2"
    rows = result["results"]
    assert set(rows) == {"meshtrain", variant}
    assert rows["meshtrain"]["bf16_weight_copies"] and not rows[variant]["bf16_weight_copies"]
    assert not rows["meshtrain"]["gradient_accumulation_fusion"]
    assert rows["meshtrain"]["loss_first"] == rows[variant]["loss_first"]  # same data and init
    assert (
        rows["meshtrain"]["loss_last"] != rows[variant]["loss_last"]
    )  # its learning rate: the flags reached it
    for row in rows.values():  # each timed step's own time, and the mean from the total
        assert len(row["step_times_s"]) == 2 and all(t > 0 for t in row["step_times_s"])
        assert row["step_time_median_s"] == pytest.approx(sum(row["step_times_s"]) / 2)
        assert row["step_time_s"] >= row["step_time_median_s"] * 0.99
        assert row["allocator"] is None  # the CUDA allocator's counts: none on CPU
    assert result["ratio_vs_variant"] == pytest.approx(
        rows["meshtrain"]["tokens_per_s"] / rows[variant]["tokens_per_s"]
    )
    assert result["ratio_vs_variant_median"] == pytest.approx(
        rows[variant]["step_time_median_s"] / rows["meshtrain"]["step_time_median_s"]
    )
    assert f"ratio meshtrain / {variant}:" in done.stdout


@pytest.mark.e2e
def test_variant_needs_an_override(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/train_throughput.py",
            "--config",
            "deploy/configs/tiny.toml",
            "--variant= ",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (
        done.returncode == 2
        and "--variant needs one process and at least one override" in done.stderr
    )


TINY = [
    "--config",
    "deploy/configs/tiny.toml",
    "--data.tokenizer=byte",
    "--data.default_corpus_bytes=400000",
    "--model.num_layers=2",
    "--model.hidden_size=64",
    "--model.seq_length=64",
]


@pytest.mark.e2e
def test_several_variants_are_each_a_side_and_a_failing_one_is_reported_not_fatal(tmp_path):
    """Two --variant sides and one that cannot train (a CUDA graph on CPU): the two are timed, each
    with its speedup over meshtrain, and the third is named as failed with its error."""
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/train_throughput.py",
        *TINY,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--skip-baseline",
        "--run-dir",
        str(tmp_path / "run"),
        "--out",
        str(out),
        "--variant=--optim.lr=1e-2",
        "--variant=--train.cuda_graph=true",
        "--variant=--optim.lr=3e-2",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "partial" not in result  # the complete result replaced the one written side by side
    rows = result["results"]
    assert set(rows) == {"meshtrain", "meshtrain --optim.lr=1e-2", "meshtrain --optim.lr=3e-2"}
    assert (
        rows["meshtrain --optim.lr=1e-2"]["loss_last"]
        != rows["meshtrain --optim.lr=3e-2"]["loss_last"]
    )
    assert sorted((tmp_path).glob("run-variant*")) == [
        tmp_path / "run-variant",
        tmp_path / "run-variant3",
    ]
    variants = result["variants"]
    assert list(variants) == ["--optim.lr=1e-2", "--train.cuda_graph=true", "--optim.lr=3e-2"]
    assert "cuda_graph" in variants["--train.cuda_graph=true"]["failed"]
    for flags in ("--optim.lr=1e-2", "--optim.lr=3e-2"):
        assert variants[flags]["speedup_vs_meshtrain"] == pytest.approx(
            rows[f"meshtrain {flags}"]["tokens_per_s"] / rows["meshtrain"]["tokens_per_s"]
        )
    assert result["variant"] == "--optim.lr=1e-2"  # the first keeps the single-variant keys
    assert result["ratio_vs_variant"] == pytest.approx(
        1 / variants["--optim.lr=1e-2"]["speedup_vs_meshtrain"]
    )
    assert "failed meshtrain --train.cuda_graph=true:" in done.stdout
    assert "variant --optim.lr=3e-2: " in done.stdout


@pytest.mark.e2e
def test_a_run_killed_after_a_side_keeps_the_sides_timed_so_far(tmp_path):
    """Killed (as a time limit kills it) once the first variant is timed: --out holds meshtrain's
    and that variant's rows, marked partial, with the variant still to come named."""
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/train_throughput.py",
        *TINY,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--skip-baseline",
        "--run-dir",
        str(tmp_path / "run"),
        "--out",
        str(out),
        "--variant=--optim.lr=1e-2",
        "--variant=--optim.lr=3e-2",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("timed meshtrain --optim.lr=1e-2:"):
                break
        else:
            pytest.fail(f"the script ended before timing the first variant: {proc.wait()}")
    finally:
        proc.kill()
        proc.wait()
    result = json.loads(out.read_text())
    assert result["partial"] is True
    assert set(result["results"]) == {"meshtrain", "meshtrain --optim.lr=1e-2"}
    assert result["pending"] == ["meshtrain --optim.lr=3e-2"]
    row = result["results"]["meshtrain"]
    assert row["tokens_per_s"] == pytest.approx(
        result["global_batch_size"] * result["seq_length"] / row["step_time_s"]
    )


@pytest.mark.e2e
def test_a_variant_given_twice_is_refused(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/train_throughput.py",
            "--config",
            "deploy/configs/tiny.toml",
            "--variant=--optim.lr=1e-2",
            "--variant=--optim.lr=1e-2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "each variant once" in done.stderr


@pytest.mark.e2e
def test_rounds_interleave_every_side_and_report_each_rounds_ratio(tmp_path):
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/train_throughput.py",
        *TINY,
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        "--out",
        str(out),
        "--variant=--optim.lr=1e-2",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["results"]
    assert result["rounds"] == 3 and set(rows) == {
        "meshtrain",
        "baseline (plain torch)",
        "meshtrain --optim.lr=1e-2",
    }
    for name, row in rows.items():
        assert len(row["step_times_s"]) == 6 and len(row["round_step_time_s"]) == 3
        assert row["step_time_s"] == pytest.approx(sum(row["round_step_time_s"]) / 3)
        assert row["peak_mem_gb"] is None  # every side resident at once: no side's own peak
        # the CUDA allocator's counts, per round and in all: none on CPU (tiny.toml's meshtrain; the
        # baseline's device is CUDA where there is one)
        if name.startswith("meshtrain") or not torch.cuda.is_available():
            assert row["round_allocator"] == [None] * 3 and row["allocator"] is None
        else:
            assert row["allocator"] == {
                key: sum(c[key] for c in row["round_allocator"]) for key in row["allocator"]
            }
    mesh, base = rows["meshtrain"], rows["baseline (plain torch)"]
    assert result["ratio_tokens_per_s_rounds"] == pytest.approx(
        [b / m for m, b in zip(mesh["round_step_time_s"], base["round_step_time_s"])]
    )
    # the median of all rounds' steps
    assert mesh["step_time_median_s"] == pytest.approx(sum(sorted(mesh["step_times_s"])[2:4]) / 2)
    assert result["ratio_tokens_per_s_median"] == pytest.approx(
        base["step_time_median_s"] / mesh["step_time_median_s"]
    )
    assert len(result["ratio_vs_variant_rounds"]) == 3
    # each meshtrain side reports its own run's losses: the same first step (data, init),
    # its own learning rate after
    assert mesh["loss_first"] == rows["meshtrain --optim.lr=1e-2"]["loss_first"]
    assert mesh["loss_last"] != rows["meshtrain --optim.lr=1e-2"]["loss_last"]
    assert "ratio_tokens_per_s by round:" in done.stdout
    assert "ratio_tokens_per_s from the median steps:" in done.stdout


@pytest.mark.e2e
def test_rounds_refuse_a_variant_that_changes_the_kernel_choice(tmp_path):
    cmd = [
        sys.executable,
        "benchmarks/train_throughput.py",
        *TINY,
        "--steps",
        "1",
        "--warmup",
        "0",
        "--rounds",
        "2",
        "--skip-baseline",
        "--run-dir",
        str(tmp_path / "run"),
        "--out",
        str(tmp_path / "out.json"),
        "--variant=--train.kernels=reference",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0 and "changes the kernel choice" in done.stderr
    assert (
        "time this variant with --rounds 1" in done.stderr and not (tmp_path / "out.json").exists()
    )


@pytest.mark.e2e
def test_float8_baseline_is_a_side_of_its_own_with_its_ratios(tmp_path):
    pytest.importorskip(
        "torchao.float8", reason="torchao is not installed (the `test` extra has it)"
    )
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/train_throughput.py",
        *TINY,
        "--train.micro_batch_size=4",
        "--train.global_batch_size=8",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--baseline-float8",
        "rowwise",
        "--variant=--optim.lr=1e-2",
        "--run-dir",
        str(tmp_path / "run"),
        "--out",
        str(out),
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["results"]
    mesh, plain = rows["meshtrain"], rows["baseline (plain torch)"]
    variant, float8 = rows["meshtrain --optim.lr=1e-2"], rows["baseline + torchao float8 (rowwise)"]
    # the float8 baseline runs last: torchao patches Inductor's codegen for the process,
    # and the others compile first
    assert list(rows) == [
        "meshtrain",
        "baseline (plain torch)",
        "meshtrain --optim.lr=1e-2",
        "baseline + torchao float8 (rowwise)",
    ]
    # 2 blocks x (q, kv, o, up, down); the head stays plain. Same init and batches as the plain
    # baseline, so after two steps the loss is the plain one's within float8's rounding
    assert float8["float8"] == "rowwise" and float8["float8_layers"] == 10 and "float8" not in plain
    assert float8["loss_last"] == pytest.approx(plain["loss_last"], rel=2e-2)
    for key, (side, other) in {
        "ratio_vs_float8_baseline": (mesh, float8),
        "variant_ratio_vs_float8_baseline": (variant, float8),
        "float8_baseline_speedup": (float8, plain),
        "ratio_tokens_per_s": (mesh, plain),
    }.items():
        assert result[key] == pytest.approx(side["tokens_per_s"] / other["tokens_per_s"]), key
        assert result[key + "_median"] == pytest.approx(
            other["step_time_median_s"] / side["step_time_median_s"]
        ), key
    assert "ratio meshtrain / baseline + torchao float8 (rowwise):" in done.stdout
    assert "ratio meshtrain --optim.lr=1e-2 / baseline + torchao float8 (rowwise):" in done.stdout


@pytest.mark.e2e
def test_float8_baseline_names_its_recipes(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/train_throughput.py",
            "--config",
            "deploy/configs/tiny.toml",
            "--baseline-float8",
            "delayed",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "invalid choice: 'delayed'" in done.stderr
