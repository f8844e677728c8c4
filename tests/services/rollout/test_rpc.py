"""The rollout service on real ports: answers equal the in-process engine's, weights published
both ways change outputs and versions, staleness, auth, bounds, and workers that die or join
during a run (nothing lost, nothing answered twice)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import grpc
import numpy as np
import psutil
import pytest

from meshtrain.protos.rollout.v1 import rollout_pb2 as pb
from meshtrain.protos.rollout.v1 import rollout_pb2_grpc as pb_grpc
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import InvalidRequestError
from meshtrain.services.common.security import ServerSecurity
from meshtrain.services.rollout.engine import Limits, RolloutEngine, engine_from_checkpoint
from meshtrain.services.rollout.rpc.client import (
    RolloutClient,
    RolloutRefusedError,
    RolloutUnavailableError,
)
from meshtrain.services.rollout.rpc.server import start_server
from meshtrain.services.rollout.types import RolloutRequest, SamplingParams
from tests.services.rollout.helpers import (
    PROMPTS,
    assert_same,
    save_policy,
    serve_child,
    tiny_model,
)

SAMPLING = SamplingParams(max_new_tokens=6, seed=5)
TOKENS = {"read": "r" * 8 + "-read-token-0001", "write": "w" * 8 + "-write-token-002"}


@pytest.fixture
def servers():
    """start(engine, **kw) -> address; every server is stopped after the test."""
    started = []

    def start(engine, **kw):
        server, port, _ = start_server(engine, **kw)
        started.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in started:
        s.stop(0)


def test_answers_equal_the_engine_however_many_workers(servers):
    req = RolloutRequest(PROMPTS, 3, SAMPLING)
    want = RolloutEngine(tiny_model(1), version=2).generate(req)
    addrs = [servers(RolloutEngine(tiny_model(1), version=2)) for _ in range(2)]
    with RolloutClient(addrs[:1]) as one, RolloutClient(addrs) as two:
        assert_same(one.generate(req), want)
        assert_same(two.generate(req), want)
        assert {d["version"] for d in two.describe().values()} == {2}


def test_weights_published_by_stream_and_by_checkpoint_change_outputs_and_versions(
    servers, tmp_path
):
    root = str(tmp_path / "ckpt")
    save_policy(root, 1, seed=1)
    addr = servers(engine_from_checkpoint(root, device="cpu"), checkpoint_root=root)
    req = RolloutRequest(PROMPTS, 2, SAMPLING)
    with RolloutClient([addr], max_staleness=0) as client:
        first = client.generate(req)
        assert {c.policy_version for c in first} == {1}
        client.update_weights(2, tensors=tiny_model(7).state_dict())  # streamed
        streamed = client.generate(req)
        assert_same(streamed, RolloutEngine(tiny_model(7), version=2).generate(req))
        save_policy(root, 3, seed=8)
        client.update_weights(3)  # from the checkpoint root
        loaded = client.generate(req)
        assert_same(loaded, RolloutEngine(tiny_model(8), version=3).generate(req))
        assert first != streamed and streamed != loaded
        with pytest.raises(InvalidRequestError, match="older"):
            client.update_weights(2, tensors=tiny_model(7).state_dict())


def test_stale_workers_refuse_and_the_client_refuses_stale_completions(servers):
    addr = servers(RolloutEngine(tiny_model(1), version=4))
    with RolloutClient([addr], max_staleness=1) as client:
        with pytest.raises(RolloutUnavailableError, match="version 4"):
            client.generate(RolloutRequest(PROMPTS, 1, SAMPLING, min_version=5))
        client.version = 6  # the trainer is at 6: version 4 is two behind
        with pytest.raises(RolloutUnavailableError, match=">= 5"):
            client.generate(RolloutRequest(PROMPTS, 1, SAMPLING))
        client.version = 5
        assert {
            c.policy_version for c in client.generate(RolloutRequest(PROMPTS, 1, SAMPLING))
        } == {4}


def test_tokens_and_scopes(servers):
    security = ServerSecurity({t: scope for scope, t in TOKENS.items()})
    addr = servers(RolloutEngine(tiny_model(1)), security=security)
    req = RolloutRequest(PROMPTS[:2], 1, SAMPLING)
    with RolloutClient([addr], ClientSecurity(token=None)) as anonymous:
        with pytest.raises(RolloutRefusedError, match="UNAUTHENTICATED"):
            anonymous.generate(req)
    with RolloutClient([addr], ClientSecurity(token=TOKENS["read"])) as reader:
        assert len(reader.generate(req)) == 2
        with pytest.raises(RolloutRefusedError, match="PERMISSION_DENIED"):
            reader.update_weights(1, tensors=tiny_model(2).state_dict())
    with RolloutClient([addr], ClientSecurity(token=TOKENS["write"])) as writer:
        writer.update_weights(1, tensors=tiny_model(2).state_dict())
        assert {c.policy_version for c in writer.generate(req)} == {1}


def test_every_client_chosen_size_is_bounded(servers):
    limits = Limits(max_prompts=4, max_prompt_tokens=8, max_group_size=2, max_new_tokens=5)
    addr = servers(RolloutEngine(tiny_model(1), limits=limits), max_chunk_bytes=1024)
    stub = pb_grpc.RolloutServiceStub(grpc.insecure_channel(addr))

    def ask(**kw):
        fields = dict(
            prompts=[pb.Prompt(tokens=np.arange(1, 4, dtype="<i4").tobytes())],
            group_size=1,
            sampling=pb.Sampling(max_new_tokens=2),
        )
        fields.update(kw)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(**fields), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return e.value.details()

    one = pb.Prompt(tokens=np.arange(1, 3, dtype="<i4").tobytes())
    assert "prompts" in ask(prompts=[one] * 5)
    assert "prompts[0]" in ask(prompts=[pb.Prompt(tokens=b"\0" * 4 * 9)])
    assert "prompts[0]" in ask(prompts=[pb.Prompt(tokens=b"\1\2\3")])
    assert "outside" in ask(prompts=[pb.Prompt(tokens=np.array([10**6], "<i4").tobytes())])
    assert "group_size" in ask(group_size=3)
    assert "max_new_tokens" in ask(sampling=pb.Sampling(max_new_tokens=6))
    assert "temperature" in ask(sampling=pb.Sampling(max_new_tokens=1, temperature=-1))
    with pytest.raises(grpc.RpcError) as e:
        stub.UpdateWeights(
            iter(
                [
                    pb.WeightChunk(
                        version=1,
                        name="final_norm.weight",
                        dtype="float32",
                        shape=[32],
                        data=b"\0" * 2000,
                    )
                ]
            ),
            timeout=10,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in e.value.details()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(addr: str, timeout: float = 180.0) -> None:
    stub = pb_grpc.RolloutServiceStub(grpc.insecure_channel(addr))
    deadline = time.monotonic() + timeout
    while True:
        try:
            stub.Describe(pb.DescribeRequest(), timeout=1)
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _kill_once_busy(pid: int, cpu_s: float = 0.05, limit_s: float = 120.0) -> None:
    """SIGKILL `pid` once it has used `cpu_s` more CPU seconds than now (it is sampling)."""
    proc = psutil.Process(pid)
    base = sum(proc.cpu_times()[:2])
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if sum(proc.cpu_times()[:2]) - base >= cpu_s:
            break
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.e2e
def test_a_worker_killed_mid_request_or_added_during_a_run_loses_and_repeats_nothing(
    servers, tmp_path
):
    root = str(tmp_path / "ckpt")
    save_policy(root, 1, seed=1)
    port = _free_port()
    child = mp.get_context("spawn").Process(target=serve_child, args=(root, port), daemon=True)
    child.start()
    try:
        doomed = f"127.0.0.1:{port}"
        _wait_serving(doomed)
        steady_engine = engine_from_checkpoint(root, device="cpu", eod_id=0)
        steady = servers(steady_engine)
        reference = engine_from_checkpoint(root, device="cpu", eod_id=0)
        # Long enough on the child that the kill lands while its shard is being sampled; the
        # kill waits for the child to start computing, however busy the machine is.
        req = RolloutRequest(PROMPTS * 8, 16, SamplingParams(max_new_tokens=30, seed=2))
        with RolloutClient([doomed, steady], retry_after_s=60) as client:
            threading.Thread(target=_kill_once_busy, args=(child.pid,), daemon=True).start()
            got = client.generate(req)
            killed = client._workers[0].down_until > time.monotonic()
            assert killed, "the child's shard finished before the kill; make the request longer"
            assert_same(got, reference.generate(req))  # every prompt's group once, in order
            # A worker that joins is used from the next request on.
            joined_engine = engine_from_checkpoint(root, device="cpu", eod_id=0)
            client.add_worker(servers(joined_engine))
            small = RolloutRequest(PROMPTS, 2, SAMPLING, request_id="joined")
            assert_same(client.generate(small), reference.generate(small))
            assert any(k.startswith("joined/") for k in joined_engine._recent)
            assert any(k.startswith("joined/") for k in steady_engine._recent)
    finally:
        child.kill()
        child.join(10)
