"""benchmarks/recompute_compile_memory.py end to end at a tiny size on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_writes_every_variant_with_its_ratios(tmp_path):
    """aot_eager for the whole-model variants keeps it cheap; the per-block one needs Inductor,
    so it is left out here (the slow test in tests/services/trainer/parallel runs it)."""
    out = tmp_path / "memory.json"
    variants = ["eager none", "eager full", "compiled whole, full", "eager selective"]
    subprocess.run(
        [sys.executable, "benchmarks/recompute_compile_memory.py", "--layers", "2", "--seq", "128"]
        + ["--backend", "aot_eager", "--out", str(out), "--variants", *variants],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    rows = json.loads(out.read_text())["variants"]
    assert set(rows) == set(variants)
    for row in rows.values():
        assert set(row) == {
            "saved_bytes",
            "peak_bytes",
            "loss",
            "saved_vs_eager_full",
            "peak_vs_eager_full",
        }
        assert row["saved_bytes"] > 0 and row["peak_bytes"] > 0
    assert rows["eager full"]["peak_vs_eager_full"] == 1.0
    assert rows["eager none"]["saved_vs_eager_full"] > 2  # recompute keeps less
