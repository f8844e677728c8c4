"""Client of a trainer's control endpoint: `ControlClient(addr).status()` returns a plain dict.

An address is `HOST:PORT` or a run directory, which resolves through the `control.addr` file
rank 0 writes there when the endpoint starts (`resolve_address`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

import grpc

from protos.trainer.v1 import trainer_pb2 as pb
from protos.trainer.v1 import trainer_pb2_grpc as pb_grpc
from services.common.errors import ConfigError, MeshtrainError

ADDR_FILE = "control.addr"


def resolve_address(target: str) -> str:
    """`HOST:PORT` for `target`, which is either that or a run directory holding control.addr.

    Raises:
        ConfigError: a directory without control.addr, or neither a directory nor HOST:PORT.
    """
    path = Path(target)
    if path.is_dir():
        addr_file = path / ADDR_FILE
        if not addr_file.exists():
            raise ConfigError(f"{path} has no {ADDR_FILE}: is the run training with "
                              "--train.control_port set (0: any free port)?")
        return addr_file.read_text().strip()
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{target!r} is neither a run directory nor HOST:PORT")
    return target


class ControlClient:
    """Talks to one trainer's TrainerControl service.

    Args:
        target: HOST:PORT or a run directory.
        timeout_s: deadline of each call.
    """

    def __init__(self, target: str, timeout_s: float = 10.0):
        self.address = resolve_address(target)
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.TrainerControlStub(self.channel)

    def status(self) -> dict:
        """The trainer's progress: step, train_iters, loss, tokens_per_s, eta_s (None until the
        first logged step), last_checkpoint (None before one), stop_/checkpoint_requested."""
        m = self._call(self.stub.Status, pb.StatusRequest())
        return {
            "step": m.step, "train_iters": m.train_iters,
            **{k: getattr(m, k) if m.HasField(k) else None for k in ("loss", "tokens_per_s", "eta_s")},
            "last_checkpoint": m.last_checkpoint or None,
            "stop_requested": m.stop_requested, "checkpoint_requested": m.checkpoint_requested,
        }

    def checkpoint(self) -> int:
        """Ask for a checkpoint after the current step; returns the step at the time of asking."""
        return self._call(self.stub.Checkpoint, pb.CheckpointRequest()).step

    def stop(self) -> int:
        """Ask the run to checkpoint and end; returns the step at the time of asking."""
        return self._call(self.stub.Stop, pb.StopRequest()).step

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise MeshtrainError(f"trainer control endpoint {self.address}: {e.code().name}: {e.details()}") from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
