"""Stop and checkpoint requests: made from other threads, acted on by the training loop.

A stop comes from SIGTERM (preemption, `scancel --signal`, torchrun: checkpoint, then exit 0)
or the control endpoint (`meshtrain stop`); a checkpoint request from `meshtrain save`. Either
is a flag the loop reads between steps (`agree_on_requests` shares them across ranks).

SIGTERM is acted on by a relay thread, not inside the handler (`relayed_signals`: a handler
that sets an Event can deadlock the main thread). A rank still in its loop `STOP_STACK_DUMP_S`
after a stop writes every thread's stack to stderr (faulthandler's watchdog thread, whatever
the main thread holds), so a rank stuck on its way out says where before Slurm (120 s after
its signal) or torchrun (170 s, deploy/train.sh) kills it.

A SIGTERM that comes once the loop has ended (Slurm and torchrun each pass a preemption's
SIGTERM on, so a second one can arrive after the final checkpoint committed) is logged as
"already stopping" and changes nothing; in a process that ends with the run (`meshtrain
train`), that holds until it exits, so printing the summary or shutting down is not killed
(exit 143) either. SIGINT is left alone: Ctrl-C still interrupts a shutdown that hangs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import sys
import threading
from collections.abc import Iterator

from meshtrain.services.common.signals import logged_until_exit, relayed_signals

STOP_STACK_DUMP_S = 90.0
CONTROL_STOP = "a stop request"  # the control endpoint's cause (`meshtrain stop`)
_CONTROL_CODE = 128  # above every signal number
LATE_SIGTERM = "%s: the training loop has ended; already stopping (the exit status stays the run's)"
log = logging.getLogger("meshtrain.train")


def cause_code(cause: str | None) -> int:
    """A stop's cause as a small positive number, so ranks can agree on it in the all-reduce
    that shares the flags: a signal's number, `_CONTROL_CODE` for the control endpoint, 0 for
    none; any other cause counts as the control endpoint's."""
    if not cause:
        return 0
    try:
        return int(signal.Signals[cause])
    except KeyError:
        return _CONTROL_CODE


def cause_of(code: int) -> str:
    """The cause `cause_code` gave `code`."""
    return CONTROL_STOP if code == _CONTROL_CODE else signal.Signals(code).name


def describe_stop(codes: list[int], limit: int = 8) -> str:
    """Which ranks asked for a stop, and why: "SIGTERM to rank 1", "SIGTERM to ranks 0, 3; a
    stop request to rank 2", from each rank's `cause_code` (index = rank, 0: did not ask);
    more than `limit` ranks with one cause are counted, not listed."""
    by_cause: dict[int, list[int]] = {}
    for rank, code in enumerate(codes):
        if code:
            by_cause.setdefault(code, []).append(rank)
    parts = []
    for code, ranks in by_cause.items():
        listed = ", ".join(map(str, ranks[:limit])) + (
            f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
        )
        parts.append(f"{cause_of(code)} to rank{'s' if len(ranks) > 1 else ''} {listed}")
    return "; ".join(parts) or "a stop request from an unnamed rank"


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
            if self._ended.is_set():
                if cause == signal.SIGTERM.name:
                    log.warning(LATE_SIGTERM, cause)
                return
            if not self._stop.is_set():
                self.stop_cause = cause
                try:
                    faulthandler.dump_traceback_later(STOP_STACK_DUMP_S, file=sys.stderr)
                    self._dump_armed = True
                except (
                    AttributeError,
                    ValueError,
                    OSError,
                ):  # no stderr with a file descriptor (embedded)
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
    def sigterm_stops(self, until_exit: bool = False) -> Iterator[None]:
        """While inside (on the main thread), SIGTERM is a stop; once the loop has ended, it is
        only logged.

        Args:
            until_exit: the process ends with the run: from the end of the block until it
                exits, SIGTERM stays only logged rather than killing it.
        """
        with relayed_signals(
            [signal.SIGTERM], lambda s: self.stop(s.name), name="sigterm-relay"
        ) as installed:
            try:
                yield
            finally:
                if installed and until_exit:
                    logged_until_exit([signal.SIGTERM], LATE_SIGTERM)


def agree_on_requests(
    requests: RunRequests, mesh, device, at_log_step: bool
) -> tuple[bool, bool, str | None]:
    """(stop, checkpoint, the stop's cause) as every rank sees them: any rank's request counts
    for all; the cause None without a stop.

    Alone this is checked every step; with several ranks only on logging steps, where the
    loop synchronizes anyway, so requests cost no extra host sync (latency: log_interval).
    With several ranks the same all-reduce carries each rank's cause in a slot of its own, so
    every rank's log names the ranks that asked and why.
    """
    stop, checkpoint = requests.pending()
    cause = requests.stop_cause if stop else None  # set before the flag, under its lock
    if not mesh.distributed:
        return stop, checkpoint, cause
    if not at_log_step:
        return False, False, None
    import torch
    import torch.distributed as dist

    # (stop, checkpoint, cause code of rank 0, ..., of rank world-1), MAX over the ranks
    codes = [0.0] * dist.get_world_size()
    codes[dist.get_rank()] = float(cause_code(cause))
    flags = torch.tensor([float(stop), float(checkpoint), *codes], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = [int(v) for v in flags.tolist()]  # one host sync
    agreed = describe_stop(values[2:]) if values[0] else None
    return bool(values[0]), bool(values[1]), agreed
