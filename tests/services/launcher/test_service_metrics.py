"""Prometheus metrics of the data and checkpoint services, scraped from their real HTTP endpoint.

The services run as `meshtrain data serve` / `meshtrain ckpt serve` processes with
`--metrics-port`, started by the launcher's `Topology` exactly as `meshtrain up --metrics` does.
"""

import io
import re
import sys
import urllib.request

import pytest

from meshtrain.services.checkpoint.rpc.client import CheckpointClient
from meshtrain.services.common.errors import MeshtrainError
from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.spec import DatasetSpec
from meshtrain.services.launcher.health import wait_serving
from meshtrain.services.launcher.topology import Child, Topology, free_port
from tests.services.dataloader.conftest import write_dataset

MESHTRAIN = [sys.executable, "-m", "meshtrain.services.cli"]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(\S+) (\S+)$", text, re.MULTILINE)
        if not m.group(1).startswith("#")
    }


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """A data worker and a checkpoint service with metrics ports:
    {name: (grpc port, metrics port)}."""
    tmp = tmp_path_factory.mktemp("metrics")
    topo = Topology(io.StringIO())
    ports = {}
    data = ["data", "serve", "--allow-root", str(tmp)]  # the datasets the tests write there
    for name, argv in (("data", data), ("ckpt", ["ckpt", "serve", str(tmp / "ckpt")])):
        port, mport = free_port(), free_port()
        topo.start(
            Child(
                name,
                MESHTRAIN + argv + ["--port", str(port), "--metrics-port", str(mport)],
                port=port,
            ),
            wait_serving(120),
        )
        ports[name] = (port, mport)
    yield ports, tmp
    assert topo.shutdown() == {"data": 0, "ckpt": 0}


def test_data_service_exports_requests_bytes_latency_and_queue_depth(services):
    ports, tmp = services
    port, mport = ports["data"]
    a = write_dataset(tmp / "a", 1)
    # 20000 steps: a stream far longer than gRPC buffers ahead, so it is still open when scraped
    spec = DatasetSpec(
        (a,), (1.0,), seq_length=32, num_samples=20_000 * 16, seed=3, split="100,0,0"
    )
    labels = 'method="StreamBatches",service="data"'
    with ServiceBatchSource([f"127.0.0.1:{port}"], spec, 2, 16, 0, 1, prefetch=2) as source:
        batches = [source.micro_batches(step) for step in range(3)]
        live = scrape(mport)
        # the long-lived stream holds one of the server's slots while it is open
        assert live[f"meshtrain_rpc_in_flight{{{labels}}}"] == 1
        assert live['meshtrain_rpc_capacity{service="data"}'] == 32
        tokens = sum(b.tokens.numel() for step in batches for b in step)
        assert (
            live[f"meshtrain_rpc_sent_bytes_total{{{labels}}}"] >= tokens * 2
        )  # uint16 on the wire
        assert live[f"meshtrain_rpc_received_bytes_total{{{labels}}}"] > 0
    after = scrape(mport)
    assert after[f"meshtrain_rpc_latency_seconds_count{{{labels}}}"] >= 1
    # the health checks that gated the start count too
    assert after['meshtrain_rpc_requests_total{code="OK",method="Check",service="data"}'] >= 1


def test_checkpoint_service_counts_requests_by_status_code(services):
    ports, _ = services
    port, mport = ports["ckpt"]
    with CheckpointClient(f"127.0.0.1:{port}") as client:
        assert client.list() == []
        with pytest.raises(MeshtrainError):
            client.describe(7)  # no such checkpoint: the error interceptor's status is what counts
    values = scrape(mport)
    assert values['meshtrain_rpc_requests_total{code="OK",method="List",service="checkpoint"}'] == 1
    errors = {
        k: v
        for k, v in values.items()
        if k.startswith("meshtrain_rpc_requests_total") and 'method="Describe"' in k
    }
    assert len(errors) == 1 and 'code="OK"' not in next(iter(errors)) and sum(errors.values()) == 1
    assert values['meshtrain_rpc_latency_seconds_count{method="List",service="checkpoint"}'] == 1


@pytest.mark.parametrize(
    "argv", [["data", "serve"], ["ckpt", "serve", "CKPT"]], ids=["data", "ckpt"]
)
@pytest.mark.e2e
def test_a_busy_metrics_port_is_a_clear_error_not_a_traceback(argv, tmp_path):
    import socket
    import subprocess

    argv = [str(tmp_path / "ckpt") if a == "CKPT" else a for a in argv]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        done = subprocess.run(
            MESHTRAIN + argv + ["--metrics-port", str(busy)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    assert f"cannot serve Prometheus metrics on 127.0.0.1:{busy}" in done.stderr
    assert "Traceback" not in done.stderr
