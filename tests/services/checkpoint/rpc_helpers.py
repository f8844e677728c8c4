"""Helpers of the checkpoint service tests (test_rpc.py, test_rpc_failures.py):
a service on loopback with a client of it, boxes of a tensor-parallel write, a written save,
a held stream slot."""

import contextlib
import threading
import time

import torch

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.rpc.client import CheckpointClient
from meshtrain.services.checkpoint.rpc.server import start_server


@contextlib.contextmanager
def running_service(root: str, **server_options):
    """A checkpoint service on loopback and a client of it (256-byte chunks); stopped after."""
    server, port, _ = start_server(root, **server_options)
    client = CheckpointClient(f"127.0.0.1:{port}", chunk_bytes=256)
    try:
        yield client, port
    finally:
        client.close()
        server.stop(0)


def tp_boxes(full, writer, tp):
    rows = full.shape[1] // tp
    return [
        (
            ShardSpec(
                "layers.attention.qkv.weight",
                tuple(full.shape),
                "bfloat16",
                (i, writer * rows, 0),
                (1, rows, full.shape[2]),
            ),
            full[i : i + 1, writer * rows : (writer + 1) * rows],
        )
        for i in range(full.shape[0])
    ]


def written_save(client, step: int) -> str:
    """A one-writer save of `step` with one small array written and finished; its save id."""
    save_id = client.begin_save(step, num_writers=1)
    writer = client.writer(step, save_id, 0, 1)
    writer.write(ShardSpec("w", (2,), "float32", (0,), (2,)), torch.ones(2))
    writer.finish()
    return save_id


@contextlib.contextmanager
def held_slot(client, save_id: str, seconds: float):
    """A WriteShards stream of `save_id` that sends its header and then nothing for `seconds`,
    holding one of the service's stream slots; entered once it holds it, joined on exit."""

    def slow():
        yield pb.WriteShardsRequest(header=pb.WriteHeader(save_id=save_id, writer_id=0))
        time.sleep(seconds)

    blocker = threading.Thread(target=lambda: client.stub.WriteShards(slow()))
    blocker.start()
    time.sleep(0.3)  # the slow stream holds the slot
    try:
        yield
    finally:
        blocker.join()
