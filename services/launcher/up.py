"""`meshtrain up`: the whole training topology as local processes, in a health-checked order.

    meshtrain up --config deploy/configs/tiny.toml --data-workers 2 --nproc-per-node 4 \
        --tensor-model-parallel-size 2 [--save s3://bucket/ckpt] [--load ROOT] [--metrics]

Starts N DataService workers, then the checkpoint service for the trainer's save root, then K
trainer ranks pointed at them (`--data-service-addresses`, `--checkpoint.service_address`,
`--train.control_port=0`, so `meshtrain status RUN_DIR` works). Every process's log lines
carry its name. The ranks are started here directly with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR/PORT, ...) rather than under torchrun's agent, so each rank gets its
own SIGTERM on shutdown (checkpoint, exit 0) and its own exit status. All ports are free
ports on 127.0.0.1. An `s3://` save root reads AWS_ENDPOINT_URL and credentials from the
environment, which every child inherits.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from services.launcher.health import wait_serving
from services.launcher.topology import Child, ChildFailed, Topology

PYTHON = [sys.executable, "-m", "services.cli"]


@dataclass
class UpOptions:
    """What `meshtrain up` runs besides the trainer's own config.

    Attributes:
        data_workers: DataService workers (0: the trainer reads data in-process).
        nproc_per_node: trainer ranks.
        checkpoint_service: save through the checkpoint service (else ranks write the root directly).
        metrics: give every service a Prometheus port (announced in its log).
        trainer_grace_s: seconds the trainer gets to checkpoint after SIGTERM before SIGKILL.
        start_timeout_s: seconds a service may take to report SERVING.
    """

    data_workers: int = 1
    nproc_per_node: int = 1
    checkpoint_service: bool = True
    metrics: bool = False
    trainer_grace_s: float = 120.0
    start_timeout_s: float = 120.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the child binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan(options: UpOptions, overrides: list[str]) -> tuple[list[Child], list[Child], Path, str]:
    """The children of the topology, in start order, without starting any.

    Args:
        options: the launcher's own options.
        overrides: `meshtrain train` arguments (`--config FILE`, `--section.key=value`, aliases).

    Returns:
        (services, trainer ranks, run directory, checkpoint root).
    """
    from services.trainer.config import load_config

    job = load_config(overrides)  # a bad key fails here, before any process starts
    run_dir = Path(job.log.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S-up"))
    save = job.checkpoint.save or str(run_dir / "checkpoints")
    metrics = ["--metrics-port", "0"] if options.metrics else []
    services: list[Child] = []
    for i in range(options.data_workers):
        port = free_port()
        # Stateless and interchangeable: if one dies the trainer fails over to its peers and
        # the launcher brings it back on the same port.
        services.append(Child(f"data-{i}", PYTHON + ["data", "serve", "--port", str(port), *metrics],
                              port=port, restart=True, grace_s=5.0))
    trainer_args = [*overrides, f"--log.run_dir={run_dir}", f"--checkpoint.save={save}",
                    "--train.control_port=0"]
    if services:
        trainer_args += ["--data-service-addresses", *[f"127.0.0.1:{c.port}" for c in services]]
    if options.checkpoint_service:
        port = free_port()
        services.append(Child("ckpt", PYTHON + ["ckpt", "serve", save, "--port", str(port), *metrics],
                              port=port, grace_s=15.0))
        trainer_args.append(f"--checkpoint.service_address=127.0.0.1:{port}")
    world = options.nproc_per_node
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                  "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                  # torchrun's default too: K ranks each spawning a thread per core oversubscribe
                  **({"OMP_NUM_THREADS": "1"} if world > 1 else {})}
    name = "trainer" if world == 1 else "trainer-{}"
    trainers = [Child(name.format(rank), PYTHON + ["train", *trainer_args],
                      env={**rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)} if world > 1 else {},
                      role="trainer", grace_s=options.trainer_grace_s)
                for rank in range(world)]
    return services, trainers, run_dir, save


def run_up(options: UpOptions, overrides: list[str], out=None,
           stop: threading.Event | None = None) -> int:
    """Run the topology until the trainer finishes, SIGINT/SIGTERM, or a child fails.

    Args:
        options: the launcher's own options.
        overrides: `meshtrain train` arguments.
        out: where prefixed log lines go (stdout by default).
        stop: set it to stop the run from another thread (tests); signals set it too.

    Returns:
        0 when the trainer finished or stopped cleanly, 1 when a child failed.
    """
    services, trainers, run_dir, save = plan(options, overrides)
    topo = Topology(out)
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum, _frame):
            topo.say(f"received {signal.Signals(signum).name}: stopping (trainer first, it checkpoints)")
            stop.set()
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        topo.say(f"run directory {run_dir}, checkpoints {save}")
        ready = wait_serving(options.start_timeout_s)
        for child in services:
            if stop.is_set():
                break
            topo.start(child, ready)
        if not stop.is_set():
            for child in trainers:
                topo.start(child)
            topo.say(f"trainer started: `meshtrain status {run_dir}` / `meshtrain stop {run_dir}`")
            code = topo.supervise(stop, restart_wait=ready)
        else:
            code = 0
    except ChildFailed as e:
        topo.say(f"error: {e}; stopping the topology")
        code = 1
    finally:
        statuses = topo.shutdown()
        for s, h in previous.items():
            signal.signal(s, h)
    failed = {n: c for n, c in statuses.items() if n.startswith("trainer") and c not in (0, None)}
    if failed and code == 0:
        topo.say(f"error: trainer exit statuses {failed}")
        code = 1
    topo.say(f"stopped (exit {code})")
    return code
