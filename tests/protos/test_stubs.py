"""The committed gRPC stubs are what `make protos` generates from the committed .proto files,
through meshtrain/protos (the link to protos/), so they import `meshtrain.protos...`: a .proto
edited without regenerating, or a layout change that breaks the recipe, fails here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOC = "-m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=."


def test_the_makefile_compiles_through_the_package_path():
    recipe = (ROOT / "Makefile").read_text()
    assert "for f in meshtrain/protos/*/v1/*.proto" in recipe
    assert PROTOC in recipe


def test_regenerated_stubs_equal_the_committed_ones(tmp_path):
    pytest.importorskip(
        "grpc_tools", reason="grpcio-tools (the test and dev extras) is not installed"
    )
    shutil.copytree(
        ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("*_pb2*", "__pycache__")
    )
    (tmp_path / "meshtrain").mkdir()
    (tmp_path / "meshtrain" / "protos").symlink_to("../protos")
    protos = sorted((tmp_path / "meshtrain" / "protos").glob("*/v1/*.proto"))
    assert [p.parent.parent.name for p in protos] == [
        "checkpoint",
        "dataloader",
        "rollout",
        "trainer",
    ]
    for proto in protos:
        rel = proto.relative_to(tmp_path)
        out = subprocess.run(
            [sys.executable, *PROTOC.split(), str(rel)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "protos").rglob("*_pb2*"))
    committed = sorted(
        p.relative_to(ROOT)
        for p in (ROOT / "protos").rglob("*_pb2*")
        if "__pycache__" not in p.parts
    )
    assert generated == committed
    for rel in generated:
        assert (tmp_path / rel).read_text() == (ROOT / rel).read_text(), (
            f"{rel} differs: run `make protos`"
        )
    assert (
        "from meshtrain.protos.dataloader.v1 import dataloader_pb2"
        in (tmp_path / "protos/dataloader/v1/dataloader_pb2_grpc.py").read_text()
    )
