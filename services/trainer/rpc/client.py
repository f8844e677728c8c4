"""Client of a trainer's control endpoint: `ControlClient(addr).status()` returns a plain dict.

An address is `HOST:PORT` or a run directory, which resolves through the `control.addr` file
rank 0 writes there when the endpoint starts (`resolve_target`). That file also holds the run's
token, a random id of the endpoint: the client sends it with every call (metadata
`meshtrain-run`) and the endpoint refuses a token not its own. A trainer killed outright leaves
its control.addr behind, and its port may since serve another run (a fixed
`train.control_port` always does); without the token, `meshtrain stop OLD_RUN_DIR` would stop
that other run. A call without a run token is refused too, so HOST:PORT alone reaches no
endpoint, and control.addr is private to its user (mode 0600).

An endpoint started with `auth.token_file` (or $MESHTRAIN_TOKEN) or TLS (`auth.tls_cert_file`)
wants a bearer token or a certificate besides (`meshtrain.services.common.security`). The
client takes a `ClientSecurity` (`meshtrain.services.common.client_security`); without one,
given a run directory it reads the paths in the `[auth]` section of RUN_DIR/config.toml (the
run's token file, its CA, its certificate), else $MESHTRAIN_TOKEN.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Self

import grpc

from meshtrain.protos.trainer.v1 import trainer_pb2 as pb
from meshtrain.protos.trainer.v1 import trainer_pb2_grpc as pb_grpc
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import ConfigError, MeshtrainError

ADDR_FILE = "control.addr"
RUN_TOKEN_KEY = "meshtrain-run"  # gRPC metadata: the run token of the control.addr the client read


def write_address_file(run_dir: Path, address: str, token: str) -> None:
    """RUN_DIR/control.addr: the endpoint's HOST:PORT, then its run token, one per line; readable
    by its owner only (the run token lets its holder stop the run)."""
    fd = os.open(run_dir / ADDR_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a file left by an earlier run keeps its mode otherwise
        f.write(f"{address}\n{token}\n")


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
            raise ConfigError(
                f"{path} has no {ADDR_FILE}: is the run training with "
                "--train.control_port set (0: any free port)?"
            )
        lines = addr_file.read_text().split()
        if not lines or not _is_address(lines[0]):
            raise ConfigError(
                f"{addr_file} does not start with HOST:PORT (got {addr_file.read_text()[:80]!r})"
            )
        return lines[0], lines[1] if len(lines) > 1 else None
    if not _is_address(target):
        raise ConfigError(f"{target!r} is neither a run directory nor HOST:PORT")
    return target, None


def _ended_run(path: Path) -> str | None:
    """A line saying the run in `path` has ended, from its metrics.jsonl, or None. A finished
    run removes its control.addr, so asking for --train.control_port would mislead."""
    outcome = run_outcome(path)
    if outcome is None:
        return None
    done = "has finished" if outcome["finished"] else "has ended (no control endpoint)"
    return f"{path}: the run {done}: last step {outcome['step']}, loss {outcome['loss']:.4f}"


def run_outcome(path: Path) -> dict | None:
    """How the run in `path`, which has no control.addr, ended: its last step and loss and
    whether that step reached train.train_iters (`finished`), from metrics.jsonl and
    config.toml; None without a logged step."""
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
        iters = (
            tomllib.loads((path / "config.toml").read_text()).get("train", {}).get("train_iters")
        )
    except (OSError, ValueError):
        iters = None
    if last is None:
        return None
    return {
        "finished": iters is not None and last["step"] >= iters,
        "step": last["step"],
        "train_iters": iters,
        "loss": float(last["loss"]),
    }


def run_security(target: str) -> ClientSecurity:
    """The security of a client of `target`: for a run directory whose config.toml has an `[auth]`
    section, its token file, CA and certificate (paths relative to the current directory);
    otherwise $MESHTRAIN_TOKEN, if set."""
    import tomllib

    auth: dict[str, Any] = {}
    config = Path(target) / "config.toml"
    if Path(target).is_dir() and config.exists():
        try:
            auth = tomllib.loads(config.read_text()).get("auth") or {}
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the [auth] section of {config}: {e}") from None
    return ClientSecurity.from_files(
        auth.get("token_file"),
        auth.get("tls_ca_file"),
        auth.get("tls_cert_file"),
        auth.get("tls_key_file"),
        auth.get("tls_server_name"),
    )


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
        security: bearer token and TLS (None: `run_security(target)`).
    """

    def __init__(
        self, target: str, timeout_s: float = 10.0, security: ClientSecurity | None = None
    ):
        self.address, token = resolve_target(target)
        self.metadata = ((RUN_TOKEN_KEY, token),) if token else None
        self.timeout_s = timeout_s
        security = security if security is not None else run_security(target)
        self.channel = security.channel(self.address)
        self.stub = pb_grpc.TrainerControlStub(self.channel)

    def status(self) -> dict:
        """The trainer's progress: step, train_iters, loss, tokens_per_s, eta_s (None until the
        first logged step), last_checkpoint (None before one), stop_/checkpoint_requested."""
        m = self._call(self.stub.Status, pb.StatusRequest())
        return {
            "step": m.step,
            "train_iters": m.train_iters,
            **{
                k: getattr(m, k) if m.HasField(k) else None
                for k in ("loss", "tokens_per_s", "eta_s")
            },
            "last_checkpoint": m.last_checkpoint or None,
            "stop_requested": m.stop_requested,
            "checkpoint_requested": m.checkpoint_requested,
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
            raise MeshtrainError(
                f"trainer control endpoint {self.address}: {e.code().name}: {e.details()}"
            ) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
