"""Stop and checkpoint requests: made from other threads, acted on by the training loop.

A stop comes from SIGTERM (preemption, `scancel --signal`, torchrun: checkpoint, then exit 0)
or the control endpoint (`meshtrain stop`); a checkpoint request from `meshtrain save`. Either
is a flag the loop reads between steps (`Trainer._agreed_requests` shares them across ranks).

SIGTERM is acted on by a relay thread, not inside the handler (`relayed_signals`: a handler
that sets an Event can deadlock the main thread). A rank still in its loop `STOP_STACK_DUMP_S`
after a stop writes every thread's stack to stderr (faulthandler's watchdog thread, whatever
the main thread holds), so a rank stuck on its way out says where before Slurm (120 s after
its signal) or torchrun (170 s, deploy/train.sh) kills it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
from collections.abc import Iterator

from services.common.signals import relayed_signals

STOP_STACK_DUMP_S = 90.0


class RunRequests:
    """The flags of one run's training loop: stop, checkpoint, and whether the loop has ended."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._checkpoint = threading.Event()
        self._ended = threading.Event()
        self.stop_cause: str | None = None  # "SIGTERM", "a stop request": what asked first
        self._dump_armed = False
        self._lock = threading.Lock()  # arming the dump (relay, control threads) vs the loop's end

    @property
    def ended(self) -> bool:
        """The loop has returned: nothing will act on a request any more."""
        return self._ended.is_set()

    def pending(self) -> tuple[bool, bool]:
        """(stop requested, checkpoint requested), not yet acted on."""
        return self._stop.is_set(), self._checkpoint.is_set()

    def stop(self, cause: str) -> None:
        """Ask for a checkpoint after the current step, then the end of the run; the first time,
        while the loop runs, remember `cause` and arm the stack dump."""
        with self._lock:
            if not self._stop.is_set() and not self._ended.is_set():
                self.stop_cause = cause
                try:
                    faulthandler.dump_traceback_later(STOP_STACK_DUMP_S, file=sys.stderr)
                    self._dump_armed = True
                except (AttributeError, ValueError, OSError):  # no stderr with a file descriptor (embedded)
                    pass
            self._stop.set()

    def checkpoint(self) -> None:
        """Ask for a checkpoint after the current step."""
        self._checkpoint.set()

    def checkpoint_started(self) -> None:
        """A save begins: it answers the checkpoint requests made so far (one made while it
        runs stays for the next step)."""
        self._checkpoint.clear()

    def end(self) -> None:
        """The loop has returned: requests are refused from now on, and the dump will not come."""
        with self._lock:
            self._ended.set()
            if self._dump_armed:
                faulthandler.cancel_dump_traceback_later()
                self._dump_armed = False

    @contextlib.contextmanager
    def sigterm_stops(self) -> Iterator[None]:
        """While inside (on the main thread), SIGTERM is a stop."""
        with relayed_signals([signal.SIGTERM], lambda s: self.stop(s.name), name="sigterm-relay"):
            yield
