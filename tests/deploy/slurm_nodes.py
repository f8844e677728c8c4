"""A throwaway multi-node Slurm cluster on one machine: each node a network namespace of its own.

Each node is a network namespace with one address (a veth pair whose other end is on a bridge
in the root namespace, 10.77.N.11, .12, ...), its own hostname (slurmd runs in a UTS namespace
of its own, `unshare --uts`, so `hostname` in a job says `node1`) and its own slurmd started
with `-N nodeK`. The controller (slurmctld, munged) runs in the root namespace on the bridge's
address 10.77.N.1, a /24 no interface of the machine uses yet. Names resolve through a hosts
file of the cluster's, bind-mounted over /etc/hosts in a private mount namespace of each slurmd
(the machine's own /etc/hosts is untouched). The file system is otherwise shared, as on a
cluster with a shared home. `stop()` ends the daemons and job processes, then removes the
namespaces and the bridge, whatever state the test left. Needs root, iproute2 (`ip netns`),
util-linux's `unshare` and `nsenter`, and what tests/deploy/slurm_cluster.py needs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from meshtrain.services.launcher.topology import free_port
from tests.deploy.slurm_cluster import SCHEDULING, SlurmCluster, missing_requirements


def missing_network_requirements() -> str | None:
    """Why namespaced nodes cannot start here, or None when they can."""
    why = missing_requirements()
    if why:
        return why
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux)"
    probe = f"mtprobe{os.getpid() % 100000}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


class BridgedTrafficDropped(RuntimeError):
    """The machine's firewall drops traffic between the nodes' namespaces on the bridge (or
    between them and the controller): Slurm could not work across them, so the test is skipped
    with this message, naming the direction and the usual cause, instead of timing out."""


# A listener that takes one connection, run inside a network namespace (or the root one).
_LISTEN = (
    "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
    "s.bind((sys.argv[1],int(sys.argv[2]))); s.listen(1); s.settimeout(float(sys.argv[3]));"
    "s.accept()[0].close()"
)
_CONNECT = (
    "import socket,sys; socket.create_connection((sys.argv[1],int(sys.argv[2])),"
    "timeout=float(sys.argv[3])).close()"
)


def _in(ns: str | None, code: str, *args: str) -> list[str]:
    """argv running Python `code` in namespace `ns` (None: the root namespace)."""
    argv = [sys.executable, "-c", code, *args]
    return argv if ns is None else ["nsenter", f"--net=/run/netns/{ns}", *argv]


def tcp_blocked(src: str | None, dst: str | None, address: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection from namespace `src` to `address` (a listener started in
    namespace `dst`) fails within `timeout` seconds."""
    port = str(20000 + os.getpid() % 20000)
    listener = subprocess.Popen(
        _in(dst, _LISTEN, address, port, str(timeout + 2)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):  # until it listens
            if (
                subprocess.run(
                    _in(src, _CONNECT, address, port, str(timeout)), capture_output=True
                ).returncode
                == 0
            ):
                return False
            if listener.poll() is not None:
                return True
        return True
    finally:
        if listener.poll() is None:
            listener.kill()
        listener.wait()


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def free_subnet() -> str:
    """The first 10.77.N (N in 0..254) no address of the machine is in."""
    used = subprocess.run(
        ["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True
    ).stdout
    taken = {int(m) for m in re.findall(r"inet 10\.77\.(\d+)\.", used)}
    for n in range(255):
        if n not in taken:
            return f"10.77.{n}"
    raise RuntimeError("every 10.77.N.0/24 is in use on this machine")


class SlurmNodes(SlurmCluster):
    """`nodes` Slurm nodes (node1, node2, ...), each in a network namespace, one partition.

    Args:
        workdir: folder for every file the cluster writes.
        nodes: how many nodes.
        cpus: CPUs each node declares.
    """

    def __init__(self, workdir: Path, nodes: int = 2, cpus: int = 16):
        super().__init__(workdir, cpus)
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"mtbr{tag}"  # interface names: at most 15 characters
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.namespaces = {name: f"mt{tag}n{i + 1}" for i, name in enumerate(self.names)}
        self.subnet = ""
        self.addresses: dict[str, str] = {}
        self.controller_address = ""
        self._network_up = False

    def write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={a} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            for n, a in self.addresses.items()
        )
        (d / "slurm.conf").write_text(f"""\
ClusterName=meshtrainnodes
SlurmctldHost={self.node}({self.controller_address})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
{SCHEDULING}{nodes}
PartitionName=debug Nodes={",".join(self.names)} Default=YES MaxTime=INFINITE State=UP
""")

    def network_up(self) -> None:
        """The bridge with the controller's address, and one namespace per node attached to it."""
        self.subnet = free_subnet()
        self.controller_address = f"{self.subnet}.1"
        self.addresses = {name: f"{self.subnet}.{11 + i}" for i, name in enumerate(self.names)}
        self._network_up = True  # from here on, stop() removes whatever exists
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addresses.items())
        hosts += f"{self.controller_address} {self.node}\n"
        for i, (name, ns) in enumerate(self.namespaces.items()):
            outer, inner = f"{self.bridge}v{i + 1}", f"{ns}e"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "hosts").write_text(hosts)
        self.check_traffic()

    def check_traffic(self) -> None:
        """Raises BridgedTrafficDropped when a node cannot reach another node or the controller
        (a few seconds; what the test proper would otherwise find only at its timeout)."""
        first, second = self.names[0], self.names[-1]
        ns = self.namespaces
        for what, src, dst, address in (
            (f"{second} -> {first}", ns[second], ns[first], self.addresses[first]),
            (f"{first} -> controller", ns[first], None, self.controller_address),
            (f"controller -> {first}", None, ns[first], self.addresses[first]),
        ):
            if tcp_blocked(src, dst, address):
                raise BridgedTrafficDropped(
                    f"the host's firewall drops traffic on the test's bridge ({what}, TCP to "
                    f"{address}): bridged packets pass iptables/nftables when br_netfilter is "
                    "loaded (net.bridge.bridge-nf-call-iptables=1), and a FORWARD policy of DROP "
                    "(Docker sets one) or an INPUT rule then drops them; allow the 10.77.0.0/16 "
                    "test subnet or set net.bridge.bridge-nf-call-iptables=0"
                )

    def start(self, timeout: float = 60.0) -> None:
        """Network, munged, slurmctld, then one slurmd per namespace;
        return when all nodes are idle."""
        self.network_up()
        self.write_config()
        self._start_controller(timeout)
        for name, ns in self.namespaces.items():
            (self.dir / "spool" / name).mkdir(parents=True, exist_ok=True)
            # Only the network is entered (`ip netns exec` would also remount /sys, hiding the
            # cgroup file system slurmd needs); a private mount namespace puts the nodes' hosts
            # file over /etc/hosts for slurmd and its jobs alone. `unshare` and `sh` exec: the
            # process started is slurmd itself (stop() signals its group).
            self._spawn(
                [
                    "nsenter",
                    f"--net=/run/netns/{ns}",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--propagation",
                    "private",
                    "--",
                    "sh",
                    "-c",
                    'mount --bind "$2" /etc/hosts && hostname "$1" && exec slurmd -D -N "$1"',
                    "sh",
                    name,
                    str(self.dir / "hosts"),
                ],
                f"slurmd-{name}",
            )
        self.wait_idle(timeout)

    def stop(self) -> None:
        """Daemons and job processes (SlurmCluster.stop), then namespaces and bridge."""
        try:
            super().stop()
        finally:
            if self._network_up:
                for i in range(
                    len(self.names)
                ):  # a veth goes with its peer; the namespace would take it later
                    subprocess.run(
                        ["ip", "link", "del", f"{self.bridge}v{i + 1}"],
                        capture_output=True,
                        check=False,
                    )
                for ns in self.namespaces.values():
                    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
                self._network_up = False
