"""`Topology` with real child processes: small Python scripts that behave like services.

Each script is a real process, so prefixes, exit statuses, signals, process groups and the
SIGKILL fallback are the kernel's, not simulated.
"""

import io
import math
import os
import signal
import sys
import threading
import time

import pytest

from meshtrain.services.launcher.health import wait_serving
from meshtrain.services.launcher.topology import (
    Child,
    ChildFailed,
    Topology,
    free_port,
    stop_on_signals,
)

# Real child processes signalled and waited for: end to end, out of `make test-fast`.
pytestmark = pytest.mark.e2e

# Prints a line, then waits; on SIGTERM prints "bye NAME" and exits 0 (like a service).
POLITE = """
import signal, sys, time
name = sys.argv[1]
print("hello", name, flush=True)
def bye(*_):
    print("bye", name, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
while True:
    time.sleep(0.05)
"""
# Ignores SIGTERM: only SIGKILL ends it.
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
while True:
    time.sleep(0.05)
"""


def py(code, *args):
    return [sys.executable, "-c", code, *args]


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_logs_are_prefixed_and_stop_runs_trainer_first():
    out = io.StringIO()
    topo = Topology(out)
    topo.start(Child("data-0", py(POLITE, "data-0")))
    topo.start(Child("ckpt", py(POLITE, "ckpt")))
    topo.start(Child("trainer", py(POLITE, "trainer"), role="trainer"))
    deadline = time.monotonic() + 30
    while sum("hello" in line for line in lines(out)) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    statuses = topo.shutdown()
    assert statuses == {"data-0": 0, "ckpt": 0, "trainer": 0}
    text = lines(out)
    assert "[data-0] hello data-0" in text and "[trainer] hello trainer" in text
    byes = [line for line in text if " bye " in line]
    # the trainer is told first and has finished before any service is told
    assert byes[0] == "[trainer] bye trainer"
    assert text.index("[trainer] bye trainer") < text.index("[up] stopping ckpt (SIGTERM)")
    # services stop in reverse start order
    assert text.index("[up] stopping ckpt (SIGTERM)") < text.index("[up] stopping data-0 (SIGTERM)")


def test_child_that_dies_stops_the_topology_with_its_name():
    out = io.StringIO()
    topo = Topology(out)
    topo.start(Child("ckpt", py("import sys, time; time.sleep(0.5); sys.exit(3)")))
    topo.start(Child("trainer", py(POLITE, "trainer"), role="trainer"))
    assert topo.supervise(threading.Event()) == 1
    assert topo.shutdown()["trainer"] == 0
    assert "[up] error: ckpt exited unexpectedly with status 3; stopping the topology" in lines(out)


def test_stateless_child_is_restarted_and_the_run_goes_on():
    out = io.StringIO()
    topo = Topology(out, max_restarts=1)
    topo.start(
        Child("data-0", py("import time; time.sleep(0.3); raise SystemExit(9)"), restart=True)
    )
    topo.start(Child("trainer", py("import time; time.sleep(2)"), role="trainer"))
    # restarted once; it dies again after its one restart is spent, before the trainer ends
    assert topo.supervise(threading.Event()) == 1
    topo.shutdown()
    text = "\n".join(lines(out))
    assert "data-0 exited with status 9; restarting it (1/1)" in text
    assert (
        "error: data-0 exited unexpectedly with status 9 after 1 restart in the last 600 s" in text
    )


def test_restarts_are_limited_per_window_not_per_run():
    # The limit counted every restart of the run: a data worker that died six times over a long
    # run (reproduced with `meshtrain up`: SIGKILLed six times, each restart serving and the
    # trainer training on) stopped the whole topology at its sixth death. Only restarts within
    # `restart_window_s` count now; this child dies 0.3 s after each start, later than the window.
    out = io.StringIO()
    topo = Topology(out, max_restarts=1, restart_window_s=0.2)
    topo.start(
        Child("data-0", py("import time; time.sleep(0.3); raise SystemExit(9)"), restart=True)
    )
    topo.start(Child("trainer", py("import time; time.sleep(2)"), role="trainer"))
    assert topo.supervise(threading.Event()) == 0
    topo.shutdown()
    text = "\n".join(lines(out))
    assert text.count("data-0 exited with status 9; restarting it (1/1)") >= 3
    assert "error" not in text


def test_trainer_finishing_ends_supervision_with_zero():
    topo = Topology(io.StringIO())
    topo.start(Child("data-0", py(POLITE, "data-0")))
    topo.start(Child("trainer-0", py("print('done')"), role="trainer"))
    topo.start(Child("trainer-1", py("import time; time.sleep(0.5)"), role="trainer"))
    assert topo.supervise(threading.Event()) == 0
    assert topo.shutdown() == {"data-0": 0, "trainer-0": 0, "trainer-1": 0}


def test_sigkill_after_the_grace_period():
    out = io.StringIO()
    topo = Topology(out)
    topo.start(Child("stubborn", py(STUBBORN), grace_s=1.0))
    deadline = time.monotonic() + 30
    while "[stubborn] ignoring SIGTERM" not in lines(out):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    start = time.monotonic()
    assert topo.shutdown() == {"stubborn": -signal.SIGKILL}
    assert 0.9 < time.monotonic() - start < 10
    assert "[up] stubborn still running after 1 s: SIGKILL" in lines(out)


def test_a_rank_that_fails_while_stopping_cuts_the_others_grace_short():
    # No deadline for a stop (a long final checkpoint must not be SIGKILLed), yet a rank whose
    # peer has died may hang in a collective for good: it gets failure_grace_s only.
    out = io.StringIO()
    topo = Topology(out, failure_grace_s=1.0)
    topo.start(Child("trainer-0", py(STUBBORN), role="trainer", grace_s=math.inf))
    topo.start(
        Child(
            "trainer-1",
            py(POLITE.replace("sys.exit(0)", "sys.exit(3)"), "trainer-1"),
            role="trainer",
            grace_s=math.inf,
        )
    )
    deadline = time.monotonic() + 30
    while "[trainer-0] ignoring SIGTERM" not in lines(
        out
    ) or "[trainer-1] hello trainer-1" not in lines(out):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    start = time.monotonic()
    assert topo.shutdown() == {"trainer-0": -signal.SIGKILL, "trainer-1": 3}
    assert time.monotonic() - start < 10
    assert topo.failed.name == "trainer-1"
    assert (
        "[up] trainer-1 exited with status 3; giving trainer-0 1 s to exit before SIGKILL"
        in lines(out)
    )
    assert "[up] trainer-0 still running 1 s after trainer-1 failed: SIGKILL" in lines(out)


def test_without_a_failure_a_stop_waits_past_the_failure_grace():
    out = io.StringIO()
    topo = Topology(out, failure_grace_s=0.5)
    slow = POLITE.replace('print("bye", name, flush=True)', "time.sleep(2)")  # a final checkpoint
    topo.start(Child("trainer-0", py(slow, "trainer-0"), role="trainer", grace_s=math.inf))
    topo.start(Child("trainer-1", py(slow, "trainer-1"), role="trainer", grace_s=math.inf))
    deadline = time.monotonic() + 30
    while sum(" hello " in line for line in lines(out)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert topo.shutdown() == {"trainer-0": 0, "trainer-1": 0}


def test_health_wait_names_a_child_that_exits_or_never_serves():
    topo = Topology(io.StringIO())
    with pytest.raises(
        ChildFailed, match=r"broken exited with status 2 before serving on 127\.0\.0\.1:1"
    ):
        topo.start(Child("broken", py("raise SystemExit(2)"), port=1), wait_serving(30))
    with pytest.raises(ChildFailed, match=r"silent was not serving on 127\.0\.0\.1:1 within 1 s"):
        topo.start(Child("silent", py(POLITE, "silent"), port=1), wait_serving(1))
    topo.shutdown()


def test_free_port_never_hands_out_a_port_twice():
    # A plan picks every port before any child binds one: a repeat would give two children
    # the same port (seen in CI: data-1 could not bind while data-0 answered in its place).
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 32000 for p in ports)


def test_a_child_that_exits_while_another_process_answers_on_its_port_is_named(tmp_path):
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    topo = Topology(io.StringIO())
    try:
        with pytest.raises(
            ChildFailed,
            match=rf"late exited with status 2, yet something is serving on "
            rf"127\.0\.0\.1:{port}: another process holds its port",
        ):
            # exits before the first check could see it running
            topo.start(
                Child("late", py("raise SystemExit(2)"), port=port),
                lambda child: (child.process.wait(), wait_serving(10)(child)),
            )
    finally:
        topo.shutdown()
        server.stop(0)


def test_children_get_sigterm_when_the_launcher_dies(tmp_path):
    # `up` SIGKILLed (or its terminal closed) must not leave its services running.
    import os
    import subprocess

    script = tmp_path / "launcher.py"
    script.write_text(
        "import sys, time\n"
        "from meshtrain.services.launcher.topology import Child, Topology\n"
        "topo = Topology()\n"
        "child = topo.start(Child('sleeper', [sys.executable, '-c', "
        "'import time; time.sleep(300)']))\n"
        "print('child', child.process.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[3]),
    )
    try:
        line = ""
        while not line.startswith("child"):
            line = launcher.stdout.readline()
        pid = int(line.split()[1])
        os.kill(pid, 0)  # running
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the child outlived its launcher")
    finally:
        launcher.kill()


def test_urgent_stop_skips_the_grace_period():
    topo = Topology(io.StringIO())
    topo.start(Child("stubborn", py(STUBBORN), grace_s=60))
    time.sleep(0.5)
    threading.Timer(0.5, topo.urgent.set).start()  # a second Ctrl-C
    t0 = time.monotonic()
    statuses = topo.shutdown()
    assert time.monotonic() - t0 < 10 and statuses["stubborn"] == -signal.SIGKILL


def test_a_stop_while_waiting_for_a_child_to_serve_ends_the_wait():
    from meshtrain.services.launcher.topology import StopRequested

    topo = Topology(io.StringIO())
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(StopRequested, match="silent"):
        topo.start(Child("silent", py(POLITE, "silent"), port=1), wait_serving(60, stop))
    assert time.monotonic() - t0 < 10
    topo.shutdown()


def test_a_signal_while_the_main_thread_is_mid_write_is_reported_once_the_write_is_done():
    """The signal's action runs on a relay thread, which waits for the output lock like any
    writer: no deadlock (a handler on the main thread would wait for itself), no lost line."""
    out = io.StringIO()
    topo = Topology(out)
    stop = threading.Event()
    with stop_on_signals(topo, stop, "stopping"):
        with topo._out_lock:  # the main thread is mid-write when the signal arrives
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            assert lines(out) == []
        assert stop.wait(10)
        os.kill(os.getpid(), signal.SIGINT)
        assert topo.urgent.wait(10)
    assert lines(out) == [
        "[up] received SIGTERM: stopping",
        "[up] received SIGINT again: stopping now (SIGKILL, no checkpoint)",
    ]


def test_a_broken_output_does_not_stop_the_log_pumps():
    class Broken(io.StringIO):
        def write(self, text):
            raise BrokenPipeError("reader gone")

    topo = Topology(Broken())
    # 200 kB of output: more than a pipe holds, so a child whose pump died would block on it
    child = topo.start(Child("chatty", py("import sys; [print('x' * 1000) for _ in range(200)]")))
    assert child.process.wait(timeout=30) == 0
    topo.shutdown()
