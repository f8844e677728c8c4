"""The house's import rules, checked on the real modules: the data and checkpoint services never
import the trainer (what they need of a model, its architecture config, lives in common), and
the trainer's model code imports no parallel code."""

from __future__ import annotations

import subprocess
import sys

import pytest

_IMPORTS = """
import importlib, pkgutil, sys
import meshtrain.services.{pkg} as pkg
for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(m.name)
print(" ".join(sorted(n for n in sys.modules if n.startswith({banned!r}))))
"""


@pytest.mark.parametrize("pkg", ["dataloader", "checkpoint", "common"])
def test_a_service_never_imports_the_trainer(pkg):
    code = _IMPORTS.format(pkg=pkg, banned="meshtrain.services.trainer")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [], f"meshtrain.services.{pkg} imports {out.stdout.split()}"


def test_the_model_is_written_for_one_device():
    code = _IMPORTS.format(pkg="trainer.model", banned="meshtrain.services.trainer.parallel")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [], f"the model imports {out.stdout.split()}"
