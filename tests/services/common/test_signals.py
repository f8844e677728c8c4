"""relayed_signals: a signal's action runs on a relay thread,
so it may take locks and set events."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshtrain.services.common.signals import relayed_signals

ROOT = Path(__file__).resolve().parents[3]

# An action that holds a lock (as threading.Event.set holds its Condition's) when a second signal
# arrives. Run inside a signal handler, the second handler would start while the first holds the
# lock and wait for it forever: how a trainer rank hung when Slurm's and torchrun's SIGTERMs came
# milliseconds apart.
_NESTED = """
import os, signal, sys, threading, time
from meshtrain.services.common.signals import relayed_signals
lock, seen = threading.Lock(), []

def action(sig):
    with lock:
        seen.append(sig.name)
        if len(seen) == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # the second signal, while the lock is held
            time.sleep(0.2)

if sys.argv[1] == "in-handler":  # the old way, to show the test can fail
    signal.signal(signal.SIGUSR1, lambda s, f: action(signal.Signals(s)))
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.5)
else:
    with relayed_signals([signal.SIGUSR1], action):
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
print(seen, flush=True)
"""


def _run_nested(mode: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            [sys.executable, "-c", _NESTED, mode],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None


def test_a_signal_during_an_action_that_holds_a_lock_waits_for_it_instead_of_deadlocking():
    done = _run_nested("relayed")
    assert done is not None, "deadlocked"
    assert done.returncode == 0 and done.stdout.strip() == "['SIGUSR1', 'SIGUSR1']", done.stderr[
        -2000:
    ]


@pytest.mark.slow
def test_the_same_action_run_inside_the_handler_deadlocks():
    """The reproducer without the relay (30 s: it hangs until the timeout)."""
    assert _run_nested("in-handler") is None


def test_actions_run_in_order_off_the_main_thread_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    seen = []
    done = threading.Event()

    def action(sig):
        seen.append((sig, threading.current_thread().name))
        if len(seen) == 2:
            done.set()

    with relayed_signals([signal.SIGUSR1, signal.SIGUSR2], action, name="test-relay") as installed:
        assert installed
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert done.wait(10)
    assert seen == [(signal.SIGUSR2, "test-relay"), (signal.SIGUSR1, "test-relay")]
    assert signal.getsignal(signal.SIGUSR1) == before
    assert not any(t.name == "test-relay" for t in threading.enumerate())  # joined on exit


def test_a_failing_action_is_logged_and_later_signals_are_still_handled(caplog):
    seen = []

    def action(sig):
        seen.append(sig)
        if len(seen) == 1:
            raise RuntimeError("first one fails")

    with (
        caplog.at_level(logging.ERROR, logger="meshtrain.signals"),
        relayed_signals([signal.SIGUSR1], action),
    ):
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)
    # every signal that arrived is handled by the time the block has left
    assert seen == [signal.SIGUSR1, signal.SIGUSR1]
    assert "handling SIGUSR1 failed" in caplog.text and "first one fails" in caplog.text


def test_off_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGUSR1)
    got = []
    thread = threading.Thread(
        target=lambda: got.append(relayed_signals([signal.SIGUSR1], lambda s: None).__enter__())
    )
    thread.start()
    thread.join()
    assert got == [False] and signal.getsignal(signal.SIGUSR1) == before
