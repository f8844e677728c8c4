"""The trainer's side of the DataService: `ServiceBatchSource`, a drop-in for LocalBatchSource.

`micro_batches(step)` returns the same `Batch` objects the in-process loader makes, bit for
bit. A background thread keeps one server stream open and `prefetch` micro-batches ahead in
a bounded queue. When a stream breaks (worker killed, network gone) the thread backs off
exponentially, benches that worker for `bench_s`, and asks another for the stream again
starting at exactly the next micro-batch it has not received, so none is repeated or missed;
every message's (step, micro-batch) is checked against the one expected.

Clients spread over the workers: each has a slot (`spread`, by default its dp and cp rank) and
streams from live worker `slot mod count` of the sorted worker list, so every worker serves its
share. Every `rebalance_s` a streaming client resolves its addresses again and, when its slot now
falls on another worker (one joined, one left, a benched one is back), moves its stream there at the
next micro-batch, exactly as after a failure. Each connection first asks the worker to open the
dataset (`Describe`, which may build sample indices: minutes for a large blend, so it has its own
`open_timeout_s`); a worker that then keeps its stream open but sends nothing while the trainer
waits (a hung handler still answers keepalive pings) is dropped the same way after `stall_s`, and a
stream that ends before the dataset does is a failure too. A `dns:///name:port` or `dir:PATH` target
(`discovery`) is resolved here, at each connection attempt and rebalance (so a rescaled service is
seen), into the workers it names; each worker gets its own channel, so the Describe and the stream
of one attempt reach the same worker (a round-robin channel sent them to different ones: the
streaming worker then built its indices inside the stream, under `stall_s`). A request the server
rejects (INVALID_ARGUMENT, ...), or fails on with an error it does not map (UNKNOWN: the same on
every worker), is raised in the trainer's thread with the server's message; so is a run of failures,
with no micro-batch in between, that has gone on for `give_up_s` after every worker was tried. That
clock starts at the first failure, not at the last micro-batch (the trainer may have computed on
prefetched ones for minutes in between), and stops while a worker opens the dataset successfully (a
build may take minutes). Under context parallelism (`cp_size` > 1) the worker sends only the rank's
two chunks of each sample, each with its next token, and the client checks it got exactly that shape
(a worker that predates cp sends whole samples: an error, never a batch of the wrong positions).

A worker that authenticates callers or serves TLS takes `security` (a `ClientSecurity`: the
token to send, the CA, a client certificate); without it, $MESHTRAIN_TOKEN is sent if set. A
refused token (UNAUTHENTICATED, PERMISSION_DENIED) is raised at once, like any permanent error.

    src = ServiceBatchSource(["127.0.0.1:7001", "127.0.0.1:7002"], spec, micro_batch_size=4,
                             global_batch_size=32, dp_rank=r, dp_size=8)
    for step in range(start, n): batches = src.micro_batches(step)
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
from typing import Self

import grpc

from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import DataError
from meshtrain.services.common.grpc_utils import channel_options, is_permanent, put_unless_stopped
from meshtrain.services.dataloader.loader import (
    Batch,
    BatchOptions,
    batch_from_samples,
    batch_from_segments,
    context_chunks,
)
from meshtrain.services.dataloader.rpc.decode import MessageDecoder
from meshtrain.services.dataloader.rpc.discovery import check_address, resolve_workers
from meshtrain.services.dataloader.rpc.multimodal import check_batch_bytes, mm_spec_to_proto
from meshtrain.services.dataloader.rpc.servicer import spec_to_proto
from meshtrain.services.dataloader.spec import DatasetSpec
from meshtrain.services.dataloader.vision.dataset import MultimodalSpec, batch_from_payload

log = logging.getLogger("meshtrain.data")

_END = object()  # the stream reached the end of the dataset


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _EndedEarly(Exception):
    """A stream that ended cleanly before the dataset's last step (a worker or proxy cut it)."""


class _NoWorkers(Exception):
    """The addresses name no worker now (a `dir:` folder nobody has announced in yet)."""


class ServiceBatchSource:
    """One data-parallel rank's micro-batches from DataService workers."""

    def __init__(
        self,
        addresses: list[str],
        spec: DatasetSpec | MultimodalSpec,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        prefetch: int = 8,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        give_up_s: float = 120.0,
        options: BatchOptions | None = None,
        stall_s: float | None = None,
        open_timeout_s: float = 900.0,
        cp_rank: int = 0,
        cp_size: int = 1,
        security: ClientSecurity | None = None,
        spread: tuple[int, int] | None = None,
        rebalance_s: float = 10.0,
        bench_s: float = 60.0,
    ):
        """Args:
        addresses: worker addresses (`host:port`), tried in turn; a `dns:///name:port`
            target stands for the addresses the name resolves to, looked up again at each
            connection attempt, and ranks are spread over them as over a list.
        spec: the sample stream: text (DatasetSpec) or vision-language (MultimodalSpec, whose
            batches carry images; not under context parallelism).
        micro_batch_size: samples per micro-batch per rank.
        global_batch_size: samples per step over all ranks.
        dp_rank: this rank.
        dp_size: data-parallel ranks.
        prefetch: micro-batches fetched ahead.
        backoff_s: (first, largest) wait between reconnection attempts.
        give_up_s: raise once failures have gone on this long, with no micro-batch in
            between, and every worker has been tried since the first of them (successful
            dataset opens are not counted).
        options: loss-mask and document-boundary options, applied here as LocalBatchSource does.
        stall_s: fail over from a worker whose stream has sent nothing for this long while
            the trainer waits for it (default: give_up_s / 4).
        open_timeout_s: how long a worker may take to open the dataset (build or load its
            indices) before the next one is tried; a failed open is a failure like any other.
        cp_rank: this rank's context-parallel index; batches hold only the positions
            `context_positions(spec.seq_length, cp_rank, cp_size)`, and only those are sent.
        cp_size: context-parallel ranks (they all read the samples of one dp rank).
        security: token and TLS settings for every worker (None: plaintext, $MESHTRAIN_TOKEN if
            set).
        spread: (slot, slots): this client's place among all the clients of the run that pull
            from the service (default: dp_rank * cp_size + cp_rank of dp_size * cp_size); it
            streams from live worker `slot % len(live workers)`.
        rebalance_s: how often (seconds) a streaming client resolves the addresses again and
            moves to the worker its slot now falls on (a worker joined, or one it had left after
            a failure is back), at exactly the next micro-batch; 0: only on failure.
        bench_s: how long a worker that failed (unreachable, stalled, ended early) is passed
            over when choosing one, unless every worker has failed.
        """
        if not addresses:
            raise DataError("ServiceBatchSource needs at least one worker address")
        if (
            micro_batch_size < 1
            or dp_size < 1
            or global_batch_size < 1
            or global_batch_size % (micro_batch_size * dp_size)
        ):
            raise DataError(
                f"global_batch_size={global_batch_size} must be a positive multiple of "
                f"micro_batch_size={micro_batch_size} x dp_size={dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        stall_s = give_up_s / 4 if stall_s is None else stall_s
        if (
            prefetch < 1
            or give_up_s <= 0
            or stall_s <= 0
            or open_timeout_s <= 0
            or rebalance_s < 0
            or bench_s < 0
        ):
            raise DataError(
                f"prefetch={prefetch} must be >= 1, give_up_s={give_up_s}, stall_s={stall_s} and "
                f"open_timeout_s={open_timeout_s} positive, rebalance_s={rebalance_s} and "
                f"bench_s={bench_s} not negative"
            )
        place: tuple[int, ...] = (
            (dp_rank * cp_size + cp_rank, dp_size * cp_size) if spread is None else tuple(spread)
        )
        if len(place) != 2 or not 0 <= place[0] < place[1]:
            raise DataError(f"spread={place} must be (slot, slots) with 0 <= slot < slots")
        spec.validate()
        self.multimodal = isinstance(spec, MultimodalSpec)
        if self.multimodal:
            if cp_size != 1:
                raise DataError(
                    f"multimodal batches are not cut for context parallelism (cp_size={cp_size})"
                )
            check_batch_bytes(spec, micro_batch_size)  # type: ignore[arg-type]
        self.chunks = context_chunks(spec.seq_length, cp_rank, cp_size)  # raises on bad cp values
        sft = getattr(spec, "format", "gpt") == "sft"  # packed SFT data sends its ids
        if (
            cp_size > 1
            and options is not None
            and (options.position_ids or (options.document_ids and not sft))
        ):
            raise DataError(
                f"document ids and positions (data.reset_attention_mask, "
                f"data.reset_position_ids) are not served from the data service under context "
                f"parallelism (cp_size={cp_size}): it sends a rank only its chunks, which do not "
                f"show the documents before them; read the data in-process"
            )
        for address in addresses:
            check_address(address)  # a malformed target fails here, not at the first attempt
        self.addresses = list(addresses)
        self.security = security if security is not None else ClientSecurity.from_files()
        self.spec = spec
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.prefetch = prefetch
        self.backoff_s = backoff_s
        self.give_up_s = give_up_s
        self.stall_s = stall_s
        self.open_timeout_s = open_timeout_s
        self.spread: tuple[int, int] = (place[0], place[1])
        self.rebalance_s = rebalance_s
        self.bench_s = bench_s
        self.options = options or BatchOptions()
        self._decoder = MessageDecoder(spec, micro_batch_size, cp_rank, cp_size, self.chunks)
        self.reconnects = 0  # streams reopened after a failure (for tests and logs)
        self.moves = 0  # streams moved to another worker by a rebalance
        self.current_address: str | None = None  # the worker streaming to us now
        self._channels: dict[str, grpc.Channel] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Guards _call/current_address against a halting consumer: a producer that was told to
        # stop before its call existed cancels the call itself instead of publishing it.
        self._lock = threading.Lock()
        self._call = None  # the open stream (what a stall cancels)
        self._opening = None  # the Describe in flight (only a halt cancels it)
        self._closed = False
        self._stalled_call = None  # the call get() cancelled for sending nothing
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._next: tuple[int, int] | None = None  # what the consumer takes next

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on this rank."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def num_steps(self) -> int:
        """Whole global batches the dataset holds."""
        return self.spec.num_samples // self.global_batch_size

    def _request(self, step: int, microbatch: int) -> pb.StreamRequest:
        which = (
            {"multimodal": mm_spec_to_proto(self.spec)}
            if isinstance(self.spec, MultimodalSpec)
            else {"spec": spec_to_proto(self.spec)}
        )
        return pb.StreamRequest(
            **which,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            start_step=step,
            start_microbatch=microbatch,
            cp_rank=self.cp_rank,
            cp_size=self.cp_size,
        )

    def _stub(self, address: str) -> pb_grpc.DataServiceStub:
        if (
            address not in self._channels
        ):  # pick_first: one worker per channel (see resolve_workers)
            self._channels[address] = self.security.channel(address, channel_options())
        return pb_grpc.DataServiceStub(self._channels[address])

    @property
    def payload_shape(self) -> tuple[int, ...]:
        """The shape of a micro-batch message's tokens (see `MessageDecoder.payload_shape`)."""
        return self._decoder.payload_shape

    @staticmethod
    def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
        return put_unless_stopped(q, item, stop)

    def _workers(self) -> list[str]:
        """Every worker the addresses name now, each once (a rescale or a new announcement shows
        here)."""
        return list(dict.fromkeys(w for a in self.addresses for w in resolve_workers(a)))

    def _choose(self, workers: list[str], benched: dict[str, float]) -> str:
        """The worker this client should stream from: its `spread` slot over the workers that
        have not failed in the last `bench_s` (if every one has: the one that failed longest
        ago, so retries go round). Every client sees the same sorted list,
        so n clients over k live workers load each with n/k streams, give or take one."""
        now = time.monotonic()
        live = [w for w in workers if now - benched.get(w, -math.inf) >= self.bench_s]
        if not live:
            return min(workers, key=lambda w: benched.get(w, -math.inf))
        index, _ = self.spread
        return live[index % len(live)]

    def _produce(self, step: int, microbatch: int, stop: threading.Event, q: queue.Queue) -> None:
        """Background thread: stream from (step, microbatch) on into `q`, failing over as needed
        and moving to the worker `_choose` picks when the workers change (every `rebalance_s`)."""
        pos = (step, microbatch)
        delay = self.backoff_s[0]
        # The give-up clock: when the current run of consecutive failures began (None while
        # streams deliver), and the workers tried since. Measured from the last micro-batch
        # instead, it counted the trainer's compute on prefetched batches as time without data.
        failing_since: float | None = None
        tried: set[str] = set()
        benched: dict[str, float] = {}  # worker -> when it last failed
        nmb = self.num_micro_batches
        while not stop.is_set():
            workers = self._workers()
            call = None
            address = (
                self._choose(workers, benched)
                if workers
                else f"(none announced in {self.addresses})"
            )
            try:
                if not workers:
                    raise _NoWorkers(f"no data worker is announced at {self.addresses} yet")
                with self._lock:
                    if stop.is_set():
                        return
                    self._call, self.current_address = None, address
                    opening = self._stub(address).Describe.future(
                        self._request(*pos), timeout=self.open_timeout_s
                    )
                    self._opening = opening
                opened_since = time.monotonic()
                info = opening.result()  # the worker has the dataset open: streaming starts at once
                if (
                    isinstance(self.spec, DatasetSpec)
                    and (info.sample_order or "meshtrain") != self.spec.sample_order
                ):
                    # a worker older than the field ignores it and would serve meshtrain's order
                    raise DataError(
                        f"data worker {address} serves sample_order "
                        f"{info.sample_order or 'meshtrain'!r}, not the {self.spec.sample_order!r} "
                        f"this run asks for: upgrade it"
                    )
                if (
                    isinstance(self.spec, DatasetSpec)
                    and (info.format or "gpt") != self.spec.format
                ):
                    # a worker older than the field would serve pretraining samples, no masks
                    raise DataError(
                        f"data worker {address} serves format {info.format or 'gpt'!r}, not the "
                        f"{self.spec.format!r} this run asks for: upgrade it"
                    )
                if failing_since is not None:  # opening is not a stall
                    failing_since += time.monotonic() - opened_since
                call = self._stub(address).StreamBatches(self._request(*pos))
                with self._lock:
                    if stop.is_set():  # halted while the call was being made
                        call.cancel()
                        return
                    self._call, self._opening = call, None
                moved = False
                next_check = time.monotonic() + self.rebalance_s
                for msg in call:
                    if (msg.step, msg.microbatch) != pos:
                        raise DataError(
                            f"worker {address} sent step {msg.step} micro-batch "
                            f"{msg.microbatch}, expected {pos}"
                        )
                    samples = self._decoder.decode(msg, address)
                    if not self._put(q, (pos, samples), stop):
                        return
                    pos = (pos[0] + 1, 0) if pos[1] + 1 == nmb else (pos[0], pos[1] + 1)
                    delay, failing_since = self.backoff_s[0], None
                    tried.clear()
                    if (
                        self.rebalance_s
                        and time.monotonic() >= next_check
                        and pos[0] < self.num_steps
                    ):
                        next_check = time.monotonic() + self.rebalance_s
                        workers = self._workers()
                        want = self._choose(workers, benched) if workers else address
                        if want != address:  # the stream goes on there from exactly `pos`
                            log.info(
                                "data: moving from worker %s to %s at step %d micro-batch %d (%d "
                                "workers)",
                                address,
                                want,
                                pos[0],
                                pos[1],
                                len(workers),
                            )
                            self.moves += 1
                            call.cancel()
                            moved = True
                            break
                if moved:
                    continue
                if pos[0] < self.num_steps:  # ended cleanly, but short of the dataset's end
                    raise _EndedEarly(
                        f"worker {address} ended its stream at step {pos[0]} micro-batch "
                        f"{pos[1]}, before the dataset's {self.num_steps} steps"
                    )
                self._put(q, _END, stop)
                return
            except grpc.FutureCancelledError:  # only a halt cancels the Describe
                return
            except (grpc.RpcError, _EndedEarly, _NoWorkers) as e:
                if stop.is_set():
                    return
                if isinstance(e, (_EndedEarly, _NoWorkers)):
                    what, why = type(e).__name__, str(e)
                elif call is not None and call is self._stalled_call:
                    what, why = (
                        "stalled",
                        f"sent nothing for {self.stall_s:.0f}s while the trainer waited",
                    )
                else:
                    if is_permanent(e):  # the request's fault: no other worker helps
                        self._put(
                            q,
                            _Failure(
                                DataError(f"data worker {address}: {e.code().name}: {e.details()}")
                            ),
                            stop,
                        )
                        return
                    what, why = e.code().name, f"{e.code().name}: {e.details()}"
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if workers:
                    tried.add(address)
                    benched[address] = now
                if now - failing_since > self.give_up_s and tried.issuperset(workers):
                    self._put(
                        q,
                        _Failure(
                            DataError(
                                f"no data worker of {self.addresses} served anything for "
                                f"{self.give_up_s:.0f}s; last error from {address}: {why}"
                            )
                        ),
                        stop,
                    )
                    return
                self.reconnects += 1
                log.warning(
                    "data worker %s failed (%s); resuming at %s elsewhere", address, what, pos
                )
                # jitter keeps ranks that lost the same worker from reconnecting in lockstep
                stop.wait(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.backoff_s[1])
            except BaseException as e:  # noqa: BLE001 -- a bug or bad message: surface it in the trainer
                self._put(q, _Failure(e), stop)
                return

    def _restart(self, step: int) -> None:
        self._halt()
        with self._lock:  # close() may run on another thread (a trainer shutting down)
            if self._closed:
                raise DataError("the data client is closed")
            self._stop = threading.Event()
            self._queue = queue.Queue(maxsize=self.prefetch)
            self._next = (step, 0)
            thread = threading.Thread(
                target=self._produce,
                args=(step, 0, self._stop, self._queue),
                name=f"data-client-rank{self.dp_rank}",
                daemon=True,
            )
            thread.start()
            self._thread = thread

    def _halt(self) -> None:
        with self._lock:
            self._stop.set()
            call, self._call = self._call, None
            opening, self._opening = self._opening, None
            thread, self._thread = self._thread, None
        for pending in (call, opening):
            if pending is not None:
                pending.cancel()
        if thread is not None:
            thread.join(timeout=10)
            if (
                thread.is_alive()
            ):  # it has its own stop event and queue: it cannot leak into the next stream
                log.warning(
                    "data client thread did not stop within 10 s; leaving it to exit on its own"
                )

    def _drop_stalled(self) -> None:
        """Cancel the current stream if it is still the one that sent nothing: its thread fails
        over."""
        with self._lock:
            call = self._call
            if call is None or call is self._stalled_call:
                return
            self._stalled_call = call
        log.warning(
            "data worker %s sent nothing for %.0f s while the trainer waited; failing over",
            self.current_address,
            self.stall_s,
        )
        call.cancel()

    def get(self) -> Batch:
        """The next micro-batch of the stream (blocks until it arrives, failing over from a
        worker that sends nothing for `stall_s`).

        Raises:
            DataError: no stream is open (call `micro_batches` first), the server rejected the
                request, or no worker sent anything for `give_up_s`.
        """
        if self._thread is None and self._queue.empty():
            raise DataError("get() with no stream open: call micro_batches(step) first")
        q, stop = self._queue, self._stop
        waited_since = time.monotonic()
        while True:
            try:
                item = q.get(timeout=min(0.2, self.stall_s))
                break
            except queue.Empty:
                if stop.is_set():
                    raise DataError(
                        "the data client was closed while waiting for a micro-batch"
                    ) from None
                if time.monotonic() - waited_since >= self.stall_s:
                    self._drop_stalled()
                    waited_since = time.monotonic()
        if isinstance(item, _Failure):
            self._next = None  # the next call restarts the stream
            raise item.exc
        if item is _END:
            wanted, self._next = self._next, None
            assert wanted is not None  # set when the stream (re)started
            raise DataError(f"step {wanted[0]} is past the dataset's {self.num_steps} steps")
        pos, samples = item
        assert pos == self._next, f"client queue out of order: got {pos}, expected {self._next}"
        self._next = (
            (pos[0] + 1, 0) if pos[1] + 1 == self.num_micro_batches else (pos[0], pos[1] + 1)
        )
        if isinstance(self.spec, MultimodalSpec):
            return batch_from_payload(samples[0], pos[0], pos[1], self.spec)
        tokens, mask, docs = samples
        make = batch_from_samples if self.cp_size == 1 else batch_from_segments
        return make(tokens, pos[0], pos[1], self.options, token_mask=mask, document_ids=docs)

    def micro_batches(self, step: int) -> list[Batch]:
        """All of this rank's micro-batches for one step, in order.

        Steps are normally asked for in sequence and come from the prefetch queue; asking for
        any other step (resume, evaluation) reopens the stream there.

        Args:
            step: global batch index.

        Returns:
            `num_micro_batches` Batches, equal to LocalBatchSource's.
        """
        if self._next != (step, 0):
            self._restart(step)
        return [self.get() for _ in range(self.num_micro_batches)]

    def close(self) -> None:
        """Stop the background thread and close the channels (safe from another thread: a
        reader blocked in `get` gets a DataError)."""
        with self._lock:
            self._closed = True
        self._halt()
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
