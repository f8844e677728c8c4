"""benchmarks/optimizer_offload.py end to end on CPU at tiny sizes: every case runs in its own
subprocess, the JSON holds every field the GPU run reports, and a shape that cannot fit is
skipped with the reason instead of started."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_script_writes_every_field_on_cpu(tmp_path):
    out = tmp_path / "offload.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "optimizer_offload.py"),
        "--device=cpu",
        "--sizes=tiny",
        "--largest=llama-8b,tiny",
        "--seq=16",
        "--micro-batches=2",
        "--steps=1",
        "--host-memory-gb=64",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    for key in ("device", "host_available_gb", "peak_flops", "flops_counted", "settings"):
        assert key in report
    cases = {(c["shape"], c["offload"]): c for c in report["cases"]}
    for offload in (False, True):
        c = cases[("tiny", offload)]
        for key in ("parameters", "step_s", "tokens_per_s", "mfu", "peak_gpu_memory_gb", "loss"):
            assert key in c, (offload, key)
        assert c["tokens_per_s"] > 0 and c["overlap_d2h_h2d"] is offload
    assert cases[("tiny", True)]["host_optimizer_gb"] > 0
    # the same weights, data and (fused vs for-loop) AdamW: the first losses agree
    assert cases[("tiny", True)]["loss"] == pytest.approx(cases[("tiny", False)]["loss"], rel=1e-4)
    ratio = report["ratios"]["tiny"]["tokens_per_s_offload_over_plain"]
    assert ratio > 0
    # llama-8b's offloaded state (16 bytes x 8B) does not fit this host: skipped, not started
    big = cases[("llama-8b", True)]
    assert "host memory" in big["skipped"]
    assert report["largest_offloaded"]["shape"] == "tiny"
