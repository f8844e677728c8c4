"""A process graph on one machine: start children in order, prefix their logs, stop them cleanly.

`Topology` runs named child processes (data workers, the checkpoint service, trainer ranks)
with their output merged into ours, each line prefixed with the child's name (`[data-0] ...`).
A child is started only after the ones before it are healthy (`health.wait_serving`). Stopping
goes in reverse: trainer ranks first (SIGTERM makes them checkpoint after the current step and
exit 0), then the services; whatever outlives its grace period is SIGKILLed. A trainer rank
that fails leaves the other ranks a short grace only: they may hang in a collective without it.
`supervise()` returns when the trainer has finished, when a stop was requested, or when a child
died on its own — except children marked `restart`, servers whose state lives elsewhere (data
workers; the checkpoint service, whose checkpoints are in storage) that are started again on the
same port while clients fail over to their peers or retry. `stop_on_signals` turns
SIGINT/SIGTERM/SIGHUP into that stop request.

    topo = Topology()
    topo.start(Child("data-0", [...], port=7001))
    code = topo.supervise(stop_event)   # then topo.shutdown()
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from meshtrain.services.common.errors import MeshtrainError
from meshtrain.services.common.signals import relayed_signals

log = logging.getLogger("meshtrain.launcher")


_issued_ports: set[int] = set()
_issued_lock = threading.Lock()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below Linux's ephemeral range (32768+), and never one
    this process has handed out before.

    A child that dies is restarted on its own port (its clients know that address); had the
    port come from the ephemeral range, an outgoing connection could take it in between and
    the restart would fail to bind. Ports are chosen before the children that will bind them
    start, so a bind test alone could give two children of one plan the same port: the
    second would fail to bind while the first answered its health check in its place.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with _issued_lock:
            if port in _issued_ports:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _issued_ports.add(port)
        return port
    raise ChildFailed("no free loopback port in [20000, 32000)")


class ChildFailed(MeshtrainError):
    """A child exited when it should not have, or never became healthy."""


class StopRequested(MeshtrainError):
    """A stop was requested while waiting for a child to become ready."""


# Run as the child's first program: ask the kernel to send this process a signal when the
# launcher dies (SIGKILL, SIGHUP of a closed terminal, a crash), then exec the real command. The
# setting survives exec; a launcher that died before it took effect is caught by the getppid
# check.
_PDEATHSIG = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, int(sys.argv[2]))\n"  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or sys.exit('launcher gone before start')\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def dies_with_us(argv: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """`argv` wrapped so that the kernel sends the child `sig` if this process dies (Linux; the
    command as it is elsewhere). The parent is the thread that starts it: start it from one
    that lives as long as the process (the main thread)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _PDEATHSIG, str(os.getpid()), str(int(sig)), *argv]


@dataclass
class Child:
    """One process of the topology.

    Attributes:
        name: log prefix and the name in messages ("data-0", "trainer-1").
        argv: the command.
        env: extra environment variables (added to ours).
        port: the gRPC port it serves, health-checked after start (None: not a server).
        role: "trainer", "service" or "store"; trainers stop first and their finishing ends
            the run, the object store (which services write to) stops last.
        restart: start it again (same argv, same port) when it dies on its own.
        grace_s: seconds between SIGTERM and SIGKILL when stopping it (`math.inf`: no SIGKILL).
        inherit_output: write to our stdout and stderr as they are, instead of through
            prefixed log lines on `Topology.out`.
    """

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int | None = None
    role: str = "service"
    restart: bool = False
    grace_s: float = 10.0
    inherit_output: bool = False
    process: subprocess.Popen | None = field(default=None, repr=False)
    restarts: int = 0
    restarted_at: list[float] = field(default_factory=list)  # monotonic times of recent restarts
    stopping: bool = False

    @property
    def proc(self) -> subprocess.Popen:
        """The process of a child that `Topology` started."""
        assert self.process is not None, f"{self.name} was never started"
        return self.process


class Topology:
    """Starts, watches and stops a set of `Child` processes.

    Args:
        out: where prefixed log lines go.
        max_restarts: how often one `restart` child may be restarted within `restart_window_s`;
            one more death within it stops the run (a crash loop, not bad luck over a long run).
        restart_window_s: seconds over which restarts are counted.
        label: the prefix of the launcher's own lines (`[up] ...`).
        failure_grace_s: once a trainer rank has failed, seconds the other ranks get after
            SIGTERM before SIGKILL (at most; less if their own grace is shorter).
    """

    def __init__(
        self,
        out: TextIO | None = None,
        max_restarts: int = 5,
        label: str = "up",
        failure_grace_s: float = 15.0,
        restart_window_s: float = 600.0,
    ):
        self.out = out or sys.stdout
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.label = label
        self.failure_grace_s = failure_grace_s
        self.children: list[Child] = []
        self.urgent = threading.Event()  # set (a second Ctrl-C): shutdown skips grace periods
        self.failed: Child | None = None  # the first child seen to die on its own
        self._out_lock = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self._pump_of: dict[str, threading.Thread] = {}  # each child's current log pump

    def say(self, line: str) -> None:
        """A line of the launcher's own, prefixed `[up]` (the label)."""
        self._write(self.label, line)

    def _write(self, name: str, line: str) -> None:
        with self._out_lock:
            try:
                self.out.write(f"[{name}] {line}\n")
                self.out.flush()
            except (OSError, ValueError, UnicodeError):
                # Our output is gone (a closed pipe, a strict encoding): drop the line rather than
                # end the log pump, whose child would block once its pipe filled.
                pass

    def start(self, child: Child, wait: Callable[[Child], None] | None = None) -> Child:
        """Start `child` and, if given, block in `wait(child)` until it is ready.

        Args:
            child: what to run.
            wait: readiness check; raises `ChildFailed` when the child will not be ready.

        Returns:
            The child, running.
        """
        env = {**os.environ, **child.env, "PYTHONUNBUFFERED": "1"}
        piped: dict[str, Any] = (
            {} if child.inherit_output else {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        )
        # Own session: a terminal's Ctrl-C reaches only us, and we stop children in order.
        child.process = subprocess.Popen(
            dies_with_us(child.argv),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **piped,
        )
        if not child.inherit_output:
            pump = threading.Thread(
                target=self._pump,
                args=(child.name, child.proc.stdout),
                name=f"log-{child.name}",
                daemon=True,
            )
            pump.start()
            self._pumps.append(pump)
            self._pump_of[child.name] = pump
        if child not in self.children:
            self.children.append(child)
        self.say(
            f"started {child.name} (pid {child.proc.pid})"
            + (f" on 127.0.0.1:{child.port}" if child.port else "")
        )
        if wait is not None:
            wait(child)
        return child

    def _pump(self, name: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            self._write(name, raw.decode("utf-8", "replace").rstrip("\n"))
        stream.close()

    def supervise(
        self,
        stop: threading.Event,
        restart_wait: Callable[[Child], None] | None = None,
        poll_s: float = 0.2,
    ) -> int:
        """Watch the children until the trainer finishes, `stop` is set, or one dies on its own.

        Args:
            stop: set (e.g. by a signal handler) to end the run.
            restart_wait: readiness check for restarted children.
            poll_s: seconds between checks.

        Returns:
            The exit status for the run: 0 when the trainer ranks all finished with 0 or a stop
            was requested, 1 when a child died unexpectedly (after printing why).
        """
        trainers = [c for c in self.children if c.role == "trainer"]
        while not stop.wait(poll_s):
            for child in self.children:
                code = child.proc.poll()
                if code is None or child.stopping:
                    continue
                if child.role == "trainer" and code == 0:
                    continue  # finished; the others follow
                if child.restart and self._restart(child, code, restart_wait):
                    continue
                self.failed = child
                recent = len(child.restarted_at) if child.restart else 0
                again = (
                    f" after {recent} restart{'s' * (recent != 1)} in the last "
                    f"{self.restart_window_s:.0f} s"
                    if recent
                    else ""
                )
                self.say(
                    f"error: {child.name} exited unexpectedly with status "
                    f"{_describe(code)}{again}; stopping the topology"
                )
                return 1
            if trainers and all(c.proc.poll() == 0 for c in trainers):
                self.say("trainer finished")
                return 0
        return 0

    def _restart(self, child: Child, code: int, wait) -> bool:
        now = time.monotonic()
        child.restarted_at = [t for t in child.restarted_at if now - t < self.restart_window_s]
        if len(child.restarted_at) >= self.max_restarts:
            return False
        child.restarted_at.append(now)
        child.restarts += 1
        self.say(
            f"{child.name} exited with status {_describe(code)}; restarting it "
            f"({len(child.restarted_at)}/{self.max_restarts}); its clients retry or fail over "
            "meanwhile"
        )
        try:
            self.start(child, wait)
        except ChildFailed as e:
            self.say(f"error: {e}")
            return False
        return True

    def shutdown(self, trainer_grace_s: float | None = None) -> dict[str, int | None]:
        """Stop everything: trainer ranks first (they checkpoint on SIGTERM), then services in
        reverse start order; SIGKILL whatever outlives its grace period.

        Args:
            trainer_grace_s: overrides the trainers' own `grace_s`.

        Returns:
            Each child's exit status (negative: killed by that signal).
        """
        trainers = [c for c in self.children if c.role == "trainer"]
        services = [c for c in reversed(self.children) if c.role == "service"]
        stores = [c for c in reversed(self.children) if c.role == "store"]
        for group in (trainers, services, stores):
            for c in group:
                c.stopping = True
                if c.proc.poll() is None:
                    self.say(f"stopping {c.name} (SIGTERM)")
                    _signal(c.proc, signal.SIGTERM)
            self._wait_out(group, trainer_grace_s)
            # a group's last lines are logged before the next group is told to stop, so the
            # log reads in the order things happened
            for c in group:
                if (pump := self._pump_of.get(c.name)) is not None:
                    pump.join(timeout=2)
        for pump in self._pumps:
            pump.join(timeout=2)
        return {c.name: c.proc.returncode for c in self.children}

    def _wait_out(self, group: list[Child], trainer_grace_s: float | None) -> None:
        """Wait for the SIGTERMed `group` all at once, SIGKILLing each child whose grace runs out
        (every one at once when `urgent`). A trainer rank that fails (exits non-zero) meanwhile or
        before cuts the others' grace to `failure_grace_s`: no collective, the final checkpoint's
        included, can finish without it, and they may hang in one."""
        now = time.monotonic()
        deadline, why = {}, {}
        for c in group:
            grace = (
                trainer_grace_s
                if (c.role == "trainer" and trainer_grace_s is not None)
                else c.grace_s
            )
            deadline[c.name], why[c.name] = now + grace, f"still running after {grace:.0f} s"
        cut = False
        while running := [c for c in group if c.proc.poll() is None]:
            now = time.monotonic()
            failed = next((c for c in group if c.role == "trainer" and c.proc.returncode), None)
            if failed is not None and not cut:
                cut = True
                self.failed = self.failed or failed
                limit = now + self.failure_grace_s
                cut_short = [c for c in running if c.role == "trainer" and deadline[c.name] > limit]
                for c in cut_short:
                    deadline[c.name] = limit
                    why[c.name] = (
                        f"still running {self.failure_grace_s:.0f} s after {failed.name} failed"
                    )
                if cut_short:
                    self.say(
                        f"{failed.name} exited with status {_describe(failed.proc.returncode)}; "
                        f"giving {', '.join(c.name for c in cut_short)} {self.failure_grace_s:.0f} "
                        "s to exit before SIGKILL"
                    )
            for c in running:
                if self.urgent.is_set() or now >= deadline[c.name]:
                    self.say(
                        f"{c.name} {'stopping now' if self.urgent.is_set() else why[c.name]}: "
                        "SIGKILL"
                    )
                    _signal(c.proc, signal.SIGKILL)
                    c.proc.wait()
            self.urgent.wait(0.2)


def _signal(process: subprocess.Popen, sig: int) -> None:
    # The whole process group: a child's own children (torch's compile workers, weed's
    # subprocesses) go with it.
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


@contextlib.contextmanager
def stop_on_signals(topo: Topology, stop: threading.Event, first: str) -> Iterator[None]:
    """While inside: the first SIGINT, SIGTERM or SIGHUP sets `stop`, any later one `topo.urgent`
    (stop at once: SIGKILL, no checkpoint), each with a line saying so. SIGHUP too: the terminal
    closed, and the children must not outlive us either way. Signals are handled on the main
    thread only; elsewhere (tests) this does nothing and `stop` is set by the caller.

    Args:
        topo: the topology to stop.
        stop: the event the run watches.
        first: what the first signal does, for its line ("stopping (trainer first, ...)").
    """

    def on_signal(
        sig: signal.Signals,
    ) -> None:  # on the relay thread: it may wait for the output lock
        if stop.is_set():
            topo.urgent.set()
            topo.say(f"received {sig.name} again: stopping now (SIGKILL, no checkpoint)")
        else:
            stop.set()
            topo.say(f"received {sig.name}: {first}")

    with relayed_signals(
        (signal.SIGINT, signal.SIGTERM, signal.SIGHUP), on_signal, name="launcher-signals"
    ):
        yield


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    what: str,
    child: Child,
    poll_s: float = 0.2,
    stop: threading.Event | None = None,
) -> None:
    """Poll `predicate` until true; fail if `child` exits first or `timeout_s` passes.

    Raises:
        ChildFailed: naming `child` and what it was not (`what`: "serving on HOST:PORT").
        StopRequested: `stop` was set meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if stop is not None and stop.is_set():
            raise StopRequested(f"stop requested while waiting for {child.name} to be {what}")
        code = child.proc.poll()
        if code is not None:
            raise ChildFailed(f"{child.name} exited with status {_describe(code)} before {what}")
        if time.monotonic() > deadline:
            raise ChildFailed(f"{child.name} was not {what} within {timeout_s:.0f} s")
        time.sleep(poll_s)
    code = child.proc.poll()
    if code is not None:  # something else answered in its place (e.g. its port was taken)
        raise ChildFailed(
            f"{child.name} exited with status {_describe(code)}, yet something is {what}: "
            "another process holds its port"
        )
