"""A SeaweedFS S3 server on loopback for tests and benchmarks: `ObjectStore` run as a process.

The command line, identity file, free ports and bucket creation are
`meshtrain.services.launcher.objectstore`'s, the same code `meshtrain up --s3` runs; this adds the
process lifetime a test fixture needs. Data lives in a temporary folder. SeaweedFS takes ~25 s
to exit on SIGTERM, so `stop()` sends SIGTERM, waits a short grace period, then SIGKILLs. The
server never outlives the process that started it: `stop()` also runs at exit, and on Linux the
kernel SIGKILLs it when that process dies without one (a killed or interrupted pytest).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from pathlib import Path

from meshtrain.services.launcher.health import http_answers
from meshtrain.services.launcher.objectstore import AccessKeys, ObjectStore, find_weed
from meshtrain.services.launcher.topology import dies_with_us, free_port

__all__ = ["S3Server", "find_weed", "free_port"]

KEYS = AccessKeys("meshtrain-test", "meshtrain-test-secret")


class S3Server:
    """One `weed server -s3` process with a bucket made.

    Args:
        weed: path of the binary.
        workdir: folder for its data, config and log.
    """

    def __init__(self, weed: str, workdir: Path):
        self.store = ObjectStore(weed, Path(workdir), KEYS)
        self.workdir = Path(workdir)
        self.bucket = "meshtrain-test"
        self.process: subprocess.Popen | None = None

    @property
    def port(self) -> int:
        return self.store.port

    @property
    def endpoint(self) -> str:
        return self.store.endpoint

    def env(self) -> dict[str, str]:
        """Environment variables that point s3fs/botocore at this server."""
        return self.store.env()

    def start(self, timeout: float = 60.0) -> None:
        """Starts the server and waits until its S3 port answers and the bucket exists."""
        # Open for the server's whole life, closed in stop().
        self.log = open(self.workdir / "weed.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            dies_with_us(self.store.argv(), signal.SIGKILL),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while not http_answers(self.endpoint):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.process.returncode}; log: {self.workdir / 'weed.log'}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed S3 did not come up in {timeout} s")
            time.sleep(0.3)
        self.store.make_bucket(self.bucket, max(1.0, deadline - time.monotonic()))

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds (weed takes ~25 s to exit cleanly)."""
        atexit.unregister(self.stop)
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.log.close()
