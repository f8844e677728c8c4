"""Fuzzing the DataService: thousands of malformed, truncated, oversized and out-of-range requests
to a real worker process on loopback (see tests/fuzz_utils.py for the generators).

Each request is a valid StreamRequest with one to three fields (at any depth: the dataset spec's
prefixes, weights, sizes, seed, split) set to edge values, a half-filled random one, or bytes that
do not parse. The worker must answer every one with a status that names the request's fault
(INVALID_ARGUMENT, ...) or a condition (UNAVAILABLE, DEADLINE_EXCEEDED), never UNKNOWN or INTERNAL;
log no handler exception; stay SERVING; keep its memory (the index builds a request may ask for are
bounded by `--max-index-gib`, set small here so the bound is what is tested); write nothing but its
index cache; and serve a well-behaved client the same micro-batches as the in-process
`LocalBatchSource`, bit for bit, throughout.
"""

import itertools
import os
import random
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
from meshtrain.services.dataloader.loader import LocalBatchSource
from meshtrain.services.dataloader.rpc.servicer import SERVICE_NAME, spec_to_proto
from meshtrain.services.dataloader.spec import DatasetSpec, open_dataset
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
from tests.services.dataloader.conftest import write_dataset

HEALTH_EVERY = 100  # calls between health probes
CLIENT_EVERY = 50  # calls between the well-behaved client's checks
RSS_GROWTH_LIMIT = 200 << 20
TOKEN = (
    "fuzz-token-0123456789abcdef"  # with `auth`, the worker's ($MESHTRAIN_TOKEN); calls carry it
)


def prefix_variants(prefix: str) -> list[str]:
    """Spellings near a real dataset prefix: other files, the folder, other schemes,
    junk after it."""
    folder, name = os.path.split(prefix)
    return [
        prefix + "\n",
        prefix + "\x00",
        prefix + "/",
        prefix + ".idx",
        prefix + ".bin",
        folder,
        folder + "/",
        os.path.join(folder, "..", os.path.basename(folder), name),
        f"file://{prefix}",
        f"FILE://{prefix}",
        f"file://{prefix}?x=1#y",
        f"memory://{prefix}",
        f"s3://fuzz-bucket{prefix}",
        f"gs://fuzz-bucket{prefix}",
        prefix + "*",
        prefix[:-1] + "?",
        os.path.join(folder, ".meshtrain-index", name),
        "~/" + name,
        prefix.replace("/", "//"),
        prefix + " ",
        " " + prefix,
        prefix.upper(),
    ]


def fuzz_data_service(
    fuzzer: Fuzzer,
    rng: random.Random,
    templates: list[pb.StreamRequest],
    prefixes: list[str],
    calls: int,
    good,
) -> None:
    """Sends `calls` fuzzed requests, probing health and the well-behaved client as it goes."""
    variants = [v for p in prefixes for v in prefix_variants(p)]
    while fuzzer.calls < calls:
        method = rng.choice(["Describe", "StreamBatches"])
        template = rng.choice(templates)
        r = rng.random()
        if r < 0.6:
            request = mutate(rng, template)
            if rng.random() < 0.15 and len(request.spec.prefixes):
                request.spec.prefixes[rng.randrange(len(request.spec.prefixes))] = rng.choice(
                    variants
                )
            payload, shown = request.SerializeToString(), request
        elif r < 0.7:
            request = random_message(rng, pb.StreamRequest, fill=rng.choice([0.3, 0.7, 1.0]))
            payload, shown = request.SerializeToString(), request
        else:
            payload = raw_variants(rng, template.SerializeToString())
            shown = payload
        if rng.random() < 0.01:
            method = rng.choice(
                ["Nope", "describe", "StreamBatches/x"]
            )  # not a method of the service
        metadata = rng.choice(AUTH_VARIANTS) if rng.random() < 0.05 else None
        if method == "StreamBatches":
            fuzzer.unary_stream(
                method, payload, max_messages=rng.choice([1, 3]), metadata=metadata, shown=shown
            )
        else:
            fuzzer.unary(method, payload, metadata=metadata, shown=shown)
        fuzzer.periodic_checks(
            HEALTH_EVERY,
            ("", SERVICE_NAME),
            CLIENT_EVERY,
            "the well-behaved client's micro-batch",
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
    """With `auth` the worker requires a bearer token ($MESHTRAIN_TOKEN), which most calls carry
    and some replace by `AUTH_VARIANTS`; without, it is the default loopback worker."""
    if auth:
        monkeypatch.setenv("MESHTRAIN_TOKEN", TOKEN)
    else:
        monkeypatch.delenv("MESHTRAIN_TOKEN", raising=False)
    data = tmp_path / "data"
    data.mkdir()
    a, b = write_dataset(data / "a", 1), write_dataset(data / "b", 2)
    spec = DatasetSpec(
        (a, b), (0.3, 0.7), seq_length=32, num_samples=64 * 16, seed=7, split="98,2,0"
    )
    single = replace(spec, prefixes=(a,), weights=(1.0,), seq_length=16, num_samples=100)
    templates = [
        pb.StreamRequest(
            spec=spec_to_proto(spec),
            dp_rank=1,
            dp_size=2,
            micro_batch_size=2,
            global_batch_size=16,
            start_step=3,
        ),
        pb.StreamRequest(
            spec=spec_to_proto(spec),
            dp_rank=0,
            dp_size=2,
            micro_batch_size=2,
            global_batch_size=16,
            start_step=5,
            start_microbatch=1,
            end_step=9,
            cp_rank=1,
            cp_size=2,
        ),
        pb.StreamRequest(
            spec=spec_to_proto(single), dp_size=1, micro_batch_size=1, global_batch_size=4
        ),
    ]
    # the worker's caches (sample indices), here rather than in the checkout's .cache: the fuzzer's
    # valid specs build hundreds of indices
    cache = tmp_path / "cache"
    # s3:// prefixes go to a closed loopback port (refused at once), not to the internet
    env = {
        "MESHTRAIN_CACHE": str(cache),
        "MESHTRAIN_INDEX_CACHE": str(cache / "index"),
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "fuzz",
        "AWS_SECRET_ACCESS_KEY": "fuzz",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    log = tmp_path / "worker.log"
    repo_before = set(os.listdir(REPO))
    before = tree_snapshot(tmp_path.parent, skip=[data / ".meshtrain-index", cache, log])
    server = ServerProcess(
        "meshtrain.services.dataloader.rpc.server",
        # the data folder, and a bucket whose store refuses at once: both paths stay fuzzed
        [
            *("--port", "0", "--grace", "0", "--max-streams", "8", "--max-index-gib", "0.0625"),
            *("--allow-root", str(data), "--allow-root", "s3://fuzz-bucket"),
        ],
        log,
        env=env,
    )
    fuzzer = Fuzzer(
        server.address,
        SERVICE_NAME,
        timeout_s=2.0,
        metadata=(("authorization", f"Bearer {TOKEN}"),) if auth else (),
    )
    try:
        local = LocalBatchSource(open_dataset(spec, cache=False), 2, 16, 1, 2)
        stub = pb_grpc.DataServiceStub(fuzzer.channel)
        positions = itertools.count()

        def good():
            n = next(positions)
            step, mb = (7 * n) % 64, n % 4
            request = pb.StreamRequest(
                spec=spec_to_proto(spec),
                dp_rank=1,
                dp_size=2,
                micro_batch_size=2,
                global_batch_size=16,
                start_step=step,
                start_microbatch=mb,
                end_step=step + 1,
            )
            got = list(stub.StreamBatches(request, timeout=30, metadata=fuzzer.metadata))
            want = [local.payload(step, m) for m in range(mb, 4)]
            assert [(m.step, m.microbatch) for m in got] == [(step, m) for m in range(mb, 4)]
            for msg, w in zip(got, want, strict=True):
                assert (msg.dtype, tuple(msg.shape)) == (w.dtype.name, w.shape)
                assert msg.samples == w.astype(w.dtype.newbyteorder("<")).tobytes(), (
                    step,
                    msg.microbatch,
                )

        good()  # warm: the real dataset is open and its index built before memory is measured
        rss_before = server.rss()
        fuzz_data_service(fuzzer, random.Random(calls + auth), templates, [a, b], calls, good)
        fuzzer.check_health(("", SERVICE_NAME))
        fuzzer.check("the well-behaved client's micro-batch", good)
        growth = (
            server.rss() - rss_before if server.alive() else 0
        )  # a dead server is reported below
    finally:
        fuzzer.close()
        alive = server.alive()
        server.stop()
    problems = fuzzer.problems()
    problems += log_problems(server.log())
    if not alive:
        problems.append(f"the worker died (exit status {server.proc.returncode})")
    if growth > RSS_GROWTH_LIMIT:
        problems.append(
            f"the worker's RSS grew by {growth / 2**20:.0f} MiB over {fuzzer.calls} calls"
        )
    written = new_files(
        before, tree_snapshot(tmp_path.parent, skip=[data / ".meshtrain-index", cache, log])
    )
    written += [f"{REPO}/{name}" for name in sorted(set(os.listdir(REPO)) - repo_before)]
    if written:
        problems.append(f"files written outside the worker's index cache: {written}")
    index_files = [
        f for f in [*data.rglob("*"), *cache.rglob("*")] if f.is_file() and f.parent.name != "data"
    ]
    print(
        f"\n{fuzzer.calls} calls; RSS growth {growth / 2**20:.1f} MiB; "
        f"index cache: {len(index_files)} files, "
        f"{sum(f.stat().st_size for f in index_files) / 2**20:.1f} MiB\n{fuzzer.table()}"
    )
    assert not problems, "\n".join(problems)
    assert fuzzer.calls >= calls
    assert (
        fuzzer.codes[("StreamBatches", grpc.StatusCode.OK.name)] > 0
    )  # some fuzzed requests were valid


SOAK_WARMUP_CALLS = 4_000
SOAK_GROWTH_LIMIT = 32 << 20


def rss_anon(pid: int) -> int:
    """Anonymous resident memory of a process (RssAnon of /proc/PID/status): the heap, without
    the memory-mapped datasets and cached indices, which the kernel may keep or drop."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for process {pid}")


@pytest.mark.slow
def test_a_worker_s_memory_stays_bounded_over_a_long_fuzz(tmp_path, calls=24_000):
    """A worker's anonymous memory after warm-up grows by less than 32 MiB over 20,000 more
    fuzzed calls. Warm-up (`SOAK_WARMUP_CALLS`) covers what a worker loads once: gRPC's and
    fsspec/botocore's modules and clients (the first s3:// prefix), the LRU of opened datasets
    filling to its 8 entries and the allocator's arenas of its 8 stream threads. After that,
    every cache keyed by request content is bounded (datasets by count and index bytes, indices
    on disk by quota), so what is left is allocator noise, a few MiB: 32 MiB is far above it
    and far below one leaked dataset or index per distinct request (the 200 MiB that the
    reviewed 6,400-call run grew by)."""
    data = tmp_path / "data"
    data.mkdir()
    a, b = write_dataset(data / "a", 1), write_dataset(data / "b", 2)
    spec = DatasetSpec(
        (a, b), (0.3, 0.7), seq_length=32, num_samples=64 * 16, seed=7, split="98,2,0"
    )
    template = pb.StreamRequest(
        spec=spec_to_proto(spec), dp_rank=1, dp_size=2, micro_batch_size=2, global_batch_size=16
    )
    cache = tmp_path / "cache"
    env = {
        "MESHTRAIN_CACHE": str(cache),
        "MESHTRAIN_INDEX_CACHE": str(cache / "index"),
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # a closed port: refused at once
        "AWS_ACCESS_KEY_ID": "fuzz",
        "AWS_SECRET_ACCESS_KEY": "fuzz",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    server = ServerProcess(
        "meshtrain.services.dataloader.rpc.server",
        [
            *("--port", "0", "--grace", "0", "--max-streams", "8", "--max-index-gib", "0.0625"),
            *("--allow-root", str(data), "--allow-root", "s3://fuzz-bucket"),
        ],
        tmp_path / "worker.log",
        env=env,
    )
    fuzzer = Fuzzer(server.address, SERVICE_NAME, timeout_s=2.0)
    rng = random.Random(calls)
    try:
        fuzz_data_service(fuzzer, rng, [template], [a, b], SOAK_WARMUP_CALLS, lambda: None)
        before = rss_anon(server.pid)
        fuzz_data_service(fuzzer, rng, [template], [a, b], calls, lambda: None)
        growth = rss_anon(server.pid) - before
    finally:
        fuzzer.close()
        server.stop()
    print(
        f"\nRssAnon after {SOAK_WARMUP_CALLS} calls: {before / 2**20:.1f} MiB; "
        f"+{growth / 2**20:.1f}"
    )
    assert calls - SOAK_WARMUP_CALLS >= 20_000
    assert not fuzzer.problems(), "\n".join(fuzzer.problems())
    assert growth < SOAK_GROWTH_LIMIT, (
        f"RssAnon grew by {growth / 2**20:.1f} MiB over {fuzzer.calls - SOAK_WARMUP_CALLS} calls"
    )
