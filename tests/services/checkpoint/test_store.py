"""Root URLs, paths, atomic small-file writes and zarr stores over fsspec."""

import uuid

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from zarr.storage import FsspecStore, LocalStore

from meshtrain.services.checkpoint import store
from meshtrain.services.common.errors import CheckpointError


def test_open_root_local_file_and_memory(tmp_path):
    plain = store.open_root(str(tmp_path / "r"))
    url = store.open_root(f"file://{tmp_path}/r")
    assert isinstance(plain.fs, LocalFileSystem) and plain.is_local
    assert plain.path == url.path == f"{tmp_path}/r"
    mem = store.open_root("memory://bucket/r/")
    assert isinstance(mem.fs, MemoryFileSystem) and not mem.is_local
    assert mem.path == "/bucket/r"
    assert mem.step_url(50) == "memory://bucket/r/step_00000050"
    assert mem.step_path(50) == "/bucket/r/step_00000050"


def test_open_root_rejects_bad_urls():
    with pytest.raises(CheckpointError, match="non-empty"):
        store.open_root("")
    with pytest.raises(CheckpointError, match="nosuchproto://x"):
        store.open_root("nosuchproto://x")


def test_step_names():
    assert store.step_dirname(50) == "step_00000050"
    assert store.parse_step_dirname("step_00000050") == 50
    assert store.parse_step_dirname("step_123456789") == 123456789
    for bad in ("step_50", "step_00000050.tmp", "other"):
        assert store.parse_step_dirname(bad) is None
    for bad in (-1, 1.0, True, "5"):
        with pytest.raises(CheckpointError, match="non-negative int"):
            store.step_dirname(bad)
    assert store.join("/a/", "b", "", "c") == "/a/b/c"


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_write_bytes_atomic_leaves_only_the_file(kind, tmp_path):
    url = str(tmp_path / "r") if kind == "local" else f"memory://atomic-{uuid.uuid4().hex}/r"
    root = store.open_root(url)
    path = store.join(root.path, "step_00000001", "manifest.json")
    store.write_bytes_atomic(root, path, b"first")
    store.write_bytes_atomic(root, path, b"second")  # replaces, never appends
    assert store.read_bytes(root, path) == b"second"
    # no temporary file is left behind
    assert store.list_objects(root, root.path) == ["step_00000001/manifest.json"]
    store.remove_tree(root, root.path)
    assert not root.fs.exists(root.path)
    store.remove_tree(root, root.path)  # missing is fine


def test_zarr_store_kind(tmp_path):
    assert isinstance(store.zarr_store(store.open_root(str(tmp_path)), str(tmp_path)), LocalStore)
    mem = store.open_root("memory://zs/r")
    zs = store.zarr_store(mem, mem.path)
    assert isinstance(zs, FsspecStore) and zs.fs.asynchronous
