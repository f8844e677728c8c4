"""The trainer's Checkpointer against a real checkpoint service: what it leaves open."""

import pytest

from services.checkpoint.rpc.server import start_server
from services.trainer.checkpointing import Checkpointer, Parallel
from services.trainer.parallel.mesh import Mesh


def test_close_closes_the_channel_to_the_service(tmp_path):
    # close() used to stop only the upload thread; the gRPC channel stayed open until the
    # garbage collector found it (a long-lived process creating trainers leaked one per run).
    server, port, _ = start_server(str(tmp_path / "ckpt"))
    try:
        checkpointer = Checkpointer(str(tmp_path / "ckpt"), Parallel(Mesh.single()),
                                    service_address=f"127.0.0.1:{port}")
        assert checkpointer.sink.list() == []  # connected
        checkpointer.close()
        with pytest.raises(ValueError, match="closed channel"):
            checkpointer.sink.list()
        checkpointer.close()  # twice is harmless
    finally:
        server.stop(0)
