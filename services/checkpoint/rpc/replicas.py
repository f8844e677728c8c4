"""Several checkpoint service replicas behind one address, as the checkpoint client sees them.

An address names one replica (`host:port`), several (`host:port,host:port` or a list), or a DNS
name standing for all it resolves to (`dns:///name:port`, looked up again every few seconds, so
a rescaled service is seen). Replicas share nothing but the root's storage, so any replica can
serve any call of a save; the client spreads calls by a key (a writer's id, a save id) over the
replicas in one order every rank agrees on (sorted), and a replica that failed a call is tried
last for `down_s` seconds, so the next try of that call and the calls after it go to the next
replica. Each replica has its own channel: a call and its retry reach the replica chosen for them.

    replicas = Replicas("dns:///ckpt:50051", make_channel)
    for target in replicas.order(key=writer_id): stub = replicas.stub(target); ...
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from meshtrain.services.common import addresses
from meshtrain.services.common.errors import CheckpointError

if TYPE_CHECKING:  # the config checks addresses with `parse_addresses`: no grpc for that
    import grpc

    from meshtrain.protos.checkpoint.v1.checkpoint_pb2_grpc import CheckpointServiceStub

RESOLVE_EVERY_S = 2.0  # a dns: target is looked up again after this long


def _dns_host_port(target: str) -> tuple[str, int]:
    """(name, port) of a `dns:[//authority/]name:port` target (CheckpointError when malformed)."""
    try:
        return addresses.dns_host_port(target)
    except ValueError as e:
        raise CheckpointError(f"checkpoint service address {e}") from None


def parse_addresses(address: str | Sequence[str]) -> list[str]:
    """The replica addresses of `address`: a `host:port`, several separated by commas, a list of
    them, or `dns:///name:port` entries.

    Raises:
        CheckpointError: no address, or one that is not `host:port` / `dns:///name:port`.
    """
    entries = address.split(",") if isinstance(address, str) else list(address)
    entries = [e.strip() for e in entries if isinstance(e, str) and e.strip()]
    if not entries:
        raise CheckpointError(
            f"checkpoint service address {address!r} names no replica: give host:port, "
            "several separated by commas, or dns:///name:port"
        )
    for entry in entries:
        if entry.startswith("dns:"):
            _dns_host_port(entry)
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise CheckpointError(
                f"checkpoint service address {entry!r} must be host:port or dns:///name:port"
            )
    return entries


def resolve(entry: str) -> list[str]:
    """The replicas an entry names now: `host:port` itself; a `dns:` target the `ip:port` of each
    address its name resolves to, sorted (every rank sees one order). A name that does not
    resolve (yet) is returned as it is: calls to it fail as to an unreachable replica."""
    if not entry.startswith("dns:"):
        return [entry]
    _dns_host_port(entry)
    return addresses.resolve_dns(entry)


def key_of(value: int | str) -> int:
    """A routing key: an int as it is, a string (a save id) by its crc32, the same in every
    process."""
    return value if isinstance(value, int) else zlib.crc32(value.encode())


class Replicas:
    """The replicas of one address, with a channel each.

    Args:
        address: see `parse_addresses`.
        make_channel: opens a channel to one `host:port`.
        down_s: how long a replica that failed a call is tried last.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        make_channel: Callable[[str], grpc.Channel],
        down_s: float = 5.0,
    ):
        self.entries = parse_addresses(address)
        self.make_channel = make_channel
        self.down_s = down_s
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, CheckpointServiceStub]] = {}
        self._down: dict[str, float] = {}  # target -> until (monotonic)
        self._resolved: tuple[float, list[str]] | None = None
        self._closed = False

    def targets(self) -> list[str]:
        """Every replica now, in the order all ranks agree on."""
        with self._lock:
            if self._resolved is not None and (
                time.monotonic() - self._resolved[0] < RESOLVE_EVERY_S
                or not any(e.startswith("dns:") for e in self.entries)
            ):
                return self._resolved[1]
        found = sorted({t for entry in self.entries for t in resolve(entry)})
        with self._lock:
            self._resolved = (time.monotonic(), found)
        return found

    def order(self, key: int | str = 0, prefer: str | None = None) -> list[str]:
        """The replicas to try for a call, first the one `key` picks (or `prefer`), then the
        others in turn; replicas that failed within `down_s` come last."""
        targets = self.targets()
        start = key_of(key) % len(targets)
        ordered = targets[start:] + targets[:start]
        if prefer in ordered:
            ordered.remove(prefer)
            ordered.insert(0, prefer)
        now = time.monotonic()
        with self._lock:
            down = {t for t, until in self._down.items() if until > now}
        return [t for t in ordered if t not in down] + [t for t in ordered if t in down]

    def stub(self, target: str) -> CheckpointServiceStub:
        """The stub of one replica (its channel opened at first use)."""
        return self._open(target)[1]

    def channel(self, target: str) -> grpc.Channel:
        """The channel to one replica (opened at first use)."""
        return self._open(target)[0]

    def _open(self, target: str) -> tuple[grpc.Channel, CheckpointServiceStub]:
        from meshtrain.protos.checkpoint.v1 import checkpoint_pb2_grpc as pb_grpc

        with self._lock:
            if self._closed:
                raise ValueError("the checkpoint client was closed: no call on a closed channel")
            found = self._stubs.get(target)
            if found is None:
                channel = self.make_channel(target)
                found = self._stubs[target] = (channel, pb_grpc.CheckpointServiceStub(channel))
            return found

    def mark_down(self, target: str) -> None:
        """`target` failed a call: try it last for `down_s` seconds."""
        with self._lock:
            self._down[target] = time.monotonic() + self.down_s

    def close(self) -> None:
        with self._lock:
            stubs, self._stubs, self._closed = self._stubs, {}, True
        for channel, _ in stubs.values():
            channel.close()
