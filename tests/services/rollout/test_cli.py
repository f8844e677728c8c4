"""`meshtrain rollout serve` as a real process, through the command line: it loads a checkpoint,
binds a free port, answers the health check and Generate as the engine does in this process,
loads published steps from its --checkpoint-root, and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.launcher.health import grpc_serving
from meshtrain.services.rollout.engine import engine_from_checkpoint
from meshtrain.services.rollout.rpc.client import RolloutClient, RolloutRefusedError
from meshtrain.services.rollout.types import RolloutRequest, SamplingParams
from tests.services.rollout.helpers import PROMPTS, assert_same, save_policy

ROOT = Path(__file__).parents[3]


@pytest.mark.e2e
def test_rollout_serve_answers_generate_loads_published_steps_and_stops_on_sigterm(tmp_path):
    start, published = str(tmp_path / "sft"), str(tmp_path / "run")
    save_policy(start, 2, seed=0)
    save_policy(published, 5, seed=1)
    token_file = tmp_path / "token"
    token_file.write_text("admin secret-token-of-the-test\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("MESHTRAIN_TOKEN", None)
    worker = subprocess.Popen(
        [sys.executable, "-m", "meshtrain.services.cli", "rollout", "serve"]
        + ["--load", start, "--checkpoint-root", published, "--port", "0"]
        + ["--device", "cpu", "--eod-id", "0", "--token-file", str(token_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in worker.stdout:  # port 0: the worker says which port it bound
            lines.append(line)
            if line.startswith("listening on "):
                address = line.split()[-1]
                break
        else:
            pytest.fail(f"rollout serve exited ({worker.wait()}):\n{''.join(lines)}")
        deadline = time.monotonic() + 20
        while not grpc_serving(address):
            assert time.monotonic() < deadline, f"{address} never reported SERVING"
            time.sleep(0.2)
        request = RolloutRequest(
            PROMPTS[:3], group_size=2, sampling=SamplingParams(max_new_tokens=6, seed=3)
        )
        with RolloutClient(address, ClientSecurity(token="wrong"), timeout_s=30) as client:
            with pytest.raises(RolloutRefusedError):
                client.generate(request)
        secure = ClientSecurity(token="secret-token-of-the-test")
        with RolloutClient(address, secure, timeout_s=30, retry_after_s=0.5) as client:
            got = client.generate(request)
            assert_same(
                got, engine_from_checkpoint(start, device="cpu", eod_id=0).generate(request)
            )
            assert {c.policy_version for c in got} == {2}
            client.update_weights(5)  # LoadCheckpoint: step 5 of --checkpoint-root, not --load
            again = client.generate(request)
        assert_same(
            again, engine_from_checkpoint(published, device="cpu", eod_id=0).generate(request)
        )
        assert {c.policy_version for c in again} == {5}
        os.killpg(worker.pid, signal.SIGTERM)
        out, _ = worker.communicate(timeout=20)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    assert worker.returncode == 0, "".join(lines) + out
    assert "Traceback" not in out, out


def test_cuda_graphs_are_on_unless_turned_off():
    from meshtrain.services.rollout.config import check_serve_arguments

    assert check_serve_arguments([], {}, "serve").cuda_graphs is True
    assert check_serve_arguments(["--no-cuda-graphs"], {}, "serve").cuda_graphs is False
