"""Guards of a server's streams against clients that hold them: per-client limits, idle reaping.

A client that opens many streams, or opens them and never reads, holds a server's stream
slots (each is a thread) while its health check still says SERVING. `PeerLimit` caps the
streams one client (one peer host: every connection from one address counts together) holds
at once; one more is refused with RESOURCE_EXHAUSTED naming the limit, which clients fail over
on. `IdleReaper` cancels a response stream whose client has not taken a message for `idle_s`
seconds: gRPC's server holds a handler at its `yield` while the client's flow-control window is
full, so time suspended there is time the client did not read. A slow client that still reads
moves the window, and every message it takes resets the clock.

    limit, reaper = PeerLimit(16, "--max-streams-per-client"), IdleReaper(300.0)
    with limit.hold(context):
        yield from reaper.watch(responses, context, "stream of step 5")
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Iterator

import grpc

log = logging.getLogger("meshtrain.grpc")


def peer_host(peer: str) -> str:
    """The client's host in a gRPC peer string ("ipv4:10.0.0.5:53312" -> "10.0.0.5",
    "ipv6:%5B::1%5D:4000" -> "::1"); other kinds (unix sockets) are returned whole."""
    kind, sep, rest = peer.partition(":")
    if not sep or kind not in ("ipv4", "ipv6"):
        return peer
    return urllib.parse.unquote(rest).rsplit(":", 1)[0].strip("[]")


class PeerLimit:
    """At most `limit` streams at once from one client host (0: no limit).

    Args:
        limit: streams one peer host may hold at once.
        flag: the server option that sets it, named in the refusal.
    """

    def __init__(self, limit: int, flag: str):
        self.limit = int(limit)
        self.flag = flag
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, context: grpc.ServicerContext):
        """Holds one of the client's slots for the `with` body; aborts the RPC with
        RESOURCE_EXHAUSTED when the client holds `limit` already."""
        if self.limit <= 0:
            yield
            return
        host = peer_host(context.peer())
        with self._lock:
            taken = self._held[host] < self.limit
            if taken:
                self._held[host] += 1
        if not taken:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {host} already holds {self.limit} streams of this server, the most "
                f"one client may ({self.flag} {self.limit}); end one first or use another server",
            )
        try:
            yield
        finally:
            with self._lock:
                self._held[host] -= 1
                if not self._held[host]:
                    del self._held[host]

    def held(self, host: str) -> int:
        """Streams `host` holds now."""
        with self._lock:
            return self._held[host]


class IdleReaper:
    """Cancels response streams whose client has taken no message for `idle_s` seconds.

    One daemon thread looks at the watched streams every `min(1, idle_s / 4)` seconds. A stream
    counts as waiting on its client only while its generator is suspended at a `yield` (gRPC
    holds it there until the message is handed to the transport); the handler's own work
    between messages (reading, computing a batch) never counts.

    Args:
        idle_s: seconds a client may leave a message untaken; 0 or None: never reap.
        flag: the server option that sets it, for the log line.
    """

    def __init__(self, idle_s: float | None, flag: str = "--stream-idle-timeout"):
        self.idle_s = float(idle_s or 0)
        self.flag = flag
        self._waiting: dict[
            int, list
        ] = {}  # id -> [suspended since (monotonic) or None, context, what]
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.reaped = 0  # streams cancelled (for tests and logs)

    def watch(
        self, responses: Iterable, context: grpc.ServicerContext, what: str = "a stream"
    ) -> Iterator:
        """`responses`, passed on; the stream is cancelled when its client leaves a message
        untaken for `idle_s` seconds (its generator then ends at that `yield`)."""
        if not self.idle_s:
            yield from responses
            return
        entry: list = [None, context, what]
        with self._lock:
            self._waiting[id(entry)] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-reaper", daemon=True)
                self._thread.start()
        responses = iter(responses)
        try:
            for item in responses:
                entry[0] = time.monotonic()
                yield item
                entry[0] = None
        finally:
            with self._lock:
                self._waiting.pop(id(entry), None)
            close = getattr(responses, "close", None)
            if close is not None:  # the inner generator's own cleanup runs now, not at collection
                close()

    def _run(self) -> None:
        period = min(1.0, self.idle_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                stale = [
                    e
                    for e in self._waiting.values()
                    if e[0] is not None and now - e[0] > self.idle_s
                ]
                for e in stale:  # cancelled once: its generator ends and unregisters itself
                    e[0] = None
            for _, context, what in stale:
                self.reaped += 1
                log.warning(
                    "%s: its client %s took no message for %g s (%s); cancelled",
                    what,
                    peer_host(context.peer()),
                    self.idle_s,
                    self.flag,
                )
                context.cancel()
