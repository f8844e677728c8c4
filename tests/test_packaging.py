"""One import name: the repository's services/, kernels/ and protos/ are the packages
meshtrain.services, meshtrain.kernels and meshtrain.protos, and nothing else.

A wheel built from the tree holds `meshtrain` alone (no top-level `services`, `kernels` or
`protos` to collide with a user's packages), with the stubs' .proto files and the C source the
blend index compiles; every module of the package imports under that one name. From the
repository's root (where Python finds the folders by their bare names) the three folders are
empty namespace portions: a module in them imported by its bare name fails naming the right
one, so no file can be loaded twice under two names, and another distribution's package of the
same name (Hugging Face's `kernels`, which transformers imports) wins over them.
"""

from __future__ import annotations

import ast
import importlib.machinery
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


def _children(folder: str) -> list[str]:
    """The bare dotted names of a top-level folder's modules and packages."""
    return sorted(
        f"{folder}.{p.stem}"
        for p in (ROOT / folder).iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.stem != "__init__"
    )


@pytest.mark.parametrize("folder", ["services", "kernels", "protos"])
def test_a_module_imported_by_its_bare_name_fails_naming_the_package(folder):
    """Every module and package directly in the folder refuses its bare name (the folder itself
    has no code to refuse it: it is a namespace portion), and so does a module deeper down."""
    names = (
        _children(folder)
        + {
            "services": ["services.trainer.train"],
            "kernels": [],
            "protos": ["protos.dataloader.v1.dataloader_pb2"],
        }[folder]
    )
    assert len(names) >= 3, names
    # the bare name made ours even where another distribution's package of that name is
    # installed (which would win, as the test below shows)
    code = (
        "import importlib, importlib.machinery, importlib.util, sys\n"
        f"spec = importlib.machinery.PathFinder.find_spec({folder!r}, [{str(ROOT)!r}])\n"
        f"sys.modules[{folder!r}] = importlib.util.module_from_spec(spec)\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as e:\n"
        "        print(name, '|', e)\n"
        "    else:\n"
        "        print(name, '| imported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == len(names), out.stdout
    for line in lines:
        name, message = line.split(" | ")
        first = ".".join(name.split(".")[:2])  # the guard sits in the first module below the folder
        assert message.startswith(f"import meshtrain.{first}, not {first}: "), line


@pytest.mark.parametrize("folder", ["services", "kernels", "protos"])
def test_a_bare_folder_name_is_an_empty_namespace_that_any_package_outranks(folder, tmp_path):
    """From the repository's root the bare name finds only a namespace portion (no code of ours
    to run, no metadata), and a regular package of that name anywhere on the path wins, even
    one after the root."""
    ours = importlib.machinery.PathFinder.find_spec(folder, [str(ROOT)])
    assert ours is not None and ours.origin is None and ours.loader is None, ours
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "__init__.py").write_text("")
    found = importlib.machinery.PathFinder.find_spec(folder, [str(ROOT), str(tmp_path)])
    assert found.origin == str(tmp_path / folder / "__init__.py"), found


@pytest.mark.parametrize("first", ["transformers", "meshtrain"])
@pytest.mark.e2e
def test_transformers_imports_from_the_repository_root(first):
    """transformers probes for Hugging Face's `kernels` and imports whatever `kernels` it finds
    (with no metadata of its own, a namespace portion counts as absent): started in the
    repository's root, `import transformers` must not run into the repository's kernels/, before
    or after `import meshtrain`."""
    pytest.importorskip("transformers")
    second = "meshtrain" if first == "transformers" else "transformers"
    code = (
        f"import {first}, {second}, meshtrain\n"
        "from transformers.utils import import_utils\n"
        "getattr(import_utils, 'is_kernels_available', lambda: None)()\n"
        "print(meshtrain.ModelConfig.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().startswith("meshtrain."), out.stdout


@pytest.mark.e2e
def test_every_module_imports_under_one_name_and_no_file_under_two():
    code = """
import importlib, pkgutil, sys, meshtrain
names = []
for top in ("meshtrain", "meshtrain.services", "meshtrain.kernels", "meshtrain.protos"):
    package = importlib.import_module(top)
    names += [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
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


def test_the_type_checking_imports_match_the_lazy_table():
    """Type checkers read the `if TYPE_CHECKING:` imports of meshtrain/__init__.py, the run time
    `_EXPORTS` and `_RENAMED`: the two must name the same objects (a module moved in one table
    and not the other would type-check against a name that fails at run time, or the reverse)."""
    import meshtrain

    tree = ast.parse((ROOT / "meshtrain" / "__init__.py").read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    typed = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            typed[alias.asname or alias.name] = (node.module, alias.name)
    lazy = {
        name: (module, meshtrain._RENAMED.get(name, name))
        for name, module in meshtrain._EXPORTS.items()
    }
    assert typed == lazy
    assert sorted(meshtrain.__all__) == sorted(lazy)
