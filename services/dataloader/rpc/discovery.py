"""Where the data workers are: the addresses a trainer is given, resolved to the live workers.

An entry of `data.service_addresses` is one of:

- `host:port`: one worker;
- `dns:///name:port`: every address the name resolves to now (compose `--scale`, a Kubernetes
  headless service), looked up again whenever the client re-resolves;
- `dir:PATH`: every worker announced in the folder PATH on a shared file system. A worker
  started with `meshtrain data serve --announce PATH` writes one small file there once it
  serves, and removes it when it stops gracefully; workers started later (a second Slurm step,
  another node) are found at the next resolution. A worker that was killed leaves its file
  behind: the client then fails to reach it and benches it like any failed worker.

`resolve_workers` turns one entry into `ip:port` strings, sorted, so every rank that sees the
same set lists it in the same order (the client spreads ranks over that order).

    with announce("/shared/run1/workers", "node7:7001"):
        serve()
    resolve_workers("dir:/shared/run1/workers")  # ['node7:7001', ...]
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

from meshtrain.services.common import addresses
from meshtrain.services.common.errors import DataError

SUFFIX = ".worker"
# what an announced address may hold: a host name, an IPv4 address or a bracketed IPv6 one, a port
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}$")


def dns_host_port(target: str) -> tuple[str, int]:
    """(name, port) of a `dns:[//authority/]name:port` target (DataError when malformed)."""
    try:
        return addresses.dns_host_port(target)
    except ValueError as e:
        raise DataError(f"data service address {e}") from None


def announce_dir(target: str) -> Path:
    """The folder of a `dir:PATH` target (`dir:///abs/path` is accepted too)."""
    path = target[len("dir:") :]
    if path.startswith("//"):
        path = path[2:]
    if not path:
        raise DataError(
            f"data service address {target!r} must be dir:PATH (a folder workers announce in)"
        )
    return Path(path)


def check_address(address: str) -> None:
    """Raise DataError naming a malformed `dns:` or `dir:` target (at configuration time, not
    at the first connection attempt); any other address is gRPC's to judge."""
    if address.startswith("dns:"):
        dns_host_port(address)
    elif address.startswith("dir:"):
        announce_dir(address)


def resolve_workers(address: str) -> list[str]:
    """The workers an address names now, sorted.

    `host:port` is itself. A `dns:` name that does not resolve (yet: a service still starting)
    is returned as it is, so the attempt fails as an unreachable worker does and the next
    resolution tries again. A `dir:` folder that is missing or empty names no worker yet (an
    empty list); a file in it that does not hold one address is skipped (a worker writing it
    renames it into place whole, so that is somebody else's file).
    """
    if address.startswith("dir:"):
        return announced(announce_dir(address))
    if not address.startswith("dns:"):
        return [address]
    dns_host_port(address)  # a malformed target is named as the data service's
    return addresses.resolve_dns(address)


def announced(folder: Path) -> list[str]:
    """The addresses announced in `folder`, sorted and without repeats."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = set()
    for entry in entries:
        if not entry.name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            text = Path(entry.path).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):  # withdrawn while listed, or not ours
            continue
        if _ADDRESS.match(text):
            found.add(text)
    return sorted(found)


def _file_name(address: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", address) + SUFFIX


@contextlib.contextmanager
def announce(folder: str | os.PathLike, address: str) -> Iterator[Path]:
    """Announce a serving worker at `address` in `folder` for as long as the block runs.

    The file is written beside its final name and renamed into place, so a client never reads
    half an address; it is removed when the block ends (a graceful stop). The folder is
    created if missing.

    Raises:
        DataError: `address` is not host:port, or the folder cannot be written.
    """
    if not _ADDRESS.match(address):
        raise DataError(f"cannot announce {address!r}: not host:port")
    folder = Path(folder)
    path = folder / _file_name(address)
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(address + "\n", encoding="ascii")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise DataError(f"cannot announce data worker {address} in {folder}: {e}") from e
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def advertised_host(bind_host: str) -> str:
    """The host name other machines reach a worker bound to `bind_host` by: the bound address
    itself, or this machine's name for a wildcard bind (0.0.0.0, ::)."""
    if bind_host in ("0.0.0.0", "::", "[::]", ""):
        return socket.gethostname()
    return f"[{bind_host}]" if ":" in bind_host and not bind_host.startswith("[") else bind_host
