"""Fuzzing the trainer's control endpoint: thousands of malformed requests and odd run tokens
to Status, Checkpoint and Stop of a real `Trainer`'s endpoint in this process (its loop not
running: the endpoint only reads progress and sets request flags), before and after the loop
has ended (when Checkpoint and Stop are refused). Generators in tests/fuzz_utils.py.

Its messages have no fields, so what a client controls is the bytes (unknown fields, malformed
wire data) and the `meshtrain-run` token in the metadata. Every call must get a status that
names its fault or a condition, never UNKNOWN or INTERNAL; no handler exception may be logged;
the endpoint stays SERVING, this process's memory flat, and a well-behaved `ControlClient`
(through RUN_DIR/control.addr, with the run's token) gets its Status throughout.
"""

import contextlib
import logging
import random
import threading

import grpc
import pytest

from meshtrain.protos.trainer.v1 import trainer_pb2 as pb
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.rpc.client import RUN_TOKEN_KEY, ControlClient
from meshtrain.services.trainer.rpc.server import serve_control
from meshtrain.services.trainer.rpc.servicer import SERVICE_NAME
from meshtrain.services.trainer.train import Trainer
from tests import fuzz_utils
from tests.fuzz_utils import (
    AUTH_VARIANTS,
    LOG_MARKERS,
    Fuzzer,
    grouped,
    random_message,
    raw_variants,
    rss_bytes,
)
from tests.services.trainer.conftest import small_job_args

HEALTH_EVERY = 100
CLIENT_EVERY = 50
RSS_GROWTH_LIMIT = 200 << 20
TOKEN = "fuzz-token-0123456789abcdef"  # with `auth`, the endpoint's bearer token ($MESHTRAIN_TOKEN)
METHODS = {"Status": pb.StatusRequest, "Checkpoint": pb.CheckpointRequest, "Stop": pb.StopRequest}


class _Records(logging.Handler):
    """Keeps the log records that report an exception (gRPC's "Exception calling application",
    a traceback) from the loggers it is added to."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.found: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if fuzz_utils.UNPARSED_INTERNAL_OK and any(m in text for m in fuzz_utils.UNPARSED_LOGGED):
            return
        if record.exc_info or any(m in text for m in LOG_MARKERS):
            self.found.append(
                f"{record.name}: {text[:300]}"
                + (
                    f" ({record.exc_info[0].__name__}: {record.exc_info[1]})"
                    if record.exc_info
                    else ""
                )
            )


@contextlib.contextmanager
def exceptions_logged():
    """The handler-exception reports of the "grpc" and "meshtrain" loggers, and exceptions that
    ended a thread, while inside."""
    handler = _Records()
    loggers = [logging.getLogger("grpc"), logging.getLogger("meshtrain")]
    for lg in loggers:
        lg.addHandler(handler)
    previous = threading.excepthook
    threading.excepthook = lambda args: handler.found.append(
        f"thread {args.thread.name if args.thread else '?'}: "
        f"{args.exc_type.__name__}: {args.exc_value}"
    )
    try:
        yield handler.found
    finally:
        threading.excepthook = previous
        for lg in loggers:
            lg.removeHandler(handler)


def token_variants(token: str) -> list[tuple[tuple[str, str | bytes | None], ...]]:
    """Run tokens a client may send instead of the run's: none (None drops the fuzzer's), another
    run's, malformed, long, repeated, under a binary key."""
    return [
        ((RUN_TOKEN_KEY, None),),
        ((RUN_TOKEN_KEY, "0" * len(token)),),
        ((RUN_TOKEN_KEY, ""),),
        ((RUN_TOKEN_KEY, token.upper()),),
        ((RUN_TOKEN_KEY, token + " "),),
        ((RUN_TOKEN_KEY, token[:-1]),),
        ((RUN_TOKEN_KEY, "x" * 4000),),
        ((RUN_TOKEN_KEY, "%00"),),
        ((RUN_TOKEN_KEY, "../../etc"),),
        ((RUN_TOKEN_KEY, token), (RUN_TOKEN_KEY, "0" * len(token))),
        ((RUN_TOKEN_KEY, "0" * len(token)), (RUN_TOKEN_KEY, token)),
        ((RUN_TOKEN_KEY, None), (RUN_TOKEN_KEY + "-bin", b"\x00\xff" * 8)),
        ((RUN_TOKEN_KEY, None), ("meshtrain-run-x", token)),
    ]


def fuzz_control(fuzzer: Fuzzer, rng: random.Random, calls: int, token: str, good) -> None:
    variants = token_variants(token)
    while fuzzer.calls < calls:
        method = rng.choice(list(METHODS))
        r = rng.random()
        if r < 0.3:
            payload = b""  # the valid request
        elif r < 0.4:
            payload = random_message(rng, METHODS[method]).SerializeToString()
        else:
            # unknown fields (well formed) or malformed bytes
            payload = raw_variants(
                rng, rng.choice([b"", b"\x08\x01", b"\x12\x03abc", b"\x19" + b"\x00" * 8])
            )
        r = rng.random()
        if r < 0.002:  # headers over gRPC's 8 KiB limit: the connection is reset (slow), so rarely
            metadata = ((RUN_TOKEN_KEY, "x" * 20_000),)
        elif r < 0.25:
            metadata = rng.choice(variants)
        elif r < 0.35:
            metadata = rng.choice(AUTH_VARIANTS)
        else:
            metadata = None  # the fuzzer's own: the run token (and the bearer token, with auth)
        if rng.random() < 0.01:
            method = rng.choice(["Nope", "status", "Stop/x"])
        fuzzer.unary(method, payload, metadata=metadata)
        fuzzer.periodic_checks(
            HEALTH_EVERY, ("", SERVICE_NAME), CLIENT_EVERY, "the well-behaved client's Status", good
        )


@pytest.mark.parametrize(
    "calls,auth",
    [
        (2_000, True),
        pytest.param(20_000, False, marks=pytest.mark.slow),
        pytest.param(20_000, True, marks=pytest.mark.slow),
    ],
)
def test_fuzzed_control_requests_are_refused_cleanly_and_status_keeps_working(
    corpus_cache, tmp_path, monkeypatch, calls, auth
):
    """With `auth` the endpoint also requires a bearer token ($MESHTRAIN_TOKEN, which the client
    reads too), which most calls carry and some replace by `AUTH_VARIANTS`."""
    if auth:
        monkeypatch.setenv("MESHTRAIN_TOKEN", TOKEN)
    else:
        monkeypatch.delenv("MESHTRAIN_TOKEN", raising=False)
    run_dir = tmp_path / "run"
    trainer = Trainer(
        load_config(small_job_args(corpus_cache, run_dir, **{"train.train_iters": 10}))
    )
    endpoint = serve_control(trainer, 0, metrics_port=None)
    token = (run_dir / "control.addr").read_text().split()[1]
    fuzzer = Fuzzer(
        endpoint.address,
        SERVICE_NAME,
        timeout_s=2.0,
        metadata=((RUN_TOKEN_KEY, token),)
        + ((("authorization", f"Bearer {TOKEN}"),) if auth else ()),
    )
    client = ControlClient(str(run_dir))

    def good():
        status = client.status()
        assert (status["step"], status["train_iters"]) == (0, 10), status

    try:
        with exceptions_logged() as logged:
            good()
            rss_before = rss_bytes()
            rng = random.Random(calls + auth)
            fuzz_control(fuzzer, rng, calls // 2, token, good)  # the loop may still act on requests
            trainer.requests.end()  # then as after the loop returned: Checkpoint and Stop refused
            fuzz_control(fuzzer, rng, calls, token, good)
            fuzzer.check_health(("", SERVICE_NAME))
            fuzzer.check("the well-behaved client's Status", good)
            growth = rss_bytes() - rss_before
    finally:
        trainer.requests.end()  # disarms the stack dump a stop request arms
        client.close()
        fuzzer.close()
        endpoint.stop()
    problems = fuzzer.problems() + grouped(logged, "this process's log")
    if growth > RSS_GROWTH_LIMIT:
        problems.append(
            f"this process's RSS grew by {growth / 2**20:.0f} MiB over {fuzzer.calls} calls"
        )
    print(f"\n{fuzzer.calls} calls; RSS growth {growth / 2**20:.1f} MiB\n{fuzzer.table()}")
    assert not problems, "\n".join(problems)
    assert fuzzer.calls >= calls
    assert fuzzer.codes[("Status", grpc.StatusCode.OK.name)] > 0
