"""Fuzzing the CheckpointService: thousands of malformed, truncated, oversized and out-of-range
requests to every RPC of a real service process on loopback (generators in tests/fuzz_utils.py).

The fuzzer keeps real save ids (from BeginSave calls of its own steps), so its mutations reach
past the id checks: WriteShards streams whose header, boxes and chunks are valid but for one
field or one message (dropped, repeated, reordered, malformed), commits with odd timeouts and
metadata, reads of odd slices of a committed checkpoint, deletes and retention with edge numbers.
The service must answer every request with a status that names its fault or a condition, never
UNKNOWN or INTERNAL; log no handler exception; stay SERVING; keep its memory; write nothing
outside its root; and serve a well-behaved client's save -> commit -> load, bit for bit,
before, during and after.
"""

import itertools
import os
import random

import grpc
import pytest
import torch

from meshtrain.protos.checkpoint.v1 import checkpoint_pb2 as pb
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.rpc.client import CheckpointClient, box_to_pb
from meshtrain.services.checkpoint.rpc.servicer import SERVICE_NAME
from tests.fuzz_utils import (
    AUTH_VARIANTS,
    REPO,
    Fuzzer,
    ServerProcess,
    log_problems,
    mutate,
    new_files,
    random_message,
    raw_variants,
    tree_snapshot,
)

HEALTH_EVERY = 100
CLIENT_EVERY = 100  # calls between the well-behaved client's save -> commit -> load
RSS_GROWTH_LIMIT = 200 << 20
GOOD_STEP = 900_001  # the well-behaved client's; the fuzzer's templates use FUZZ_STEPS
FUZZ_STEPS = [0, 1, 2, 5]
TOKEN = (
    "fuzz-token-0123456789abcdef"  # with `auth`, the service's ($MESHTRAIN_TOKEN); calls carry it
)

# Valid boxes (and their bytes) the WriteShards templates start from.
BOXES = [
    (ShardSpec("fuzz.a", (4,), "float32", (0,), (4,)), 16),
    (ShardSpec("layers.fuzz.w", (2, 3), "bfloat16", (1, 0), (1, 3), stacked=True), 6),
    (ShardSpec("fuzz.scalar", (), "int64", (), ()), 8),
    (ShardSpec("fuzz.edge", (5,), "uint8", (4,), (1,), grid=(2,)), 1),
    (ShardSpec("fuzz.empty", (3, 0), "float32", (0, 0), (3, 0)), 0),
]
JSON_TEXTS = [
    '{"a": NaN}',
    '{"a": Infinity}',
    '{"a": 1e999}',
    "[" * 50_000 + "]" * 50_000,
    '{"a":' * 20_000 + "1" + "}" * 20_000,
    '{"a": "\\ud800"}',
    '{"\\u0000": 1}',
    '{"a": 1, "a": 2}',
    '{"a": ' + "9" * 5000 + "}",
    '"text"',
    "null",
    "{}",
    " {} ",
    '{"a": [1, {"b": null}]}',
    "{" + ", ".join(f'"k{i}": {i}' for i in range(20_000)) + "}",
]


class FuzzState:
    """The saves the fuzzer began, so that its requests name live saves (and some ended ones)."""

    def __init__(self):
        self.live: list[tuple[str, int, int]] = []  # (save id, step, num_writers)
        self.ended: list[tuple[str, int, int]] = []

    def begun(self, response: bytes, request: pb.BeginSaveRequest) -> None:
        for save in [s for s in self.live if s[1] == request.step]:  # superseded by this one
            self.end(save[0])
        self.live.append(
            (pb.BeginSaveResponse.FromString(response).save_id, request.step, request.num_writers)
        )
        del self.live[:-8]

    def end(self, save_id: str) -> None:
        for save in [s for s in self.live if s[0] == save_id]:
            self.live.remove(save)
            self.ended = [*self.ended[-7:], save]

    def save(self, rng: random.Random) -> tuple[str, int, int]:
        r = rng.random()
        if self.live and r < 0.8:
            return rng.choice(self.live)
        if self.ended and r < 0.9:
            return rng.choice(self.ended)
        return rng.choice(["0" * 32, "nope", "feedbeef"]), rng.choice(FUZZ_STEPS), 1


def write_stream(rng: random.Random, state: FuzzState) -> list[pb.WriteShardsRequest]:
    """A valid WriteShards stream of one writer of a save: header, then 1-2 boxes in chunks."""
    save_id, _, num_writers = state.save(rng)
    writer_id = rng.randrange(min(max(num_writers, 1), 4))
    messages = [pb.WriteShardsRequest(header=pb.WriteHeader(save_id=save_id, writer_id=writer_id))]
    for spec, nbytes in rng.sample(BOXES, rng.choice([1, 1, 2])):
        messages.append(pb.WriteShardsRequest(box=box_to_pb(spec)))
        data = bytes(rng.getrandbits(8) for _ in range(nbytes))
        cut = rng.randint(0, nbytes)
        messages += [pb.WriteShardsRequest(chunk=part) for part in (data[:cut], data[cut:]) if part]
    return messages


def fuzz_stream(
    rng: random.Random, messages: list[pb.WriteShardsRequest]
) -> tuple[list[bytes], list]:
    """One change to a WriteShards stream: a message mutated or malformed, dropped, repeated,
    moved, or added; returns (payloads, what to show in a report)."""
    shown = list(messages)
    payloads = [m.SerializeToString() for m in messages]
    i = rng.randrange(len(messages))
    r = rng.random()
    if r < 0.45:
        shown[i] = mutate(rng, messages[i])
        payloads[i] = shown[i].SerializeToString()
    elif r < 0.55:
        payloads[i] = shown[i] = raw_variants(rng, payloads[i])
    elif r < 0.65:
        del payloads[i], shown[i]
    elif r < 0.72:
        payloads.insert(i, payloads[i])
        shown.insert(i, shown[i])
    elif r < 0.8:
        j = rng.randrange(len(messages))
        payloads[i], payloads[j], shown[i], shown[j] = payloads[j], payloads[i], shown[j], shown[i]
    elif r < 0.9:
        extra = random_message(rng, pb.WriteShardsRequest, fill=0.7)
        payloads.insert(i + 1, extra.SerializeToString())
        shown.insert(i + 1, extra)
    else:  # many small chunks
        n = rng.choice([100, 1000])
        payloads += [pb.WriteShardsRequest(chunk=b"\x00").SerializeToString()] * n
        shown.append(f"... {n} chunks of 1 byte")
    return payloads, shown


def unary_template(rng: random.Random, method: str, state: FuzzState):
    """A valid request of a unary method (or ReadSlice), naming the fuzzer's saves and steps."""
    save_id, step, num_writers = state.save(rng)
    if method == "BeginSave":
        return pb.BeginSaveRequest(
            step=rng.choice(FUZZ_STEPS),
            num_writers=rng.choice([1, 1, 1, 2]),
            overwrite=rng.random() < 0.3,
        )
    if method == "Commit":
        return pb.CommitRequest(save_id=save_id, metadata_json='{"k": 1}', timeout_s=0.3, step=step)
    if method == "AbortSave":
        return pb.AbortSaveRequest(save_id=save_id, reason="fuzz")
    if method == "ResumeSave":
        return pb.ResumeSaveRequest(save_id=save_id, step=step, num_writers=num_writers)
    if method == "List":
        return pb.ListRequest()
    if method == "Describe":
        return pb.DescribeRequest(step=rng.choice([GOOD_STEP, *FUZZ_STEPS]))
    if method == "ReadSlice":
        return pb.ReadSliceRequest(step=GOOD_STEP, array="good.w", offsets=[1, 0], shape=[2, 3])
    if method == "Delete":
        return pb.DeleteRequest(step=rng.choice(FUZZ_STEPS))
    if method == "ApplyRetention":
        return pb.RetentionRequest(keep_last=3, keep_every=rng.choice([0, 2]))
    raise AssertionError(method)


UNARY = [
    "BeginSave",
    "Commit",
    "AbortSave",
    "ResumeSave",
    "List",
    "Describe",
    "ReadSlice",
    "Delete",
    "ApplyRetention",
]


def fuzz_checkpoint_service(fuzzer: Fuzzer, rng: random.Random, calls: int, good) -> None:
    state = FuzzState()
    while fuzzer.calls < calls:
        if (
            rng.random() < 0.05 or not state.live
        ):  # a real save of the fuzzer's, for the others to name
            request = unary_template(rng, "BeginSave", state)
            if (
                fuzzer.unary("BeginSave", request.SerializeToString(), shown=request)
                == grpc.StatusCode.OK
            ):
                state.begun(fuzzer.last_response, request)
        elif rng.random() < 0.4:
            messages = write_stream(rng, state)
            if rng.random() < 0.15:  # a valid stream, so that commits find fragments to check
                payloads, shown = [m.SerializeToString() for m in messages], messages
            else:
                payloads, shown = fuzz_stream(rng, messages)
            metadata = rng.choice(AUTH_VARIANTS) if rng.random() < 0.05 else None
            fuzzer.stream_unary("WriteShards", payloads, metadata=metadata, shown=shown)
        else:
            method = rng.choice(UNARY)
            template = unary_template(rng, method, state)
            r = rng.random()
            if r < 0.65:
                request = mutate(rng, template)
                if method == "Commit" and rng.random() < 0.2:
                    request.metadata_json = rng.choice(JSON_TEXTS)
                payload, shown = request.SerializeToString(), request
            elif r < 0.75:
                request = random_message(rng, type(template), fill=rng.choice([0.3, 0.7, 1.0]))
                payload, shown = request.SerializeToString(), request
            elif r < 0.8:
                payload, shown = template.SerializeToString(), template
            else:
                payload = shown = raw_variants(rng, template.SerializeToString())
            if rng.random() < 0.01:
                method = rng.choice(["Nope", "commit", "Commit/x"])
            metadata = rng.choice(AUTH_VARIANTS) if rng.random() < 0.05 else None
            if method == "ReadSlice":
                fuzzer.unary_stream(
                    method, payload, max_messages=rng.choice([1, 3]), metadata=metadata, shown=shown
                )
            elif (
                fuzzer.unary(method, payload, metadata=metadata, shown=shown) == grpc.StatusCode.OK
                and method == "BeginSave"
            ):
                state.begun(
                    fuzzer.last_response, pb.BeginSaveRequest.FromString(payload)
                )  # begun, though odd
            elif method == "Commit" and isinstance(shown, pb.CommitRequest):
                state.end(shown.save_id)
        fuzzer.periodic_checks(
            HEALTH_EVERY,
            ("", SERVICE_NAME),
            CLIENT_EVERY,
            "the well-behaved client's save -> commit -> load",
            good,
        )


pytestmark = pytest.mark.e2e  # a real server process per test


@pytest.mark.parametrize(
    "calls,auth",
    [
        (2_000, True),
        pytest.param(20_000, False, marks=pytest.mark.slow),
        pytest.param(20_000, True, marks=pytest.mark.slow),
    ],
)
def test_fuzzed_requests_are_refused_cleanly_and_good_clients_are_served(
    tmp_path, monkeypatch, calls, auth
):
    """With `auth` the service requires a bearer token ($MESHTRAIN_TOKEN, which its client reads
    too), which most calls carry and some replace by `AUTH_VARIANTS`; without, it is the default
    loopback service."""
    if auth:
        monkeypatch.setenv("MESHTRAIN_TOKEN", TOKEN)
    else:
        monkeypatch.delenv("MESHTRAIN_TOKEN", raising=False)
    root = tmp_path / "ckpt"
    log = tmp_path / "service.log"
    repo_before = set(os.listdir(REPO))
    before = tree_snapshot(tmp_path.parent, skip=[root, log])
    # short commit and idle timeouts and small chunks: the fuzzer's 2 s deadlines outlast them
    server = ServerProcess(
        "meshtrain.services.checkpoint.rpc.server",
        [
            str(root),
            "--port",
            "0",
            "--grace",
            "0",
            "--max-streams",
            "8",
            "--commit-timeout",
            "1",
            "--max-chunk-mb",
            "0.0625",
            "--max-inflight-mb",
            "64",
            "--stream-idle-timeout",
            "2",
        ],
        log,
    )
    fuzzer = Fuzzer(
        server.address,
        SERVICE_NAME,
        timeout_s=2.0,
        metadata=(("authorization", f"Bearer {TOKEN}"),) if auth else (),
    )
    client = CheckpointClient(server.address)
    try:
        rounds = itertools.count()

        def good():
            n = next(rounds)
            data = torch.arange(12, dtype=torch.float32).reshape(4, 3) * (n + 1)
            save_id = client.begin_save(GOOD_STEP, num_writers=1, overwrite=True)
            writer = client.writer(GOOD_STEP, save_id, 0, 1)
            writer.write(ShardSpec("good.w", (4, 3), "float32", (0, 0), (4, 3)), data)
            writer.finish()
            assert client.commit(GOOD_STEP, save_id, 1, {"round": n}).step == GOOD_STEP
            assert torch.equal(client.read_box(GOOD_STEP, "good.w", (1, 0), (2, 3)), data[1:3])
            assert client.describe(GOOD_STEP)["metadata"] == {"round": n}

        assert fuzzer.check("the well-behaved client's save -> commit -> load", good)
        rss_before = server.rss()
        fuzz_checkpoint_service(fuzzer, random.Random(calls + auth), calls, good)
        fuzzer.check_health(("", SERVICE_NAME))
        fuzzer.check("the well-behaved client's save -> commit -> load", good)
        growth = (
            server.rss() - rss_before if server.alive() else 0
        )  # a dead server is reported below
    finally:
        client.close()
        fuzzer.close()
        alive = server.alive()
        server.stop()
    problems = fuzzer.problems() + log_problems(server.log())
    if not alive:
        problems.append(f"the service died (exit status {server.proc.returncode})")
    if growth > RSS_GROWTH_LIMIT:
        problems.append(
            f"the service's RSS grew by {growth / 2**20:.0f} MiB over {fuzzer.calls} calls"
        )
    written = new_files(before, tree_snapshot(tmp_path.parent, skip=[root, log]))
    written += [f"{REPO}/{name}" for name in sorted(set(os.listdir(REPO)) - repo_before)]
    if written:
        problems.append(f"files written outside the service's root: {written}")
    print(f"\n{fuzzer.calls} calls; RSS growth {growth / 2**20:.1f} MiB\n{fuzzer.table()}")
    assert not problems, "\n".join(problems)
    assert fuzzer.calls >= calls
    assert fuzzer.codes[("WriteShards", grpc.StatusCode.OK.name)] > 0  # some streams were stored
