"""The loop in docs/api.md ("A loop in brief") runs as written: copied into a file of its own and
run as one process on the CPU, it trains (its loss falls) and saves and reloads a checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def api_loop() -> str:
    """The first Python block under docs/api.md's "## A loop in brief"."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("\n## A loop in brief\n", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "docs/api.md's loop section has no python block"
    return m.group(1)


@pytest.mark.e2e
def test_the_api_docs_loop_runs_on_one_cpu_process(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(api_loop())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    losses = [float(v) for v in re.findall(r"^step \d+ loss ([\d.]+)", proc.stdout, re.M)]
    assert len(losses) == 20 and losses[-1] < losses[0], proc.stdout
    assert (tmp_path / "ckpt").is_dir()
