"""What a rollout worker runs with (`ServeConfig`) and the flags of `meshtrain rollout serve` that
set it. `cli.py` and `rpc/server.py` both build a `ServeConfig` from those flags, so the server
never imports the CLI. No torch here: a bad flag fails at once.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.security import add_server_arguments

ADDRESSES_ENV = "MESHTRAIN_ROLLOUT_ADDRESSES"
"""Set by `meshtrain up --rollout-workers N` on the trainer it starts: its rollout workers'
`host:port` addresses, comma-separated (what a `RolloutClient` takes)."""


@dataclass
class ServeConfig:
    """A rollout worker's settings; `add_serve_arguments` has each field's flag."""

    load: str
    """Checkpoint root the policy is loaded from (and `LoadCheckpoint` reads later steps of,
    unless `checkpoint_root` is set)."""
    step: int | None = None
    """Step to start from (None: the newest committed); the worker's version is this step."""
    checkpoint_root: str | None = None
    """Root `LoadCheckpoint` reads published steps from (None: `load`): the trainer's save root
    when the policy starts from another one (e.g. an SFT checkpoint)."""
    version: int | None = None
    """The policy version the loaded weights count as (None: the step). A GRPO run numbers its
    versions by its own steps from 0: a worker started from another run's checkpoint (the SFT
    policy the run starts from) takes --version 0, so the run's first publication is not
    refused as older than the worker's."""
    port: int = 0
    """TCP port (0: any free one)."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    device: str = "auto"
    """auto (cuda when there is one), cpu or cuda."""
    dtype: str = "auto"
    """Weights' dtype: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16."""
    eod_id: int | None = None
    """A completion ends after this token (None: at max_new_tokens)."""
    cuda_graphs: bool = True
    """On CUDA, replay each decode step as a captured CUDA graph (--no-cuda-graphs: eager)."""
    max_prompts: int = 256
    """Most prompts in one request."""
    max_prompt_tokens: int = 4096
    """Longest prompt."""
    max_group_size: int = 64
    """Most completions of one prompt."""
    max_new_tokens: int = 4096
    """Most tokens sampled per completion."""
    max_completions: int = 4096
    """Most completions (prompts x group size) in one request."""
    max_batch_rows: int = 64
    """Completions decoded at once."""
    max_wait_s: float = 60.0
    """Longest a request waits for weights of its min_version."""
    max_chunk_mb: float = 4.0
    """Largest weight chunk (and prompt message) accepted."""
    max_streams: int = 8
    """Concurrent RPCs."""
    grace: float = 5.0
    """Seconds granted on SIGTERM."""
    token_file: str | None = None
    """Bearer tokens callers must send (Generate/Describe: read; UpdateWeights and
    LoadCheckpoint: write)."""
    tls_cert: str | None = None
    """PEM certificate the server presents (turns TLS on)."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: str | None = None
    """PEM CA that must have signed client certificates (mutual TLS)."""
    insecure: bool = False
    """Serve an address other than loopback without authentication."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        for name in (
            "max_prompts",
            "max_prompt_tokens",
            "max_group_size",
            "max_new_tokens",
            "max_completions",
            "max_batch_rows",
            "max_streams",
        ):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_wait_s <= 3600:
            raise ConfigError(f"--max-wait-s must be in [0, 3600], got {self.max_wait_s}")
        if not 0 < self.max_chunk_mb <= 256:
            raise ConfigError(f"--max-chunk-mb must be in (0, 256], got {self.max_chunk_mb}")
        if self.eod_id is not None and self.eod_id < 0:
            raise ConfigError(f"--eod-id must be >= 0, got {self.eod_id}")
        if self.step is not None and self.step < 0:
            raise ConfigError(f"--step must be >= 0, got {self.step}")
        if self.version is not None and self.version < 0:
            raise ConfigError(f"--version must be >= 0, got {self.version}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        """From the flags `add_serve_arguments` defines."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `meshtrain rollout serve`, one per `ServeConfig` field."""
    d = ServeConfig(load="")
    p.add_argument("--load", required=True, metavar="ROOT", help="checkpoint root of the policy")
    p.add_argument("--step", type=int, default=None, help="step to start from (default: newest)")
    p.add_argument(
        "--checkpoint-root",
        default=None,
        metavar="ROOT",
        help="root LoadCheckpoint reads published steps from (default: --load)",
    )
    p.add_argument(
        "--version",
        type=int,
        default=None,
        help="policy version of the loaded weights (default: the step; 0 for a GRPO run that "
        "starts from another run's checkpoint)",
    )
    p.add_argument("--port", type=int, default=0, help="TCP port (0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    p.add_argument("--eod-id", type=int, default=None, help="a completion ends after this token")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=d.cuda_graphs,
        help="on CUDA, replay each decode step as a captured CUDA graph (default: on)",
    )
    for name in (
        "max_prompts",
        "max_prompt_tokens",
        "max_group_size",
        "max_new_tokens",
        "max_completions",
        "max_batch_rows",
        "max_streams",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--max-wait-s", type=float, default=d.max_wait_s)
    p.add_argument("--max-chunk-mb", type=float, default=d.max_chunk_mb)
    p.add_argument("--grace", type=float, default=d.grace, help="seconds granted on SIGTERM")
    add_server_arguments(p)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message}")


def check_serve_arguments(argv: list[str], owned: dict[str, str], prog: str) -> ServeConfig:
    """`argv` (flags of `meshtrain rollout serve`, without `--load`) checked as the worker will
    parse them, before any process starts; a flag of `owned` (flag: why) is refused.

    Raises:
        ConfigError: an unknown, abbreviated, owned or bad flag or value, naming it.
    """
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise ConfigError(f"{prog}: {flag} is set by the launcher itself: {owned[flag]}")
    # No abbreviations: `--check` would otherwise pass here unseen and set --checkpoint-root there.
    p = _Parser(prog=prog, allow_abbrev=False, add_help=False)
    add_serve_arguments(p)
    try:
        return ServeConfig.from_args(p.parse_args(["--load", "", *argv]))
    except ConfigError as e:
        if str(e).startswith(prog):
            raise
        raise ConfigError(f"{prog}: {e}") from None
