"""The Makefile's install recipe, read with `make -n` (nothing runs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torch_install_line(tmp_path: Path, *make_vars: str) -> str:
    out = subprocess.run(["make", "-n", "-B", "install", f"VENV={tmp_path / 'venv'}", *make_vars], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if '"torch==' in line]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on this machine")
def test_torch_comes_from_the_configured_index_or_the_one_named_by_torch_index(tmp_path):
    # PyPI's Linux torch wheel is the CUDA build; README tells such machines to name the CPU index
    assert "--index-url" not in _torch_install_line(tmp_path)
    cpu = "https://download.pytorch.org/whl/cpu"
    assert f'--index-url "{cpu}"' in _torch_install_line(tmp_path, f"TORCH_INDEX={cpu}")
