"""benchmarks/fp8_cast_kernels.py end to end on CPU at a tiny size: every field in its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("copy", "amax", "cast", "cast_transpose", "cast_transpose_amax", "tensorwise")
PRODUCER_KERNELS = (
    "copy",
    "plain",
    "fused_delayed",
    "unfused_delayed",
    "fused_amax",
    "unfused_amax",
)


@pytest.mark.e2e
def test_runs_on_cpu_and_writes_every_field(tmp_path):
    out = tmp_path / "fp8_cast.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fp8_cast_kernels.py"),
            "--device",
            "cpu",
            "--tiny",
            "--no-compile",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["skipped"] == [] and report["goal_frac_of_copy"]
    assert set(report["cases"]) == {"tiny_input", "tiny_weight"}
    for row in report["cases"].values():
        assert set(KERNELS) | {"unfused_eager"} == set(row["kernels"])
        for stats in row["kernels"].values():
            assert stats["ms"] > 0 and stats["bytes"] > 0 and stats["gbps"] > 0
            assert stats["frac_of_copy"] > 0
            # CUDA graph replay times exist on CUDA only
            assert stats["device_ms"] is None and stats["device_frac_of_copy"] is None
        assert row["kernels"]["copy"]["frac_of_copy"] == 1.0
        assert row["speedup_vs_unfused_eager"] > 0
    assert set(report["producers"]) == {"rms_norm", "swiglu"}
    for row in report["producers"].values():
        assert set(row["kernels"]) == set(PRODUCER_KERNELS)
        for stats in row["kernels"].values():
            assert stats["ms"] > 0 and stats["bytes"] > 0 and stats["frac_of_copy"] > 0
        assert row["speedup_delayed"] > 0 and row["speedup_amax"] > 0
