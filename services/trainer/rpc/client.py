"""Client of a trainer's control endpoint: `ControlClient(addr).status()` returns a plain dict.

An address is `HOST:PORT` or a run directory, which resolves through the `control.addr` file
rank 0 writes there when the endpoint starts (`resolve_target`). That file also holds the run's
token, a random id of the endpoint: the client sends it with every call (metadata
`meshtrain-run`) and the endpoint refuses a token not its own. A trainer killed outright leaves
its control.addr behind, and its port may since serve another run (a fixed
`train.control_port` always does); without the token, `meshtrain stop OLD_RUN_DIR` would stop
that other run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

import grpc

from meshtrain.protos.trainer.v1 import trainer_pb2 as pb
from meshtrain.protos.trainer.v1 import trainer_pb2_grpc as pb_grpc
from meshtrain.services.common.errors import ConfigError, MeshtrainError

ADDR_FILE = "control.addr"
RUN_TOKEN_KEY = "meshtrain-run"  # gRPC metadata: the run token of the control.addr the client read


def write_address_file(run_dir: Path, address: str, token: str) -> None:
    """RUN_DIR/control.addr: the endpoint's HOST:PORT, then its run token, one per line."""
    (run_dir / ADDR_FILE).write_text(f"{address}\n{token}\n")


def resolve_target(target: str) -> tuple[str, str | None]:
    """(`HOST:PORT`, run token or None) for `target`: that address (no token), or a run directory
    holding control.addr (its address and token; None from a file written before tokens).

    Raises:
        ConfigError: a directory without control.addr or with an unreadable one, or neither a
            directory nor HOST:PORT.
    """
    path = Path(target)
    if path.is_dir():
        addr_file = path / ADDR_FILE
        if not addr_file.exists():
            ended = _ended_run(path)
            if ended:
                raise ConfigError(ended)
            raise ConfigError(f"{path} has no {ADDR_FILE}: is the run training with "
                              "--train.control_port set (0: any free port)?")
        lines = addr_file.read_text().split()
        if not lines or not _is_address(lines[0]):
            raise ConfigError(f"{addr_file} does not start with HOST:PORT (got {addr_file.read_text()[:80]!r})")
        return lines[0], lines[1] if len(lines) > 1 else None
    if not _is_address(target):
        raise ConfigError(f"{target!r} is neither a run directory nor HOST:PORT")
    return target, None


def _ended_run(path: Path) -> str | None:
    """A line saying the run in `path` has ended, from its metrics.jsonl, or None. A finished
    run removes its control.addr, so asking for --train.control_port would mislead."""
    import json
    import tomllib

    last = None
    try:
        for line in (path / "metrics.jsonl").read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record and record.get("loss") is not None:
                last = record
        iters = tomllib.loads((path / "config.toml").read_text()).get("train", {}).get("train_iters")
    except (OSError, ValueError):
        iters = None
    if last is None:
        return None
    done = "has finished" if iters is not None and last["step"] >= iters else "has ended (no control endpoint)"
    return f"{path}: the run {done}: last step {last['step']}, loss {float(last['loss']):.4f}"


def resolve_address(target: str) -> str:
    """`HOST:PORT` for `target`, which is either that or a run directory holding control.addr."""
    return resolve_target(target)[0]


def _is_address(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit())


class ControlClient:
    """Talks to one trainer's TrainerControl service.

    Args:
        target: HOST:PORT or a run directory.
        timeout_s: deadline of each call.
    """

    def __init__(self, target: str, timeout_s: float = 10.0):
        self.address, token = resolve_target(target)
        self.metadata = ((RUN_TOKEN_KEY, token),) if token else None
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
            return method(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as e:
            raise MeshtrainError(f"trainer control endpoint {self.address}: {e.code().name}: {e.details()}") from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
