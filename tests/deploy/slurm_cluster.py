"""A throwaway single-node Slurm cluster for tests: its own munged, slurmctld and slurmd.

Everything lives in one temporary folder: the munge socket (slurm.conf's
`AuthInfo=socket=...`, so a system munged, if any, is untouched), state, spool, logs and
`slurm.conf` (found through SLURM_CONF). Ports are free ones on loopback. The node declares
more CPUs than the machine has (`SlurmdParameters=config_overrides`) so several tasks fit on
2 cores. `cred_expire=10`: a requeued job waits out its old credential before it may start
again (default 120 s; starting it earlier fails with "Job credential revoked"). Needs root
(slurmd launches jobs as the submitting user) and Debian's slurm-wlm and munge
(deploy/install-test-deps.sh). `stop()` ends only the daemons this object started and the job
processes they spawned. tests/deploy/slurm_nodes.py builds several nodes on this one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from meshtrain.services.launcher.topology import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")


def missing_requirements() -> str | None:
    """Why a cluster cannot start here, or None when it can."""
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return (
            f"Slurm/munge not installed ({', '.join(absent)} missing; "
            "deploy/install-test-deps.sh installs them)"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root to launch jobs"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (installed by the munge package)"
    return None


SCHEDULING = """\
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=60
SchedulerParameters=sched_interval=1
"""
"""The slurm.conf lines every test cluster shares: no cgroups, no accounting, requeue, a
scheduler pass every second."""


class SlurmCluster:
    """One node, one partition ("debug"), `cpus` CPUs declared.

    Args:
        workdir: folder for every file the cluster writes.
        cpus: CPUs the node declares.
    """

    def __init__(self, workdir: Path, cpus: int = 8):
        self.dir = Path(workdir)
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}

    def write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "slurm.conf").write_text(f"""\
ClusterName=meshtraintest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
{SCHEDULING}NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout: float = 60.0) -> None:
        """Start munged, slurmctld and slurmd; return when the node is idle."""
        self.write_config()
        self._start_controller(timeout)
        self._spawn(["slurmd", "-D"], "slurmd")
        self.wait_idle(timeout)

    def _start_controller(self, timeout: float) -> None:
        """munged (its own socket and a copy of the system's key) and slurmctld."""
        d = self.dir
        key = d / "munge" / "munge.key"
        shutil.copy("/etc/munge/munge.key", key)
        os.chmod(key, 0o400)
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={d}/munge/munge.socket",
                f"--pid-file={d}/munge/munged.pid",
                f"--log-file={d}/munge/munged.log",
                f"--seed-file={d}/munge/munged.seed",
            ],
            "munged",
        )
        self._wait(lambda: (d / "munge" / "munge.socket").exists(), timeout, "munged socket")
        self._spawn(["slurmctld", "-D", "-i"], "slurmctld")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Return when every node of the cluster reports idle."""

        def idle() -> bool:
            states = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
            return bool(states) and all(s == "idle" for s in states)

        self._wait(idle, timeout, "the nodes to be idle")

    def _spawn(self, argv: list[str], name: str) -> None:
        out = open(self.dir / f"{name}.stdout", "wb")  # noqa: SIM115 -- open for the daemon's life
        self.processes.append(
            subprocess.Popen(
                argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for p in self.processes:
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{p.args[0]} exited with {p.returncode} while waiting for {what}; "
                        f"logs in {self.dir}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; logs in {self.dir}")
            time.sleep(0.3)

    def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        result = subprocess.run(
            argv,
            env={**self.env, **kw.pop("env", {})},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            **kw,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
        return result

    def job_field(self, job_id: str, field: str) -> str | None:
        """A field of `scontrol show job` (JobState, ExitCode, Restarts, ...); None once purged."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        for word in out.split():
            if word.startswith(field + "="):
                return word.split("=", 1)[1]
        return None

    def stop(self) -> None:
        """Cancel whatever is left, then SIGTERM (SIGKILL after 15 s) the daemons started here."""
        if self.processes:
            self.run(["scancel", "--full", "--user", "root"], check=False)
        for p in reversed(self.processes):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.processes):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.processes.clear()
        for pid in self.job_processes():  # slurmstepd outlives slurmd; so may a stuck job
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def job_processes(self) -> list[int]:
        """Processes this cluster's slurmd started (they inherit its SLURM_CONF), still alive."""
        mine = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if mine in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
        return found
