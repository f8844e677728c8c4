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

# What the forkserver imports before it forks anything: the rank server first (it turns the
# thread pools off before torch is imported), then what other tests asked for.
_PRELOAD = ["tests.rank_server"]


def forkserver_context(*preload: str):
    """The forkserver context of this test process, with `preload` added to what its server
    imports before forking.

    A process has one forkserver, and only its first start reads the list; so every test that
    forks from it asks through here, and whichever starts it first starts it with what all of
    them asked for so far (the rank server always), not only its own modules.
    """
    _PRELOAD.extend(m for m in preload if m not in _PRELOAD)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
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
    ctx = forkserver_context()
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
                for r in missing:  # hung: killed now, not after the grace the others get below
                    procs[r].kill()
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
