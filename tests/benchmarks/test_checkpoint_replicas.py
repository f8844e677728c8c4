"""benchmarks/checkpoint_replicas.py at a tiny size: every mode commits and the JSON says so."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_runs_every_mode_at_a_tiny_size_and_writes_its_json(tmp_path):
    out = tmp_path / "replicas.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "checkpoint_replicas.py"),
            "--writers",
            "2",
            "--mb",
            "2",
            "--box-mb",
            "0.25",
            "--repeat",
            "1",
            "--warmup",
            "0",
            "--local-dir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    modes = result["results"]["file"]["modes"]
    assert set(modes) == {"plain", "replicas-1", "replicas-2", "direct"}
    assert result["results"]["file"]["bytes"] == 2 * result["boxes_per_writer"] * round(
        result["box_mb"] * 1e6
    )
    for mode, m in modes.items():
        assert m["mb_per_s_median"] > 0 and len(m["seconds"]) == 1, mode
    assert modes["plain"]["vs_plain"] == 1.0
    # both rounded to 0.1 from the unrounded median: half of the rounded one may differ by 0.05
    assert modes["replicas-2"]["mb_per_s_per_replica"] == pytest.approx(
        modes["replicas-2"]["mb_per_s_median"] / 2, abs=0.051
    )
    assert (
        "replicas-2" in done.stdout and not (tmp_path / "ckpt").exists()
    )  # the root is removed after
