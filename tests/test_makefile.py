"""The Makefile's install recipe, read with `make -n` (nothing runs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torch_install_line(tmp_path: Path, *make_vars: str) -> str:
    out = subprocess.run(
        ["make", "-n", "-B", "install", f"VENV={tmp_path / 'venv'}", *make_vars],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = [line for line in out.splitlines() if '"torch==' in line]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on this machine")
def test_torch_comes_from_the_configured_index_or_the_one_named_by_torch_index(tmp_path):
    # PyPI's Linux torch wheel is the CUDA build; README tells such machines to name the CPU index
    assert "--index-url" not in _torch_install_line(tmp_path)
    cpu = "https://download.pytorch.org/whl/cpu"
    assert f'--index-url "{cpu}"' in _torch_install_line(tmp_path, f"TORCH_INDEX={cpu}")


def _pip_installs(tmp_path: Path, target: str) -> list[str]:
    out = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if "pip install" in line and "-e " in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on this machine")
def test_make_run_installs_no_test_extra_and_make_test_does(tmp_path):
    # the test extra brings Triton, transformers and megatron-core: nothing `meshtrain up` needs
    run = _pip_installs(tmp_path, "run")
    assert run and not any("test]" in line or ",test" in line for line in run), run
    assert any("plot" in line and "s3" in line for line in run), run  # loss.png; ARGS="--s3"
    test = _pip_installs(tmp_path, "test")
    assert any(",test]" in line for line in test), test
    assert all('-c "constraints.txt"' in line for line in run + test)


@pytest.mark.skipif(shutil.which("make") is None, reason="no `make` on this machine")
def test_test_after_run_adds_only_the_test_extra_and_run_after_test_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    # a venv `make run` built: newer than pyproject.toml and constraints.txt
    (venv / ".installed-2.13.0").touch()
    installs = [
        line
        for line in subprocess.run(
            ["make", "-n", "test", f"VENV={venv}", "TORCH_VERSION=2.13.0"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
        if "pip install" in line
    ]
    assert len(installs) == 1 and ",test]" in installs[0] and "torch==" not in installs[0], installs
    (venv / ".installed-2.13.0-test").touch()
    out = subprocess.run(
        ["make", "-n", "run", f"VENV={venv}", "TORCH_VERSION=2.13.0"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "pip install" not in out and "meshtrain up" in out, out
