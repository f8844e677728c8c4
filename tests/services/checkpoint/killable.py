"""Writer processes for the kill tests: deterministic content per step, easy to check after.

Run in child processes (forkserver context, modules preloaded, so a start costs milliseconds);
the test SIGKILLs them at random moments and then checks what is on storage.
"""

from __future__ import annotations

import torch

from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.multiwriter import ShardWriter

LAYERS, ROWS, COLS = 8, 16, 32
NUM_WRITERS = 2
ARRAY = "layers.mlp.fc1.weight"


def expected(step: int) -> torch.Tensor:
    """The whole array saved at `step`: (layers, rows, cols), distinct for every step."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(LAYERS, ROWS, COLS, generator=g).to(torch.bfloat16)


def boxes(step: int, writer_id: int) -> list[tuple[ShardSpec, torch.Tensor]]:
    """Writer w owns rows [w*ROWS/2, (w+1)*ROWS/2) of every layer (tensor parallel, tp=2)."""
    full, rows = expected(step), ROWS // NUM_WRITERS
    lo = writer_id * rows
    return [
        (
            ShardSpec(ARRAY, full.shape, "bfloat16", (i, lo, 0), (1, rows, COLS)),
            full[i : i + 1, lo : lo + rows],
        )
        for i in range(LAYERS)
    ]


def run_writer(root: str, step: int, save_id: str, writer_id: int, commit_timeout: float) -> None:
    """One writer's whole part of a save; writer 0 also commits."""
    writer = ShardWriter(root, step, save_id, writer_id, NUM_WRITERS)
    for spec, data in boxes(step, writer_id):
        writer.write(spec, data)
    writer.finish()
    if writer_id == 0:
        commit(root, step, save_id, NUM_WRITERS, {"step": step}, timeout=commit_timeout)


def noop() -> None:
    """Started once so the forkserver is up before any timing is measured."""


def serve(root: str, port: int) -> None:
    """A checkpoint service process on 127.0.0.1:port that runs until killed."""
    import threading

    from meshtrain.services.checkpoint.rpc.server import start_server

    server, _, _ = start_server(root, port=port, commit_timeout=2.0)
    threading.Event().wait()  # `server` must stay referenced: a collected server stops
    server.stop(0)
