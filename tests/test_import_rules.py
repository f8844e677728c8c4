"""The house's import rules, checked on the real modules: the import contracts of pyproject.toml's
[tool.importlinter] (the services' layers, the launcher reading only the trainer's config, kernels
and protos standing alone, grpc only at the edges, servers without CLIs, the model written for
one device), each run by `lint-imports`, which reads every module's imports, function-level ones
included. A broken contract fails its test with lint-imports' report: the importer, the imported
module and the line."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
    "contracts"
]

_LINT_IMPORTS = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def _env() -> dict[str, str]:
    """This checkout first on the path, so lint-imports reads its modules, not an installed copy."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    # wide enough that a report's "importer -> imported (l.N)" lines are not wrapped
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}


@pytest.mark.parametrize("contract", CONTRACTS, ids=[c["id"] for c in CONTRACTS])
def test_import_contract(contract):
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _LINT_IMPORTS,
            "--contract",
            contract["id"],
            "--no-cache",
            "--no-logo",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        pytest.fail(f"contract {contract['id']} broken:\n{out.stdout}{out.stderr}", pytrace=False)


def test_the_contracts_see_every_module():
    """services/, kernels/ and protos/ reach `meshtrain` through links, as namespace packages
    (no `__init__.py`, so that their bare names are harmless): a graph that did not follow them
    would keep every contract vacuously."""
    roots = ("meshtrain.services", "meshtrain.kernels", "meshtrain.protos")  # as the contracts'
    code = f"import grimp; print('\\n'.join(grimp.build_graph(*{roots!r}, cache_dir=None).modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    graph = set(out.stdout.split())
    files = [
        path
        for folder in ("services", "kernels", "protos")
        for path in (REPO / folder).rglob("*.py")
    ]
    modules = {
        ".".join(("meshtrain",) + p.relative_to(REPO).with_suffix("").parts).removesuffix(
            ".__init__"
        )
        for p in files
    }
    assert modules and modules <= graph, f"not in the import graph: {sorted(modules - graph)[:10]}"
