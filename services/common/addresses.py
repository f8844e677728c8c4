"""`dns:///name:port` targets: one address standing for every server a name resolves to.

The data client and the checkpoint client both take such a target (compose `--scale`, a
headless Kubernetes service) and resolve it themselves, at each connection attempt or every
few seconds, so that a rescaled service is seen and each server gets its own channel.

    host, port = dns_host_port("dns:///dataloader:7001")     # ('dataloader', 7001)
    resolve_dns("dns:///dataloader:7001")                    # ['10.0.0.5:7001', '10.0.0.6:7001']
"""

from __future__ import annotations

import socket


def dns_host_port(target: str) -> tuple[str, int]:
    """(name, port) of a `dns:[//authority/]name:port` target.

    Raises:
        ValueError: the target has no name or no port in 1..65535.
    """
    rest = target[len("dns:") :]
    if rest.startswith("//"):  # an authority (the DNS server to ask), usually empty
        rest = rest[2:].partition("/")[2]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{target!r} must be dns:///name:port")
    return host.strip("[]"), int(port)


def resolve_dns(target: str) -> list[str]:
    """The `ip:port` of each address the target's name resolves to now, sorted so that every
    process lists them in one order; the target itself while the name does not resolve (a
    service still starting): connecting to it then fails as to an unreachable server."""
    host, port = dns_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:  # socket.gaierror: the name is not known (yet)
        return [target]
    ips = sorted({str(info[4][0]) for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips] or [target]
