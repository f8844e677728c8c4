"""Checkpoint service replicas behind one address: writers spread over them, any replica serves
any call of a save (adopting it from its marker in storage), a replica SIGKILLed mid-save is
replaced by another without losing the save, two replicas asked to commit one step commit it
once; and the direct data plane (writers store into the root, the service grants and commits).

The kill test runs real `meshtrain ckpt serve` processes; the others run servers in this process.
"""

import contextlib
import glob
import json
import os
import threading
import time

import pytest
import torch

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.services.checkpoint.async_save import AsyncSaver
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.reader import list_checkpoints, read_manifest
from meshtrain.services.checkpoint.rpc.client import CheckpointClient
from meshtrain.services.checkpoint.rpc.replicas import Replicas, key_of, parse_addresses, resolve
from meshtrain.services.checkpoint.rpc.server import start_server
from meshtrain.services.common.errors import CheckpointError
from tests.services.checkpoint.test_service_restart import (
    PausingClient,
    Serve,
    layered,
    same,
    wait_for,
)


@contextlib.contextmanager
def replicas(root: str, n: int = 2, **options):
    """n checkpoint services in this process serving one root; yields their addresses."""
    servers = [start_server(root, commit_timeout=10, **options) for _ in range(n)]
    try:
        yield [f"127.0.0.1:{port}" for _, port, _ in servers]
    finally:
        for server, _, _ in servers:
            server.stop(0)


def box(name: str, value: float, n: int = 4):
    return ShardSpec(name, (n,), "float32", (0,), (n,)), torch.full((n,), value)


def test_addresses_are_parsed_and_refused_by_name():
    assert parse_addresses("a:1, b:2") == ["a:1", "b:2"]
    assert parse_addresses(["a:1", "dns:///svc:7"]) == ["a:1", "dns:///svc:7"]
    for bad in ("", " , ", "nohost", "dns:///svc", "dns:///svc:0x"):
        with pytest.raises(CheckpointError, match="checkpoint service address"):
            parse_addresses(bad)
    assert resolve("dns:///localhost:5") and all(
        t.endswith(":5") for t in resolve("dns:///localhost:5")
    )
    assert key_of("abc") == key_of("abc") and key_of(7) == 7


def test_writers_spread_and_a_failed_replica_is_tried_last():
    r = Replicas("b:2,a:1,c:3", make_channel=lambda target: None)
    assert r.targets() == ["a:1", "b:2", "c:3"]  # one order on every rank
    assert [r.order(w)[0] for w in range(4)] == ["a:1", "b:2", "c:3", "a:1"]
    r.mark_down("b:2")
    assert r.order(1) == ["c:3", "a:1", "b:2"]
    assert r.order(0, prefer="c:3")[0] == "c:3"


def test_any_replica_serves_any_call_of_a_save(tmp_path):
    root = str(tmp_path / "ckpt")
    with replicas(root) as (a, b):
        with CheckpointClient(a) as ca, CheckpointClient(b) as cb:
            save_id = ca.begin_save(3, num_writers=2)
            # writer 0 through the replica that began the save, writer 1 through the other, which
            # adopts the save from storage (the header names the step); the other one commits
            for w, client in enumerate((ca, cb)):
                writer = client.writer(3, save_id, w, 2)
                writer.write(*box(f"w{w}", w + 1.0))
                writer.finish()
            assert cb.commit(3, save_id, 2, {"by": "b"}).step == 3
            assert (
                ca.commit(3, save_id, 2, {"by": "b"}).step == 3
            )  # a retry elsewhere finds the commit
            assert read_manifest(root, 3)["save_id"] == save_id

            # a writer of an older client (no step in its header) gets NOT_FOUND from a replica
            # that has not seen the save; ResumeSave there takes it up from the marker
            save_id = ca.begin_save(4, num_writers=1)
            header = pb.WriteShardsRequest(header=pb.WriteHeader(save_id=save_id, writer_id=0))
            with pytest.raises(Exception, match="NOT_FOUND"):
                cb.stub.WriteShards(iter([header]))
            assert cb.resume_save(4, save_id, 1) is False
            other = ca.begin_save(10, num_writers=1)
            with pytest.raises(CheckpointError, match="num_writers=3 differs from the 1 writers"):
                cb.resume_save(10, other, 3)
    assert list_checkpoints(root) == [3]


def test_a_save_superseded_on_another_replica_neither_reports_nor_commits(tmp_path):
    root = str(tmp_path / "ckpt")
    with replicas(root) as (a, b):
        with CheckpointClient(a) as ca, CheckpointClient(b) as cb:
            old = ca.begin_save(5, num_writers=1)
            writer = cb.writer(5, old, 0, 1)  # replica b adopts the old save
            writer.write(*box("w", 1.0))
            writer.finish()
            new = ca.begin_save(5, num_writers=1)  # a restarted trainer begins step 5 again on a
            with pytest.raises(CheckpointError, match="superseded"):
                cb.commit(5, old, 1, timeout=5)
            late = cb.writer(5, old, 0, 1)
            late.write(*box("w", 9.0))
            with pytest.raises(
                CheckpointError, match="superseded|ended|unknown|FAILED_PRECONDITION"
            ):
                late.finish()
            writer = cb.writer(5, new, 0, 1)  # replica b drops the old save and adopts the new
            writer.write(*box("w", 2.0))
            writer.finish()
            assert cb.commit(5, new, 1).step == 5
    assert read_manifest(root, 5)["save_id"] == new
    assert same_values(root, 5, "w", 2.0)


def same_values(root, step, name, value):
    from meshtrain.services.checkpoint.reader import read_box

    return torch.equal(read_box(root, step, name, (0,), (4,)), torch.full((4,), value))


def test_two_replicas_asked_to_commit_one_step(tmp_path):
    root = str(tmp_path / "ckpt")
    with replicas(root) as (a, b):
        with CheckpointClient(a) as ca, CheckpointClient(b) as cb:
            # one save, its commit asked of both replicas at once: one commit, both get its result
            save_id = ca.begin_save(6, num_writers=1)
            writer = ca.writer(6, save_id, 0, 1)
            writer.write(*box("w", 6.0))
            writer.finish()
            results = {}
            threads = [
                threading.Thread(
                    target=lambda c=c, k=k: results.__setitem__(k, c.commit(6, save_id, 1, {}))
                )
                for k, c in (("a", ca), ("b", cb))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert results["a"].url == results["b"].url and results["a"].step == 6
            assert read_manifest(root, 6)["save_id"] == save_id

            # two coordinators each began step 7 on their replica; both commit: the save that
            # still owns the folder commits, the other is refused, saying so
            first = ca.begin_save(7, num_writers=1)
            second = cb.begin_save(7, num_writers=1)
            for client, save, value in ((ca, first, 1.0), (cb, second, 2.0)):
                w = client.writer(7, save, 0, 1)
                w.write(*box("w", value))
                with contextlib.suppress(CheckpointError):  # the first save's fragment is refused
                    w.finish()
            outcomes = {}

            def commit(client, save):
                try:
                    outcomes[save] = client.commit(7, save, 1, {}, timeout=3)
                except CheckpointError as e:
                    outcomes[save] = e

            threads = [
                threading.Thread(target=commit, args=args) for args in ((ca, first), (cb, second))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert outcomes[second].step == 7
            assert isinstance(outcomes[first], CheckpointError)
    assert read_manifest(root, 7)["save_id"] == second and same_values(root, 7, "w", 2.0)


def test_abort_reaches_the_replica_whose_commit_waits(tmp_path):
    root = str(tmp_path / "ckpt")
    with replicas(root) as (a, b):
        with CheckpointClient(a) as ca, CheckpointClient(b) as cb, CheckpointClient([a, b]) as both:
            save_id = ca.begin_save(11, num_writers=2)
            writer = ca.writer(11, save_id, 0, 2)
            writer.write(*box("w", 1.0))
            writer.finish()  # writer 1 never reports
            outcome = []
            waiting = threading.Thread(
                target=lambda: outcome.append(
                    pytest.raises(CheckpointError, cb.commit, 11, save_id, 2, timeout=60)
                )
            )
            waiting.start()
            time.sleep(1.0)  # replica b has adopted the save and waits for writer 1
            assert both.abort_save(save_id, "the run failed", timeout=30) is True
            waiting.join(30)
            assert not waiting.is_alive() and "the run failed" in str(outcome[0].value)
    assert list_checkpoints(root) == []


def test_the_direct_data_plane(tmp_path):
    root = str(tmp_path / "ckpt")
    full, boxes = layered("w", seed=3, layers=4, rows=8, cols=16)
    with replicas(root) as addresses:
        with CheckpointClient(addresses, direct_root=root) as client:
            savers = [AsyncSaver(client, w, 2, commit_timeout=10) for w in range(2)]
            save_id = client.begin_save(8, num_writers=2)
            for w, saver in enumerate(savers):
                saver.save(
                    8,
                    save_id,
                    boxes[2 * w : 2 * w + 2],
                    committer=w == 0,
                    metadata={"direct": True},
                )
            savers[1].close()
            assert savers[0].wait().step == 8
            savers[0].close()
            assert read_manifest(root, 8)["metadata"] == {"direct": True} and same(
                root, 8, "w", full
            )
        with CheckpointClient(addresses, direct_root=str(tmp_path / "elsewhere")) as client:
            with pytest.raises(
                CheckpointError,
                match="writers of the direct data plane must write where it commits",
            ):
                client.begin_save(9)


@pytest.mark.e2e
def test_a_replica_killed_mid_save_is_replaced_and_the_save_commits(tmp_path):
    root = str(tmp_path / "ckpt")
    services = [Serve(root, tmp_path / f"replica{i}") for i in range(2)]
    for i, s in enumerate(services):
        os.makedirs(tmp_path / f"replica{i}")
        s.start()
    address = ",".join(s.address for s in services)
    writers = 4
    arrays = [layered(f"w{w}", seed=10 + w, layers=24) for w in range(writers)]
    clients = [CheckpointClient(address) for _ in range(writers)]  # one per rank, as in training
    go = threading.Event()
    try:
        save_id = clients[0].begin_save(2, num_writers=writers)
        # writers spread over both replicas; the one that commits the save is the one killed
        chosen = [clients[w].replicas.order(w)[0] for w in range(writers)]
        assert set(chosen) == {s.address for s in services}
        victim = next(s for s in services if s.address == clients[0].replicas.order(save_id)[0])
        its_writers = [w for w in range(writers) if chosen[w] == victim.address]
        # the victim's writers send half their boxes, then wait for the kill
        sinks = [PausingClient(c, 12, go) if w in its_writers else c for w, c in enumerate(clients)]
        savers = [
            AsyncSaver(s, w, writers, attempts=3, backoff=0.2, retry_timeout=20, commit_timeout=60)
            for w, s in enumerate(sinks)
        ]
        for w, saver in enumerate(savers):
            saver.save(2, save_id, arrays[w][1], committer=w == 0, metadata={"step": 2})
        stored = [os.path.join(root, "step_00000002", f"w{w}", "c") for w in its_writers]
        wait_for(
            "a box of the victim's writers stored", lambda: any(glob.glob(f"{d}/*") for d in stored)
        )
        victim.kill()
        assert sum(len(glob.glob(f"{d}/*")) for d in stored) < 24 * len(
            its_writers
        )  # it died mid-save
        go.set()
        assert list_checkpoints(root) == []
        for saver in savers[1:]:
            assert saver.wait() is None
        result = savers[0].wait()
        for saver in savers:
            saver.close()
    finally:
        go.set()
        for c in clients:
            c.close()
        for s in services:
            s.stop()
    assert result.step == 2 and list_checkpoints(root) == [2]
    manifest = read_manifest(root, 2)
    assert manifest["save_id"] == save_id and manifest["num_writers"] == writers
    for w, (full, _) in enumerate(arrays):
        assert same(root, 2, f"w{w}", full)
    log = json.dumps([open(p).read() for p in glob.glob(str(tmp_path / "replica*" / "*.log"))])
    assert "taken up from its marker" in log  # the surviving replica adopted the save
