"""Shared helpers for the data service tests: a small dataset and worker processes on loopback."""

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from meshtrain.services.dataloader.config import user_cache_dir
from meshtrain.services.dataloader.indexed import IndexedDatasetWriter
from meshtrain.services.dataloader.rpc.servicer import DataLimits
from meshtrain.services.dataloader.spec import DatasetSpec
from meshtrain.services.launcher.topology import free_port

REPO = Path(__file__).resolve().parents[3]
# What a test's data worker serves (`--allow-root`): the temporary folders tests write datasets
# in, the cache holding the default corpus, the bucket of the tests' S3 server and their
# in-memory store.
TEST_ROOTS = (
    tempfile.gettempdir(),
    user_cache_dir(),
    "s3://meshtrain-test",
    "memory://flaky-stream",
)


def served_limits(**kw) -> DataLimits:
    """A test worker's DataLimits: `kw`, serving `TEST_ROOTS`."""
    return DataLimits(allow_roots=TEST_ROOTS, **kw)


def root_flags() -> list[str]:
    """`data serve` flags serving `TEST_ROOTS`."""
    return [arg for root in TEST_ROOTS for arg in ("--allow-root", root)]


def write_dataset(path, seed, n_docs=60):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, np.uint16) as w:
        for n in rng.integers(1, 80, size=n_docs):
            w.add_document(rng.integers(0, 60000, size=n))
    return str(path)


@pytest.fixture(scope="session")
def blend_spec(tmp_path_factory):
    """A two-dataset blend, 64 steps of global batch 16, seq 32."""
    d = tmp_path_factory.mktemp("service-data")
    a, b = write_dataset(d / "a", 1), write_dataset(d / "b", 2)
    return DatasetSpec(
        (a, b), (0.3, 0.7), seq_length=32, num_samples=64 * 16, seed=7, split="98,2,0"
    )


@pytest.fixture(scope="session")
def long_spec(blend_spec):
    """The same blend with 2 kB micro-batch messages and 2000 steps: a stream far longer than
    gRPC's flow-control window, so a worker killed mid-test is always killed mid-stream
    (with tiny messages the whole stream fits in socket buffers and a kill breaks nothing)."""
    from dataclasses import replace

    return replace(blend_spec, seq_length=511, num_samples=2000 * 16)


def batch_hash(batch) -> str:
    return hashlib.sha256(
        batch.tokens.numpy().tobytes() + batch.labels.numpy().tobytes()
    ).hexdigest()


class WorkerProcess:
    """`python -m meshtrain.services.dataloader.rpc.server` on a loopback port,
    as a real separate process."""

    def __init__(self, port: int | None = None, args: tuple[str, ...] = ()):
        port = free_port() if port is None else port
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshtrain.services.dataloader.rpc.server",
                "--port",
                str(port),
                "--grace",
                "1",
                *root_flags(),
                *args,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=None if os.environ.get("MESHTRAIN_TEST_WORKER_STDERR") else subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.port = port

    def wait_ready(self, timeout=60.0) -> "WorkerProcess":
        deadline = time.monotonic() + timeout
        line = self.proc.stdout.readline()  # "listening on 127.0.0.1:PORT"
        if not line.startswith("listening on") or time.monotonic() > deadline:
            raise RuntimeError(f"worker did not start: {line!r}, rc={self.proc.poll()}")
        self.port = int(line.rsplit(":", 1)[1])
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no graceful anything
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
