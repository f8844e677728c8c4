"""Signal handling that cannot deadlock: the action runs on a relay thread, not in the handler.

CPython runs a Python signal handler on the main thread between two of its bytecodes: inside
whatever the main thread was doing, holding whatever locks it held. A handler that takes a
lock that is not reentrant then waits for itself forever. `threading.Event.set` takes one (its
Condition's), and so does `Event.wait` on its way in and out, so a handler that sets an Event
the main thread polls with `wait(timeout)`, or a second signal arriving while a first handler is
inside `set` (torchrun and Slurm each pass a preemption's SIGTERM on, milliseconds apart), hangs
the process. That is how a trainer rank hung on a Slurm preemption: two nested handlers, the
inner one waiting in `Event.set` for the lock the outer one held (reproduced: 4 hangs in 300
double signals 0-300 us apart).

`relayed_signals` installs a handler that only writes the signal's number to a pipe (a system
call: no Python lock), and a thread reads the pipe and runs the action there, where waiting for
a lock is ordinary contention with the main thread, which will release it. `logged_until_exit`
hands a signal over, at the end of such a block, to a handler that only logs it for the rest of
the process (a trainer whose loop has ended and which is on its way out).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator

log = logging.getLogger("meshtrain.signals")


def _relay(run: Callable[[int], None], name: str) -> tuple[Callable, int, threading.Thread]:
    """(a handler that only writes the signal's number to a pipe, the pipe's write end, the
    started thread that reads the pipe and calls `run(number)` for each, in arrival order, until
    the write end is closed)."""
    read_end, write_end = os.pipe()
    os.set_blocking(
        write_end, False
    )  # a handler never blocks: a full pipe already holds ~64k signals

    def relay() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(64):
                for number in chunk:
                    run(number)

    def on_signal(signum: int, _frame) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(write_end, bytes([signum]))

    thread = threading.Thread(target=relay, name=name, daemon=True)
    thread.start()
    return on_signal, write_end, thread


@contextlib.contextmanager
def relayed_signals(
    signals: Iterable[signal.Signals],
    action: Callable[[signal.Signals], None],
    name: str = "signal-relay",
) -> Iterator[bool]:
    """While inside, each of `signals` runs `action(signal)` on a relay thread, in arrival order.

    Handlers are installed on the main thread only (Python's rule); elsewhere (a test calling
    from a thread) nothing is installed. The previous handlers are restored on exit, and the
    relay thread has finished the actions of every signal that arrived before it.

    Args:
        signals: the signals to handle.
        action: what a signal does; runs on the relay thread, so it may take locks, log and set
            events. An exception it raises is logged, and later signals are still handled.
        name: the relay thread's name.

    Yields:
        True when the handlers are installed, False off the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        yield False
        return

    def run(number: int) -> None:
        try:
            action(signal.Signals(number))
        except Exception:  # one failed action must not end signal handling
            log.exception("handling %s failed", signal.Signals(number).name)

    on_signal, write_end, thread = _relay(run, name)
    previous = {}
    try:
        for s in signals:
            previous[s] = signal.signal(s, on_signal)
        yield True
    finally:
        for s, handler in previous.items():
            if signal.getsignal(s) is on_signal:
                signal.signal(s, handler)
        os.close(write_end)  # the relay reads what is left, then the end of the pipe
        thread.join(timeout=30)
        if thread.is_alive():
            log.warning("a signal's action is still running after 30 s; leaving it behind")


def logged_until_exit(signals: Iterable[signal.Signals], message: str) -> bool:
    """From now until the process exits, each of `signals` only logs `message` (a warning).

    For a process on its way out whose work is done: a late signal must not turn a finished run
    into one killed by it. Logged on a relay thread, as `relayed_signals` does; once the
    interpreter has begun to finalize (atexit), Python handlers are no longer run, so the signals
    are ignored outright from then on.

    Args:
        signals: the signals to take over.
        message: the warning; `%s` in it is replaced by the signal's name.

    Returns:
        True when installed; False off the main thread, where handlers cannot be installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    signals = list(signals)
    on_signal, _, _ = _relay(
        lambda number: log.warning(message, signal.Signals(number).name), "signals-until-exit"
    )

    def ignore() -> None:
        for s in signals:
            if signal.getsignal(s) is on_signal:
                signal.signal(s, signal.SIG_IGN)

    for s in signals:
        signal.signal(s, on_signal)
    atexit.register(ignore)
    return True
