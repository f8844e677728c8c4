"""A checkpoint service SIGKILLed mid-save and started again on its port and root, as
`meshtrain up` does: the save in flight is resumed there by every writer and commits, bit-exact;
the previous checkpoint stays loadable and nothing partial is listed meanwhile. A service that
never comes back fails the save within the retry time, naming its address and what was done.

The service is a real `meshtrain ckpt serve` process; the kill is timed by what it has stored
(a writer's first box object, a writer's fragment), and the stream cut by it is held half sent
until the kill (`Paused`), so it lands inside the save every time, however fast the service.
"""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from meshtrain.services.checkpoint.async_save import AsyncSaver
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.multiwriter import fragment_path
from meshtrain.services.checkpoint.reader import list_checkpoints, read_box
from meshtrain.services.checkpoint.rpc.client import (
    CheckpointClient,
    RemoteWriter,
    ServiceUnavailableError,
)
from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.common.errors import CheckpointError
from tests.services.checkpoint.s3server import free_port

RETRY_S = 20.0  # the savers' retry time: well above a restart here (~2 s start + 1.5 s down)


class Serve:
    """`meshtrain ckpt serve ROOT --port PORT`, startable again on the same port and root."""

    def __init__(self, root: str, log_dir):
        self.root, self.port, self.log_dir = root, free_port(), log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        log = self.log_dir / f"serve-{self.starts}.log"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshtrain.services.cli",
                    "ckpt",
                    "serve",
                    self.root,
                    "--port",
                    str(self.port),
                    "--grace",
                    "1",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while f"listening on {self.address}" not in log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def serve(tmp_path):
    service = Serve(str(tmp_path / "ckpt"), tmp_path)
    service.start()
    try:
        yield service
    finally:
        service.stop()


class Paused(RemoteWriter):
    """A writer whose first WriteShards stream stops after `at` boxes until `go` is set: the test
    kills the service (or replica) with part of the writer's boxes stored and the rest still to
    come, however fast the service stores them. A retried stream runs straight through."""

    def __init__(
        self,
        client: CheckpointClient,
        save_id: str,
        writer_id: int,
        step: int,
        at: int,
        go: threading.Event,
    ):
        super().__init__(client, save_id, writer_id, step)
        self.at, self.go, self.streams = at, go, 0

    def _messages(self, error):
        self.streams += 1
        boxes = 0
        for message in super()._messages(error):
            if message.HasField("box"):
                if boxes == self.at and self.streams == 1:
                    self.go.wait()
                boxes += 1
            yield message


class PausingClient:
    """A checkpoint client whose writers are `Paused` ones."""

    def __init__(self, client: CheckpointClient, at: int, go: threading.Event):
        self.client, self.at, self.go = client, at, go

    def __getattr__(self, name):
        return getattr(self.client, name)

    def writer(self, step: int, save_id: str, writer_id: int, num_writers: int) -> Paused:
        return Paused(self.client, save_id, writer_id, step, self.at, self.go)


@contextlib.contextmanager
def saver(
    service: Serve,
    writer_id: int = 0,
    num_writers: int = 1,
    retry_timeout: float = RETRY_S,
    pause_at: int | None = None,
    go: threading.Event | None = None,
):
    """A client and saver of `service`; with `pause_at`, the saver's first stream stops after
    that many boxes until `go` is set (set on the way out, so the upload thread ends)."""
    with CheckpointClient(service.address) as client:
        sink = client if pause_at is None else PausingClient(client, pause_at, go)
        s = AsyncSaver(
            sink, writer_id, num_writers, attempts=3, backoff=0.2, retry_timeout=retry_timeout
        )
        try:
            yield client, s
        finally:
            if go is not None:
                go.set()
            s._pool.shutdown(wait=True)


def layered(name: str, seed: int, layers: int, rows: int = 512, cols: int = 1024):
    """A bf16 array of `layers` boxes of rows x cols (1 MiB each at the defaults),
    one box per layer."""
    full = torch.randn(layers, rows, cols, generator=torch.Generator().manual_seed(seed)).to(
        torch.bfloat16
    )
    return full, [
        (
            ShardSpec(name, tuple(full.shape), "bfloat16", (i, 0, 0), (1, rows, cols)),
            full[i : i + 1],
        )
        for i in range(layers)
    ]


def same(root: str, step: int, name: str, full: torch.Tensor) -> bool:
    got = read_box(root, step, name, (0,) * full.dim(), tuple(full.shape))
    return torch.equal(got.view(torch.int16), full.view(torch.int16))


def wait_for(what: str, found, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not found():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def committed_step_one(service: Serve):
    """Step 1, committed through the service before the save under test."""
    full, boxes = layered("w", seed=1, layers=2, rows=8, cols=8)
    with saver(service) as (client, s):
        s.save(1, client.begin_save(1), boxes, committer=True, metadata={"step": 1})
        s.wait()
    return full


@pytest.mark.e2e
def test_a_save_cut_by_a_service_restart_is_resumed_and_commits(serve, tmp_path):
    root = serve.root
    before = committed_step_one(serve)
    full, boxes = layered("w", seed=2, layers=64)
    stored = os.path.join(root, "step_00000002", "w", "c")
    go = threading.Event()
    with saver(serve, pause_at=32, go=go) as (client, s):
        save_id = client.begin_save(2)
        s.save(2, save_id, boxes, committer=True, metadata={"step": 2})
        wait_for("the first box stored", lambda: glob.glob(f"{stored}/*"))
        serve.kill()
        # the kill landed inside the writer's stream: its fragment was never stored
        assert not os.path.exists(fragment_path(open_root(root), 2, save_id, 0))
        assert len(glob.glob(f"{stored}/*")) < len(boxes)
        assert list_checkpoints(root) == [1] and same(
            root, 1, "w", before
        )  # nothing partial listed
        go.set()
        time.sleep(1.5)
        serve.start()
        result = s.wait()
    assert result.step == 2
    assert list_checkpoints(root) == [1, 2]
    assert same(root, 1, "w", before) and same(root, 2, "w", full)
    assert not os.path.exists(
        os.path.join(root, "step_00000002", "_fragments")
    )  # the commit tidied up


@pytest.mark.e2e
def test_two_writers_resume_a_save_cut_by_a_service_restart(serve, tmp_path):
    """Writer 0 (the committer) has stored its fragment and waits in Commit for writer 1, which
    is inside its stream, when the service dies: after the restart writer 1 resends its boxes,
    writer 0 commits again, and writer 0's fragment stored before the kill counts."""
    root = serve.root
    before = committed_step_one(serve)
    small, small_boxes = layered("small", seed=3, layers=2, rows=8, cols=8)
    big, big_boxes = layered("big", seed=4, layers=48)
    go = threading.Event()
    with saver(serve, 0, 2) as (client0, s0), saver(serve, 1, 2, pause_at=24, go=go) as (_, s1):
        save_id = client0.begin_save(2, num_writers=2)
        s0.save(2, save_id, small_boxes, committer=True, metadata={"step": 2})
        wait_for(
            "writer 0's fragment",
            lambda: os.path.exists(fragment_path(open_root(root), 2, save_id, 0)),
        )
        s1.save(2, save_id, big_boxes)
        wait_for(
            "writer 1's first box",
            lambda: glob.glob(os.path.join(root, "step_00000002", "big", "c", "*")),
        )
        serve.kill()
        assert not os.path.exists(
            fragment_path(open_root(root), 2, save_id, 1)
        )  # writer 1 was cut off
        assert list_checkpoints(root) == [1] and same(root, 1, "w", before)
        go.set()
        time.sleep(1.5)
        serve.start()
        assert s1.wait() is None
        assert s0.wait().step == 2
    assert list_checkpoints(root) == [1, 2]
    assert (
        same(root, 1, "w", before) and same(root, 2, "small", small) and same(root, 2, "big", big)
    )


@pytest.mark.e2e
def test_a_service_that_never_comes_back_fails_the_save_within_the_retry_time(serve, tmp_path):
    root = serve.root
    before = committed_step_one(serve)
    _, boxes = layered("w", seed=2, layers=64)
    go = threading.Event()
    with saver(serve, retry_timeout=3.0, pause_at=32, go=go) as (client, s):
        s.save(2, client.begin_save(2), boxes, committer=True)
        wait_for(
            "the first box stored",
            lambda: glob.glob(os.path.join(root, "step_00000002", "w", "c", "*")),
        )
        start = time.monotonic()
        serve.kill()
        go.set()
        with pytest.raises(CheckpointError) as e:
            s.wait()
        took = time.monotonic() - start
    assert 3.0 <= took < 8.0, took
    message = str(e.value)
    assert f"checkpoint service {serve.address}" in message and "UNAVAILABLE" in message, message
    assert "storing the fragment of writer 0 (step 2) failed after" in message, message
    assert list_checkpoints(root) == [1] and same(root, 1, "w", before)


def test_resume_takes_up_only_the_save_that_owns_the_step(tmp_path):
    """ResumeSave on a service that restarted (in-process, same root): the first writer's call
    takes the save up, a second is a no-op, a committed save is answered as such, and a save
    superseded by a newer BeginSave of its step, or unknown to the root, is refused."""
    from tests.services.checkpoint.rpc_helpers import running_service, written_save

    root = str(tmp_path / "ckpt")
    with running_service(root) as (client, _):
        open_id = written_save(client, 3)  # writer 0 of 1 finished; never committed
        done_id = written_save(client, 4)
        client.commit(4, done_id, 1)
        old_id = written_save(client, 5)
    with running_service(root) as (client, _):  # restarted: every id forgotten
        assert client.resume_save(3, open_id, 1) is False
        assert client.resume_save(3, open_id, 1) is False  # the second writer's call
        assert (
            client.commit(3, open_id, 1).step == 3
        )  # the fragment stored before the restart counts
        assert client.resume_save(4, done_id, 1) is True
        client.begin_save(5)  # a newer save of step 5 clears the old one's folder
        with pytest.raises(
            CheckpointError, match=f"save {old_id} of step 5 cannot be resumed: .* has begun since"
        ):
            client.resume_save(5, old_id, 1)
    with running_service(root) as (client, _):
        with pytest.raises(
            CheckpointError,
            match=f"save {old_id} of step 5 cannot be resumed: .*begun.json is gone",
        ):
            client.resume_save(5, old_id, 1)
        with pytest.raises(CheckpointError, match="step 4 .* was committed by another save"):
            client.resume_save(4, "0123abcd", 1)
    assert list_checkpoints(root) == [3, 4]


class LosesItsFirstReply:
    """A writer's client whose first fragment is stored but whose reply is lost: `lost()` runs
    (the service restarts meanwhile), then the writer sees what a dead stream gives it."""

    def __init__(self, client: CheckpointClient, lost):
        self.client, self.lost, self.was_lost = client, lost, False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def writer(self, step, save_id, writer_id, num_writers):
        real, outer = self.client.writer(step, save_id, writer_id, num_writers), self

        class Writer:
            def write(self, spec, data):
                return real.write(spec, data)

            def finish(self, error=None):
                real.finish(error)
                if error is None and not outer.was_lost:
                    outer.was_lost = True
                    outer.lost()
                    raise ServiceUnavailableError(
                        f"checkpoint service {outer.client.address} WriteShards "
                        f"(writer {writer_id}): UNAVAILABLE: Stream removed"
                    )

        return Writer()


@pytest.mark.e2e
def test_a_writer_whose_reply_was_lost_to_a_restart_after_the_commit_has_nothing_to_do(
    serve, tmp_path, caplog
):
    """Writer 1 stored its fragment, writer 0 committed, and the service died before writer 1's
    reply reached it: writer 1's retry meets a service that forgot the save, resumes it, learns
    it committed, and is done; nothing is sent or committed again."""
    root = serve.root
    small, small_boxes = layered("small", seed=3, layers=2, rows=8, cols=8)
    big, big_boxes = layered("big", seed=4, layers=2, rows=8, cols=8)

    def restart_after_the_commit():
        wait_for("writer 0's commit", lambda: list_checkpoints(root) == [2])
        serve.kill()
        serve.start()

    manifest = os.path.join(root, "step_00000002", "manifest.json")
    with saver(serve, 0, 2) as (client0, s0), CheckpointClient(serve.address) as client1:
        s1 = AsyncSaver(
            LosesItsFirstReply(client1, restart_after_the_commit),
            1,
            2,
            attempts=3,
            backoff=0.2,
            retry_timeout=RETRY_S,
        )
        try:
            save_id = client0.begin_save(2, num_writers=2)
            s0.save(2, save_id, small_boxes, committer=True, metadata={"step": 2})
            s1.save(2, save_id, big_boxes)
            assert s0.wait().step == 2
            committed_at = os.stat(manifest).st_mtime_ns
            assert s1.wait() is None
        finally:
            s1._pool.shutdown(wait=True)
    assert s1.sink.was_lost and serve.starts == 2
    assert f"resuming save {save_id} there" in caplog.text  # the retry met the forgetful service
    assert (
        list_checkpoints(root) == [2] and os.stat(manifest).st_mtime_ns == committed_at
    )  # not committed again
    assert same(root, 2, "small", small) and same(root, 2, "big", big)
