"""benchmarks/allreduce_bench.py runs end to end on CPU (gloo, two ranks): its exact-sum check
passes and it writes one row per size with the bandwidth arithmetic and the setting it ran under."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_allreduce_bench_runs_on_gloo_and_records_its_setting(tmp_path):
    out = tmp_path / "ar.json"
    env = dict(os.environ, NCCL_PROTO="Simple")  # recorded, though gloo ignores it
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "benchmarks/allreduce_bench.py", "--device", "cpu", "--mb", "1", "2", "--iters", "2",
                           "--rounds", "1", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NCCL setting: NCCL_PROTO=Simple" in proc.stdout
    d = json.loads(out.read_text())
    assert d["world"] == 2 and d["nccl_env"]["NCCL_PROTO"] == "Simple"
    assert [r["variant"] for r in d["rows"]] == ["nccl", "nccl"]  # no symmetric memory off CUDA
    for r in d["rows"]:
        assert r["ms"] > 0 and r["algbw_gbs"] == pytest.approx(r["mib"] * 2**20 / r["ms"] / 1e6)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"])  # 2 ranks: 2(n-1)/n = 1
