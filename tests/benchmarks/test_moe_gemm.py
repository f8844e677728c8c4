"""benchmarks/moe_gemm.py on CPU: its options parse (`--fp8` among them), the routing's row
counts add up, and it refuses to time without CUDA rather than time the CPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "moe_gemm.py")


def test_help_lists_the_fp8_side():
    out = subprocess.run(
        [sys.executable, SCRIPT, "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--fp8" in out and "--experts" in out


def test_counts_cover_every_row():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from moe_gemm import counts_for
    finally:
        sys.path.pop(0)
    for skew in (False, True):
        c = counts_for(1000, 8, skew)
        assert c.sum() == 1000 and (c > 0).all()
    assert counts_for(1000, 8, True)[-1] > 4 * counts_for(1000, 8, True)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what runs without CUDA")
def test_refuses_without_cuda(tmp_path):
    run = subprocess.run(
        [sys.executable, SCRIPT, "--fp8", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and "no CUDA device" in run.stderr
    assert not (tmp_path / "x.json").exists()
