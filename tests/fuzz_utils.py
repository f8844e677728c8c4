"""Deterministic structured fuzzing of meshtrain's gRPC services (tests/services/*/test_fuzz*.py).

A `Fuzzer` sends requests as raw bytes through a generic channel (identity serializers), so the
server's own deserializer sees exactly what was generated: valid messages whose fields hold edge
values (`mutate`, `random_message`), and malformed bytes (`raw_variants`: truncated, bit-flipped,
random, overlong varints, length prefixes past the end), some with odd credentials in place of
the caller's (`AUTH_VARIANTS`). Every run is a pure function of its
seed (`random.Random`), so a failure in CI replays locally. It records each status code per
method and keeps, per distinct (method, code, first words of the details), the first request
that produced it; `Fuzzer.problems()` lists what a test must not see:

- UNKNOWN (a handler raised something nothing mapped: a bug) or INTERNAL (gRPC's answer when a
  request does not deserialize, or a response does not serialize; `UNPARSED_INTERNAL_OK` says
  whether the first kind is accepted);
- health not SERVING when probed, a well-behaved client's check failing;
- handler exceptions in the server's log (`LOG_MARKERS`), RSS growth over a bound, files
  written outside the folders the server may write (`tree_snapshot`).

Servers run as subprocesses (`ServerProcess`): a request that makes the server allocate without
bound then hits an address-space limit set on the server alone (a MemoryError it reports),
rather than the machine's OOM killer taking the test runner, and its stderr is the log checked.

    fuzzer = Fuzzer(address, "meshtrain.dataloader.v1.DataService")
    fuzzer.unary("Describe", mutate(rng, template).SerializeToString())
    assert not fuzzer.problems()
"""

from __future__ import annotations

import collections
import math
import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# Edge values by protobuf type

_INT32 = [0, 1, -1, 2, 7, 255, 2**15, 2**31 - 1, -(2**31), 2**30]
_INT64 = _INT32 + [2**32 - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), -(2**32)]
_UINT32 = [0, 1, 2, 7, 255, 2**15, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
_UINT64 = _UINT32 + [2**32, 2**36, 2**36 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
_DOUBLE = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-300,
    5e-324,
    1e308,
    -1e308,
    2.0**63,
    2.0**64,
    math.nan,
    -math.nan,
    math.inf,
    -math.inf,
    3.4e38,
    1e9,
]
_FLOAT = [0.0, -0.0, 1.0, -1.0, 0.5, 3.4e38, -3.4e38, 1e-45, math.nan, math.inf, -math.inf]
_HUGE = "x" * 100_000
STRINGS = [
    "",
    " ",
    "a",
    "0",
    "-1",
    "../../etc",
    "../../../../../../etc/passwd",
    "/etc/passwd",
    "/",
    ".",
    "..",
    "a\x00b",
    "\x00",
    "x\n",
    "\n",
    "é字🙂",
    "\u202e",
    "\ufeff",
    _HUGE,
    "a" * 256,
    "a/" * 200,
    "%s%n%x",
    "${HOME}",
    "'\";--",
    "null",
    "NaN",
    "{}",
    "[]",
    "a:b",
    "C:\\Windows",
    "file:///etc/passwd",
    "memory://x/y",
    "s3://",
    "s3://bucket/key",
    "http://127.0.0.1:1/x",
    "zip://a::file:///b",
    "/dev/zero",
    "/proc/self/mem",
    "~",
    "~root",
    "*",
    "?",
    "[",
    "a b",
    "\t",
    "\r\n",
]
BYTES = [
    b"",
    b"\x00",
    b"\xff" * 7,
    b"\x00" * 4096,
    bytes(range(256)),
    b"\x80" * 33,
    b"\x01" * 100_000,
]


def edge_scalar(rng: random.Random, field: FieldDescriptor):
    """An edge value for one (non-message) field of `field`'s type."""
    t = field.type
    if t in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
    ):
        return rng.choice(_INT32)
    if t in (
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SFIXED64,
    ):
        return rng.choice(_INT64)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return rng.choice(_UINT32)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return rng.choice(_UINT64)
    if t == FieldDescriptor.TYPE_DOUBLE:
        return rng.choice(_DOUBLE)
    if t == FieldDescriptor.TYPE_FLOAT:
        return rng.choice(_FLOAT)
    if t == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == FieldDescriptor.TYPE_STRING:
        return rng.choice(STRINGS)
    if t == FieldDescriptor.TYPE_BYTES:
        return rng.choice(BYTES)
    if t == FieldDescriptor.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [0])
    raise TypeError(f"no edge values for field {field.full_name} of type {t}")


def _repeated_values(rng: random.Random, field: FieldDescriptor, huge: int) -> list:
    r = rng.random()
    if r < 0.25:
        return []
    if r < 0.85 or field.type == FieldDescriptor.TYPE_MESSAGE:
        n = rng.randint(1, 4)
    else:
        n = rng.choice([64, 1000, huge])  # long lists of one edge value (cheap to make)
        if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            return [
                rng.choice(STRINGS[:12]) if field.type == FieldDescriptor.TYPE_STRING else b"x"
            ] * n
        return [edge_scalar(rng, field)] * n
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return [None] * n  # filled by the caller
    return [edge_scalar(rng, field) for _ in range(n)]


def random_message(
    rng: random.Random, cls: type[Message], fill: float = 0.5, depth: int = 0, huge: int = 10_000
) -> Message:
    """A `cls` message with about `fill` of its fields (recursively) set to edge values."""
    msg = cls()
    fields = list(cls.DESCRIPTOR.fields)
    rng.shuffle(fields)
    for field in fields:
        if rng.random() >= fill:
            continue
        if (
            field.containing_oneof is not None
            and msg.WhichOneof(field.containing_oneof.name) is not None
        ):
            continue  # one member of a oneof (the generator may still pick it over another)
        _set_field(rng, msg, field, fill, depth, huge)
    return msg


def _set_field(
    rng: random.Random, msg: Message, field: FieldDescriptor, fill: float, depth: int, huge: int
) -> None:
    if field.is_repeated:
        msg.ClearField(field.name)
        values = _repeated_values(rng, field, huge)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for _ in values:
                if depth < 3:
                    getattr(msg, field.name).add().CopyFrom(
                        random_message(
                            rng, field.message_type._concrete_class, fill, depth + 1, huge
                        )
                    )
        else:
            getattr(msg, field.name).extend(values)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        if depth < 3:
            getattr(msg, field.name).CopyFrom(
                random_message(rng, field.message_type._concrete_class, fill, depth + 1, huge)
            )
        else:
            getattr(msg, field.name).SetInParent()
    else:
        setattr(msg, field.name, edge_scalar(rng, field))


def _leaves(msg: Message, prefix=()) -> list[tuple[tuple, FieldDescriptor]]:
    """(path to the message holding it, field) for every field of `msg` and its set submessages."""
    out = []
    for field in msg.DESCRIPTOR.fields:
        out.append((prefix, field))
        if (
            field.type == FieldDescriptor.TYPE_MESSAGE
            and not field.is_repeated
            and msg.HasField(field.name)
        ):
            out += _leaves(getattr(msg, field.name), prefix + (field.name,))
    return out


def mutate(
    rng: random.Random, template: Message, n: int | None = None, huge: int = 10_000
) -> Message:
    """A copy of `template` with `n` (default 1 to 3) of its fields, at any depth, changed to an
    edge value, cleared, or (for messages) replaced by a half-filled random one; a repeated
    field gets a list of edge values (empty, short, or very long), or one element changed."""
    msg = type(template)()
    msg.CopyFrom(template)
    for _ in range(n if n is not None else rng.choice([1, 1, 1, 2, 3])):
        leaves = _leaves(msg)
        if not leaves:  # a message without fields (ListRequest): only its bytes can vary
            break
        path, field = rng.choice(leaves)
        holder = msg
        for name in path:
            holder = getattr(holder, name)
        r = rng.random()
        if r < 0.1:
            holder.ClearField(field.name)
        elif (
            field.is_repeated
            and r < 0.4
            and len(getattr(holder, field.name))
            and field.type != field.TYPE_MESSAGE
        ):
            seq = getattr(holder, field.name)
            seq[rng.randrange(len(seq))] = edge_scalar(rng, field)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not field.is_repeated and r < 0.6:
            getattr(holder, field.name).CopyFrom(
                random_message(
                    rng, field.message_type._concrete_class, rng.choice([0.3, 0.5, 0.8]), 1, huge
                )
            )
        else:
            _set_field(rng, holder, field, 0.5, 1, huge)
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def raw_variants(rng: random.Random, valid: bytes) -> bytes:
    """Malformed (or oddly formed) bytes derived from a valid serialization `valid`."""
    kind = rng.randrange(9)
    if kind == 0 and valid:  # truncated
        return valid[: rng.randrange(len(valid))]
    if kind == 1 and valid:  # a few bits flipped
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 2:  # random bytes
        return bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 2, 5, 17, 100, 1000])))
    if kind == 3:  # valid, then garbage
        return valid + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 20)))
    if kind == 4:  # an overlong varint for some field number (11 bytes of continuation)
        field = rng.randint(1, 12)
        return valid + _varint(field << 3) + b"\xff" * rng.choice([9, 10, 11, 20])
    if kind == 5:  # a length-delimited field whose length runs past the end
        field = rng.randint(1, 12)
        return (
            valid
            + _varint(field << 3 | 2)
            + _varint(rng.choice([5, 2**31 - 1, 2**32 + 5, 2**63]))
            + b"ab"
        )
    if kind == 6:  # a known field number with the wrong wire type (fixed32 / group markers)
        field = rng.randint(1, 12)
        return _varint(field << 3 | rng.choice([1, 3, 4, 5, 6, 7])) + b"\x01\x02\x03\x04" + valid
    if kind == 7:  # deeply nested length-delimited field 1 (recursion limits)
        data = b"\x08\x01"
        for _ in range(rng.choice([10, 100, 200])):
            data = b"\x0a" + _varint(len(data)) + data
        return data
    if kind == 8 and valid:  # the message twice (merging repeated / last-one-wins scalars)
        return valid + valid
    return b""


def summarize(request, limit: int = 300) -> str:
    """A short printable description of a request (a message, raw bytes, or a list of them)."""
    if isinstance(request, Message):
        text = f"{type(request).__name__}({_short(request)})"
    elif isinstance(request, (bytes, bytearray)):
        text = f"bytes[{len(request)}]={bytes(request[:80])!r}"
    elif isinstance(request, (list, tuple)):
        text = (
            "["
            + ", ".join(summarize(r, 120) for r in request[:6])
            + (", ..." if len(request) > 6 else "")
            + "]"
        )
    else:
        text = repr(request)
    return text if len(text) <= limit else text[: limit - 20] + f"... ({len(text)} chars)"


def _short(msg: Message) -> str:
    parts = []
    for field, value in msg.ListFields():
        if field.type == FieldDescriptor.TYPE_MESSAGE and not field.is_repeated:
            parts.append(f"{field.name}={type(value).__name__}({_short(value)})")
            continue
        if field.is_repeated:
            vals = list(value)
            shown = (
                [_short(v) for v in vals[:3]]
                if field.type == FieldDescriptor.TYPE_MESSAGE
                else [_clip(v) for v in vals[:3]]
            )
            parts.append(
                f"{field.name}=[{', '.join(shown)}{', ...' if len(vals) > 3 else ''}] "
                f"(len {len(vals)})"
            )
        else:
            parts.append(f"{field.name}={_clip(value)}")
    return ", ".join(parts)


def _clip(value) -> str:
    text = repr(value)
    return (
        text
        if len(text) <= 60
        else f"{text[:40]}...(len {len(value) if hasattr(value, '__len__') else '?'})"
    )


# ---------------------------------------------------------------------------------------------
# Sending

# What a caller may put where a server looks for credentials (`authorization`) instead of a valid
# token: none (None drops the fuzzer's own), other schemes, empty, huge, repeated, binary.
AUTH_VARIANTS = [
    (("authorization", None),),
    (("authorization", ""),),
    (("authorization", "Bearer"),),
    (("authorization", "Bearer "),),
    (("authorization", "bearer x"),),
    (("authorization", "Basic dXNlcjpwYXNz"),),
    (("authorization", "Bearer " + "x" * 4000),),
    (("authorization", "Bearer a b c"),),
    (("authorization", "Bearer ../../etc"),),
    (("authorization", "Bearer %00"),),
    (("authorization", "Bearer x"), ("authorization", "Bearer y")),
    (("authorization-bin", b"\x00\xff" * 8),),
    (("x-" + "k" * 200, "v"),),
]
BAD_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
DESERIALIZE_FAILED = (
    "Exception deserializing request!"  # gRPC's INTERNAL for a request that does not parse
)
# Whether that INTERNAL (and gRPC's log record of it) is accepted. gRPC answers it itself, before
# any servicer code runs; the issue asks for no INTERNAL at all, so by default it is a failure.
UNPARSED_INTERNAL_OK = False
UNPARSED_LOGGED = (
    "Exception deserializing message!",
    "dropped a request that could not be decoded",
)
_identity = None  # grpc: no (de)serializer means bytes in, bytes out


class Fuzzer:
    """Sends raw requests to one service and records what comes back.

    Args:
        address: HOST:PORT of the server.
        service: the service's full name (`package.Service`).
        timeout_s: deadline of each call.
        metadata: sent with every call (e.g. credentials, when the server requires them).
    """

    def __init__(
        self,
        address: str,
        service: str,
        timeout_s: float = 2.0,
        metadata: tuple[tuple[str, str], ...] = (),
    ):
        self.address, self.service, self.timeout_s = address, service, timeout_s
        self.metadata = tuple(metadata)
        self.channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self.calls = 0
        self.codes: collections.Counter = collections.Counter()  # (method, code name) -> count
        self.details: collections.Counter = (
            collections.Counter()
        )  # (method, code name, details head) -> count
        self.bad: dict[
            tuple[str, str, str], tuple[str, str]
        ] = {}  # (method, code, details head) -> (request, details)
        self.failures: list[str] = []  # health and well-behaved client checks that failed
        self.last_response: bytes | None = None  # of the last unary call that succeeded
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _method(self, name: str) -> str:
        return f"/{self.service}/{name}"

    def _record(
        self, method: str, request, code: grpc.StatusCode, details: str | None, metadata=None
    ) -> None:
        self.calls += 1
        self.codes[(method, code.name)] += 1
        self.details[(method, code.name, re.sub(r"[0-9a-f]{32}", "ID", details or "")[:70])] += 1
        if code in BAD_CODES:
            key = (method, code.name, (details or "")[:60])
            shown = summarize(request) + (
                f" with metadata {summarize(metadata, 120)}" if metadata else ""
            )
            self.bad.setdefault(key, (shown, details or ""))

    def _meta(self, metadata) -> tuple:
        """The metadata of a call: the fuzzer's own,
        or `metadata` instead where it names a key of it."""
        metadata = tuple(metadata or ())
        given = {key for key, _ in metadata}
        return tuple(m for m in self.metadata if m[0] not in given) + tuple(
            m for m in metadata if m[1] is not None
        )

    def unary(self, method: str, request: bytes, metadata=None, shown=None) -> grpc.StatusCode:
        """One unary call of `method` with `request` (bytes); returns its status code."""
        call = self.channel.unary_unary(self._method(method), _identity, _identity)
        self.last_response = None
        try:
            self.last_response = call(
                request, timeout=self.timeout_s, metadata=self._meta(metadata)
            )
            code, details = grpc.StatusCode.OK, None
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        self._record(method, shown if shown is not None else request, code, details, metadata)
        return code

    def unary_stream(
        self, method: str, request: bytes, max_messages: int = 3, metadata=None, shown=None
    ) -> grpc.StatusCode:
        """A server-streaming call, of which at most `max_messages` are read
        before it is cancelled."""
        call = self.channel.unary_stream(self._method(method), _identity, _identity)
        stream = call(request, timeout=self.timeout_s, metadata=self._meta(metadata))
        code, details, read = grpc.StatusCode.OK, None, 0
        try:
            for _ in stream:
                read += 1
                if read >= max_messages:
                    break  # OK as far as it was read; cancelled below
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        stream.cancel()
        self._record(method, shown if shown is not None else request, code, details, metadata)
        return code

    def stream_unary(
        self, method: str, requests: list[bytes], metadata=None, shown=None
    ) -> grpc.StatusCode:
        """A client-streaming call sending `requests` (bytes each) and closing the stream."""
        call = self.channel.stream_unary(self._method(method), _identity, _identity)
        try:
            call(iter(requests), timeout=self.timeout_s, metadata=self._meta(metadata))
            code, details = grpc.StatusCode.OK, None
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        self._record(method, shown if shown is not None else requests, code, details, metadata)
        return code

    def check_health(self, names: Iterable[str] = ("",)) -> bool:
        """Whether the server answers SERVING for each of `names` (a failure is recorded)."""
        ok = True
        for name in names:
            try:
                status = self._health.Check(
                    health_pb2.HealthCheckRequest(service=name),
                    timeout=10,
                    metadata=self.metadata or None,
                ).status
            except grpc.RpcError as e:
                status = f"{e.code().name}: {e.details()}"
            if status != health_pb2.HealthCheckResponse.SERVING:
                self.failures.append(f"after {self.calls} calls: health of {name!r} is {status}")
                ok = False
        return ok

    def check(self, what: str, fn: Callable[[], None]) -> bool:
        """Runs a well-behaved client's check; an exception is recorded as a failure."""
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 -- reported with the others by problems()
            self.failures.append(
                f"after {self.calls} calls: {what} failed: {type(e).__name__}: {e}"[:2000]
            )
            return False

    def periodic_checks(
        self,
        health_every: int,
        health_names: Iterable[str],
        client_every: int,
        what: str,
        fn: Callable[[], None],
    ) -> None:
        """After a fuzzed call: every `health_every` calls a health probe, every `client_every`
        the well-behaved client's check `fn` (both recorded as failures when they fail)."""
        if self.calls % health_every == 0:
            self.check_health(health_names)
        if self.calls % client_every == 0:
            self.check(what, fn)

    def problems(self, limit: int = 8) -> list[str]:
        """Lines describing every bad status and failed check (empty when all went well).

        Requests that do not parse, which gRPC itself answers INTERNAL "Exception deserializing
        request!" (logging a traceback) before any servicer code runs, are one line; every other
        distinct UNKNOWN/INTERNAL answer is one line each (at most `limit`)."""
        out = []
        unparsed = {k: v for k, v in self.bad.items() if v[1] == DESERIALIZE_FAILED}
        if unparsed and not UNPARSED_INTERNAL_OK:
            n = sum(self.codes[(m, c)] for m, c, _ in unparsed)
            examples = "; ".join(
                f"{m}: {req}" for (m, _, _), (req, _) in list(unparsed.items())[:2]
            )
            out.append(
                f"requests that do not parse get INTERNAL {DESERIALIZE_FAILED!r} from gRPC (not "
                f"INVALID_ARGUMENT) on {len(unparsed)} methods ({n} calls), e.g. {examples}"
            )
        others = [(k, v) for k, v in self.bad.items() if v[1] != DESERIALIZE_FAILED]
        if others:
            out.append(
                f"{len(others)} distinct UNKNOWN/INTERNAL answers "
                "(method code: request -> details):"
            )
        for (method, code, _), (request, details) in others[:limit]:
            out.append(f"  {method} {code}: {request} -> {details[:300]!r}")
        out += self.failures[:limit]
        return out

    def table(self, details: int = 0) -> str:
        """Status codes per method, for the test's output; with `details`, that many of the most
        frequent (method, code, details) besides."""
        by_method: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for (method, code), n in sorted(self.codes.items()):
            by_method[method][code] = n
        lines = [f"  {m}: {dict(c)}" for m, c in by_method.items()]
        lines += [
            f"  {n:6d} x {m} {c}: {d!r}" for (m, c, d), n in self.details.most_common(details)
        ]
        return "\n".join(lines)

    def close(self) -> None:
        self.channel.close()


# ---------------------------------------------------------------------------------------------
# The server under test, its log, memory and files

# What gRPC and the ErrorInterceptor log when a handler raised (or a message did not deserialize).
LOG_MARKERS = (
    "Traceback",
    "Exception calling application",
    "Exception iterating responses",
    "Exception deserializing",
    "Exception serializing",
    UNPARSED_LOGGED[1],
)


def log_problems(text: str, limit: int = 6) -> list[str]:
    """The log's exception reports, grouped by what raised (the traceback's last line): one line
    per kind, with its count and where it was logged from (at most `limit` kinds)."""
    lines = text.splitlines()
    kinds: collections.Counter = collections.Counter()
    first: dict[str, str] = {}
    i = 0
    while i < len(lines):
        if not any(m in lines[i] for m in LOG_MARKERS) or (
            UNPARSED_INTERNAL_OK and any(m in lines[i] for m in UNPARSED_LOGGED)
        ):
            i += 1
            continue
        head = (
            lines[i].split(" ", 2)[-1] if lines[i][:4].isdigit() else lines[i]
        )  # without the time stamp
        j = i + 1
        chained = ("Traceback", "During handling", "The above")
        while j < len(lines) and (
            lines[j].startswith((" ", "\t", *chained))
            or not lines[j].strip()
            or (j + 2 < len(lines) and lines[j + 2].startswith(chained[1:]))
        ):  # an exception another raised on
            j += 1
        last = lines[j] if j < len(lines) and j > i + 1 else ""
        key = re.sub(r"with type '[^']*'", "with type '...'", last)[:160] or head[:160]
        kinds[key] += 1
        first.setdefault(key, head[:160])
        i = j + 1
    if not kinds:
        return []
    out = [f"server log: {sum(kinds.values())} exception reports of {len(kinds)} kinds:"]
    out += [f"  {n} x {key}  (logged as: {first[key]})" for key, n in kinds.most_common(limit)]
    return out


def grouped(lines: Iterable[str], what: str, limit: int = 6) -> list[str]:
    """`lines` (log reports) counted by kind (message type names folded), most frequent first."""
    kinds = collections.Counter(
        re.sub(r"with type '[^']*'", "with type '...'", line)[:300] for line in lines
    )
    if not kinds:
        return []
    return [f"{what}: {sum(kinds.values())} exception reports of {len(kinds)} kinds:"] + [
        f"  {n} x {line}" for line, n in kinds.most_common(limit)
    ]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def vm_size_bytes(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmSize for process {pid}")


class ServerProcess:
    """`python -m MODULE ARGS` serving on loopback, its stderr kept in `log_path`.

    Args:
        module: the server module (prints `listening on HOST:PORT` once it serves).
        args: its command line.
        log_path: where its stderr goes (the log checked for handler exceptions).
        env: extra environment variables.
        address_space_headroom: once it serves, its address space is capped at what it holds
            then plus this many bytes (an unbounded allocation becomes a MemoryError in the
            server, not an OOM kill of whatever the kernel picks); None: no cap.
    """

    def __init__(
        self,
        module: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        address_space_headroom: int | None = 2 << 30,
    ):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.address = self._wait_ready()
        if address_space_headroom is not None:
            cap = vm_size_bytes(self.proc.pid) + address_space_headroom
            resource.prlimit(self.proc.pid, resource.RLIMIT_AS, (cap, cap))
        # stdout drained in the background, so a chatty server never blocks on a full pipe
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def _wait_ready(self, timeout: float = 120.0) -> str:
        result: list[str] = []
        reader = threading.Thread(
            target=lambda: result.append(self.proc.stdout.readline()), daemon=True
        )
        reader.start()
        reader.join(timeout)
        line = result[0] if result else ""
        while line.startswith("metrics on"):
            line = self.proc.stdout.readline()
        if not line.startswith("listening on"):
            self.stop()
            raise RuntimeError(
                f"server did not start: {line!r}, rc={self.proc.poll()}, log: {self.log()[-3000:]}"
            )
        return line.split()[-1]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def tree_snapshot(top: Path, skip: Iterable[Path] = ()) -> set[str]:
    """Every file and folder under `top` (relative paths), except those under `skip` and the
    session's S3 servers' folders (`seaweedfs<N>`, from the checkpoint tests' `s3_server`
    fixture): that server is a separate process that adds volume files on its own schedule
    while the server under test runs."""
    top = Path(top)
    skipped = {str(Path(s).resolve()) for s in skip}
    skipped |= {str(p.resolve()) for p in top.glob("seaweedfs*") if p.is_dir()}
    out = set()
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if str((Path(dirpath) / d).resolve()) not in skipped]
        for name in dirnames + filenames:
            if str((Path(dirpath) / name).resolve()) not in skipped:
                out.add(os.path.relpath(os.path.join(dirpath, name), top))
    return out


def new_files(before: set[str], after: set[str], limit: int = 10) -> list[str]:
    """Paths in `after` and not in `before` (at most `limit`)."""
    return sorted(after - before)[:limit]
