"""run_ranks: spawn a multi-process gloo job inside a test and re-raise the failing rank's error.

Better than running pytest under torchrun, where one failing rank hangs the rest: every rank
runs `fn(rank, world_size, *args)` in its own process; the parent waits with a timeout, kills
stragglers, and raises the first rank error with its traceback, or returns rank results.

The ranks fork from a forkserver that has imported torch and the trainer once
(`tests/rank_server.py`), not from the test process (which may hold threads, a CUDA context or
state a test changed) and not as fresh interpreters that import everything again. `fn` is still
pickled by reference, as under "spawn", and each rank gets the test process's environment of the
moment it starts.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback

import torch.multiprocessing as mp

from meshtrain.services.launcher.topology import free_port

# Imported by the forkserver before it forks any rank.
_PRELOAD = ["tests.rank_server"]


def _context():
    ctx = mp.get_context("forkserver")
    # Only the server's first start reads the list; a server some other test started first (with
    # its own list) serves the ranks as well, only without the head start.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(fn, rank, world, port, args, queue, store_path, environ):
    # The test process's environment now, not the server's from when it started; on top of it
    # what torchrun would set (code under test reads it). The rendezvous itself goes through a
    # file, so no TCP port can be taken by another test meanwhile.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world
        )
        result = fn(rank, world, *args)
        # Plain pickle: tensors travel inline, not as shared-memory handles the parent would have
        # to fetch from this process (which may have exited by then).
        queue.put((rank, "ok", pickle.dumps(result)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn, world_size: int, *args, timeout: float = 240.0, errors: str = "raise", daemon: bool = True
) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; returns results by rank.

    errors: "raise" re-raises the first rank error; "return" waits for every rank and returns,
    for a rank that failed, {"error": its traceback, "at": time.monotonic() when it arrived}.
    daemon: False for ranks that start processes of their own (megatron-core's checkpoint
    writer does); they are still killed when they outlive the timeout.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    store_dir = tempfile.mkdtemp(prefix="run_ranks-")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, args, queue, store_path, dict(os.environ)),
            daemon=daemon,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout:.0f} s"
                ) from None
            if status == "error" and errors == "raise":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = (
                {"error": payload, "at": time.monotonic()}
                if status == "error"
                else pickle.loads(payload)
            )
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [results[r] for r in range(world_size)]
