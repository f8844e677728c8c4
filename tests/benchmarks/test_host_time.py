"""benchmarks/host_time.py: which CUDA runtime calls count as blocking, and a run on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.host_time import is_blocking

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name,blocking",
    [
        ("cudaStreamSynchronize", True),
        ("cudaDeviceSynchronize", True),
        ("cudaEventSynchronize", True),
        ("cudaMemcpy", True),
        ("cudaHostAlloc", True),
        ("cudaFree", True),
        ("cudaMalloc", True),
        ("cudaMemcpyAsync", False),
        ("cudaMemsetAsync", False),
        ("cudaLaunchKernel", False),
        ("cudaEventQuery", False),
        ("cudaStreamIsCapturing", False),
        ("aten::copy_", False),
    ],
)
def test_blocking_calls_are_the_ones_that_can_wait_for_the_device(name, blocking):
    assert is_blocking(name) is blocking


@pytest.mark.e2e
def test_runs_on_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "host_time.py"),
            "--config",
            "deploy/configs/tiny.toml",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
            "--run-dir",
            str(tmp_path / "run"),
            "--model.num_layers=1",
            "--data.tokenizer=byte",
            "--data.default_corpus_bytes=400000",
            f"--data.cache_dir={tmp_path / 'cache'}",
            "--train.device=cpu",
        ],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert 0 < result["host_ms_per_step"] <= result["wall_ms_per_step"]
    assert result["blocking_calls_in_2_steps"] == {}  # no CUDA runtime on CPU
