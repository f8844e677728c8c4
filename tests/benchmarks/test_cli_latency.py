"""benchmarks/cli_latency.py runs each command, checks its exit status and writes its JSON
(no time is asserted: the machine's load decides it)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_runs_once_and_writes_its_json(tmp_path):
    out = tmp_path / "cli.json"
    subprocess.run(
        [sys.executable, "benchmarks/cli_latency.py", "--runs", "1", "--no-reference"]
        + ["--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    record = json.loads(out.read_text())
    assert record["runs"] == 1
    assert set(record["results"]) >= {
        "meshtrain --help (baseline)",
        "meshtrain train --bogus-flag",
        "meshtrain train --config missing.toml",
    }
    assert record["results"]["meshtrain --help (baseline)"]["vs_baseline"] == 1.0
