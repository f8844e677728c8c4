"""benchmarks/moe_gemm.py on CPU: its options parse (`--fp8` among them), the routing's row
counts add up, one projection's measurement (every side's fallback, the compiled FP8 side
included) writes every field, and the script refuses to time without CUDA."""

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


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import moe_gemm
    finally:
        sys.path.pop(0)
    return moe_gemm


def test_counts_cover_every_row():
    counts_for = _bench().counts_for
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


def test_one_projection_on_cpu_measures_every_side():
    r = _bench().measure(64, 32, 48, 4, skew=True, iters=1, fp8=True, device="cpu")
    sides = ("grouped", "dense", "loop", "fp8_grouped", "fp8_grouped_compiled")
    for side in sides:
        assert set(r[side]) == {"fwd_ms", "fwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops"}, side
    for side in sides[3:]:
        assert r[f"{side}_over_grouped_fwd_bwd"] > 0
    assert 0 < r["fp8_rel_err_vs_bf16"] < 0.06  # FP8 rounding (tests/.../test_fp8_experts.py)
