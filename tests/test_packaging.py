"""One import name: the repository's services/, kernels/ and protos/ are the packages
meshtrain.services, meshtrain.kernels and meshtrain.protos, and nothing else.

A wheel built from the tree holds `meshtrain` alone (no top-level `services`, `kernels` or
`protos` to collide with a user's packages), with the stubs' .proto files and the C source the
blend index compiles; every module of the package imports under that one name; and a folder
imported by its bare name from the repository root (where Python finds it) fails naming the
right one, so no file can be loaded twice under two names.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_a_wheel_installs_meshtrain_and_nothing_else_at_the_top(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in (
        "meshtrain",
        "services",
        "kernels",
        "protos",
    ):  # links kept as links, as git checks them out
        shutil.copytree(
            ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("meshtrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"meshtrain", next(t for t in tops if t.endswith(".dist-info"))}, sorted(tops)
    for needed in (
        "meshtrain/__init__.py",
        "meshtrain/services/trainer/train.py",
        "meshtrain/kernels/rms_norm.py",
        "meshtrain/protos/dataloader/v1/dataloader_pb2.py",
        "meshtrain/protos/dataloader/v1/dataloader.proto",
        "meshtrain/services/dataloader/_blend.c",
    ):
        assert needed in names, needed
    entry = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith("entry_points.txt")))
        .decode()
    )
    assert "meshtrain = meshtrain.services.cli:main" in entry


@pytest.mark.parametrize("folder", ["services", "kernels", "protos"])
def test_a_folder_imported_by_its_bare_name_fails_naming_the_package(folder):
    out = subprocess.run(
        [sys.executable, "-c", f"import {folder}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert f"ImportError: import meshtrain.{folder}, not {folder}" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("folder", ["services", "kernels", "protos"])
def test_after_import_meshtrain_the_bare_names_are_absent_not_ours(folder):
    """From the repository root, once meshtrain is imported a probe for another package of that name
    finds nothing (transformers looks for Hugging Face's `kernels` and imports what it finds)."""
    code = (
        f"import importlib.util, meshtrain\nassert importlib.util.find_spec({folder!r}) is None\n"
        f"try:\n    import {folder}\nexcept ModuleNotFoundError:\n    print('absent')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "absent", out.stderr[-2000:]


def test_every_module_imports_under_one_name_and_no_file_under_two():
    code = """
import importlib, pkgutil, sys, meshtrain
names = [m.name for m in pkgutil.walk_packages(meshtrain.__path__, "meshtrain.")]
for name in names:
    importlib.import_module(name)
files = {}
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if path and name.split(".")[0] in ("meshtrain", "services", "kernels", "protos"):
        assert name.startswith("meshtrain"), name
        real = __import__("os").path.realpath(path)
        assert real not in files, (real, files.get(real), name)
        files[real] = name
print(len(names), len(files))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    walked, loaded = map(int, out.stdout.split())
    assert walked > 100 and loaded > 100


def test_the_public_api_resolves_every_name_it_exports():
    import meshtrain

    for name in meshtrain.__all__:
        assert getattr(meshtrain, name) is not None, name
    assert set(meshtrain.__all__) <= set(dir(meshtrain))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        meshtrain.nope  # noqa: B018


def test_importing_meshtrain_loads_neither_torch_nor_grpc():
    """A data or checkpoint worker imports the package first: the API is imported on first use."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, meshtrain; print('torch' in sys.modules, 'grpc' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == ["False", "False"], out.stderr
