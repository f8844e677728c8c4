"""Dataloader benchmarks: tokenization, index build, gRPC stream throughput, trainer wait.

Each part prints a short table and everything goes into one JSON file. Baselines come from
the same run: tokenization scaling is against 1 worker, streaming against reading the same
micro-batches in-process, the trainer's wait against the in-process loader.

    python benchmarks/dataloader_bench.py --out benchmarks/results/dataloader.json
    python benchmarks/dataloader_bench.py --parts stream --stream-workers 1 2 4

Parts: tokenize (tokens/s with 1..N preprocess workers, HF BPE with the Rust thread pool
off, so one worker is one core), index (10 M samples blended over 10 datasets, cold build and
cached load), stream (MB/s and micro-batches/s per worker process on loopback, one client
per worker), ranks (samples/s that 1 and 2 workers deliver to 8 data-parallel ranks through
the trainer's own client, spread over the workers, against the same ranks in-process), wait
(a simulated trainer step of fixed compute time: how long each step waits
for its batches, in-process vs through the service).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one worker process = one core

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshtrain.services.dataloader.indexed import IndexedDataset, IndexedDatasetWriter  # noqa: E402 (after the sys.path entry)
from meshtrain.services.dataloader.loader import LocalBatchSource  # noqa: E402 (after the sys.path entry)
from meshtrain.services.dataloader.spec import DatasetSpec, open_dataset  # noqa: E402 (after the sys.path entry)


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths)))


def hf_bpe_to_tiktoken(hf_json: Path, out: Path) -> Path:
    """Write a byte-level BPE `tokenizer.json` as a tiktoken ranks file (same merges, by id).

    Byte-level BPE spells each byte as a printable character (GPT-2's byte-to-unicode table:
    printable Latin-1 bytes stand for themselves, the other 68 bytes map to U+0100 onward, in
    byte order); undoing that gives each token's bytes, and ids are merge order, so they serve
    as tiktoken ranks.
    """
    import base64

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_to_byte = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_to_byte.values():
            char_to_byte[chr(256 + extra)] = b
            extra += 1
    vocab = json.loads(hf_json.read_text())["model"]["vocab"]
    lines, seen = [], set()
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if any(ch not in char_to_byte for ch in token):
            continue  # special tokens
        raw = bytes(char_to_byte[ch] for ch in token)
        if raw not in seen:
            seen.add(raw)
            lines.append(f"{base64.b64encode(raw).decode()} {len(lines)}")
    out.write_text("\n".join(lines) + "\n")
    return out


def bench_tokenize(work: Path, corpus_mb: float, workers_list: list[int]) -> dict:
    from meshtrain.services.dataloader.preprocess import default_corpus_files, preprocess_files
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer, train_bpe

    files = default_corpus_files(int(corpus_mb * 1e6))
    jsonl = work / "corpus.jsonl"
    with open(jsonl, "w") as f:
        for p in files:
            f.write(json.dumps({"text": p.read_text(errors="replace")}) + "\n")
    hf = train_bpe(files[: max(1, len(files) // 4)], 8192, work / "tok.json")
    tiktoken_file = hf_bpe_to_tiktoken(work / "tok.json", work / "tok.tiktoken")
    out = []
    for name, tok in (("hf-bpe", hf), ("tiktoken", build_tokenizer(str(tiktoken_file)))):
        for w in workers_list:
            t = time.perf_counter()
            prefix = preprocess_files([jsonl], work / f"{name}{w}", tok, workers=w)
            dt = time.perf_counter() - t
            n = IndexedDataset(prefix).num_tokens
            out.append(
                {
                    "tokenizer": name,
                    "workers": w,
                    "tokens": n,
                    "seconds": dt,
                    "tokens_per_s": n / dt,
                    "tokens_per_s_per_worker": n / dt / w,
                }
            )
    rows = []
    for r in out:
        base = next(x["tokens_per_s"] for x in out if x["tokenizer"] == r["tokenizer"])
        rows.append(
            [
                r["tokenizer"],
                r["workers"],
                f"{r['tokens']:,}",
                f"{r['seconds']:.2f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s_per_worker']:,.0f}",
                f"{r['tokens_per_s'] / base:.2f}x",
            ]
        )
    table(
        f"tokenize ({jsonl.stat().st_size / 1e6:.0f} MB of stdlib source as JSONL, "
        "BPE 8192, end to end)",
        ["tokenizer", "workers", "tokens", "s", "tokens/s", "per worker", "vs 1"],
        rows,
    )
    return {"corpus_bytes": jsonl.stat().st_size, "runs": out}


def _synthetic(path: Path, seed: int, docs: int, mean_len: int, vocab: int = 50000) -> str:
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, np.uint16) as w:
        for n in rng.integers(1, 2 * mean_len, size=docs):
            w.add_document(rng.integers(0, vocab, size=int(n), dtype=np.uint16))
    return str(path)


def bench_index(work: Path, num_samples: int, seq_length: int) -> dict:
    prefixes = [_synthetic(work / f"ix{i}", i, docs=20_000, mean_len=200) for i in range(10)]
    weights = tuple(float(w) for w in np.arange(1, 11))
    spec = DatasetSpec(tuple(prefixes), weights, seq_length, num_samples, seed=1234, split="1")
    t = time.perf_counter()
    open_dataset(spec, cache=False)
    cold = time.perf_counter() - t
    open_dataset(spec, cache=True)  # writes the cache
    t = time.perf_counter()
    ds = open_dataset(spec, cache=True)
    warm = time.perf_counter() - t
    table(
        f"index build: {num_samples:,} samples of {seq_length} over 10 datasets",
        ["cold build s", "cached load s"],
        [[f"{cold:.2f}", f"{warm:.3f}"]],
    )
    assert len(ds) == num_samples
    return {
        "num_samples": num_samples,
        "datasets": 10,
        "seq_length": seq_length,
        "cold_s": cold,
        "cached_s": warm,
    }


def _start_worker(port_file: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        # the worker serves the benchmark's folder, where its datasets are written
        [
            *(sys.executable, "-m", "meshtrain.services.dataloader.rpc.server", "--port", "0"),
            *("--allow-root", str(port_file.parent)),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    return proc, line.split("listening on ", 1)[1].strip()


def bench_stream(
    work: Path, workers_list: list[int], seq_length: int, mbs: int, seconds: float
) -> dict:
    import grpc

    from meshtrain.protos.dataloader.v1 import dataloader_pb2 as pb
    from meshtrain.protos.dataloader.v1 import dataloader_pb2_grpc as pb_grpc
    from meshtrain.services.common.grpc_utils import channel_options
    from meshtrain.services.dataloader.rpc.servicer import spec_to_proto

    prefix = _synthetic(work / "stream", 7, docs=50_000, mean_len=1000)
    gbs = mbs * 8
    spec = DatasetSpec((prefix,), (1.0,), seq_length, num_samples=gbs * 20000, seed=1, split="1")
    ds = open_dataset(spec)  # builds the index cache the workers will load

    # in-process baseline: the same micro-batches read and serialized-free, one thread
    src = LocalBatchSource(ds, mbs, gbs, 0, 1)
    t, n, nbytes = time.perf_counter(), 0, 0
    while time.perf_counter() - t < seconds:
        nbytes += src.samples((n // 8) % src.num_steps, n % 8).nbytes
        n += 1
    local = {
        "mb_per_s": nbytes / (time.perf_counter() - t) / 1e6,
        "batches_per_s": n / (time.perf_counter() - t),
    }

    results = []
    for w in workers_list:
        procs = [_start_worker(work / f"p{i}") for i in range(w)]
        counts = [[0, 0] for _ in range(w)]

        def client(i: int, address: str, stop: threading.Event, w: int, counts: list) -> None:
            stub = pb_grpc.DataServiceStub(
                grpc.insecure_channel(address, options=channel_options())
            )
            req = pb.StreamRequest(
                spec=spec_to_proto(spec),
                dp_rank=i,
                dp_size=w,
                micro_batch_size=mbs,
                global_batch_size=mbs * w * 8,
            )
            call = stub.StreamBatches(req)
            for msg in call:
                counts[i][0] += 1
                counts[i][1] += len(msg.samples)
                if stop.is_set():
                    call.cancel()
                    break

        # the clients share this process: gRPC's C core does the I/O off the GIL and the Python
        # work per message is a few microseconds, so the workers, not the clients, are measured
        stop = threading.Event()
        threads = [
            threading.Thread(target=client, args=(i, addr, stop, w, counts))
            for i, (_, addr) in enumerate(procs)
        ]
        for th in threads:
            th.start()
        time.sleep(min(2.0, seconds / 3))  # warm-up: index load, connection
        before = [list(c) for c in counts]
        t = time.perf_counter()
        time.sleep(seconds)
        dt = time.perf_counter() - t
        after = [list(c) for c in counts]
        stop.set()
        for th in threads:
            th.join(timeout=30)
        for p, _ in procs:
            p.terminate()
            p.wait()
        mb = sum(a[1] - b[1] for a, b in zip(after, before)) / dt / 1e6
        bs = sum(a[0] - b[0] for a, b in zip(after, before)) / dt
        results.append(
            {
                "workers": w,
                "mb_per_s": mb,
                "batches_per_s": bs,
                "mb_per_s_per_worker": mb / w,
                "batches_per_s_per_worker": bs / w,
            }
        )
    rows = [["in-process", f"{local['mb_per_s']:.0f}", f"{local['batches_per_s']:.0f}", "-", "-"]]
    rows += [
        [
            r["workers"],
            f"{r['mb_per_s']:.0f}",
            f"{r['batches_per_s']:.0f}",
            f"{r['mb_per_s_per_worker']:.0f}",
            f"{r['batches_per_s_per_worker']:.0f}",
        ]
        for r in results
    ]
    table(
        f"stream on loopback: micro-batch {mbs} x {seq_length + 1} uint16 "
        f"({mbs * (seq_length + 1) * 2 / 1e3:.0f} kB)",
        ["workers", "MB/s", "batches/s", "MB/s/worker", "batches/s/worker"],
        rows,
    )
    return {
        "seq_length": seq_length,
        "micro_batch_size": mbs,
        "in_process": local,
        "service": results,
    }


def bench_ranks(
    work: Path, workers_list: list[int], ranks: int, seq_length: int, mbs: int, seconds: float
) -> dict:
    """Samples/s delivered to `ranks` data-parallel ranks (the trainer's real client, one thread
    each in this process) by 1, 2, ... workers, against the same ranks reading in-process."""
    from meshtrain.services.dataloader.rpc.client import ServiceBatchSource

    prefix = _synthetic(work / "ranks", 11, docs=50_000, mean_len=1000)
    gbs = mbs * ranks
    spec = DatasetSpec((prefix,), (1.0,), seq_length, num_samples=gbs * 20000, seed=1, split="1")
    open_dataset(spec)  # builds the index cache the workers will load

    def measure(sources) -> dict:
        counts = [0] * len(sources)
        stop = threading.Event()

        def read(i: int) -> None:
            step = 0
            while not stop.is_set():
                counts[i] += sum(b.tokens.shape[0] for b in sources[i].micro_batches(step))
                step += 1

        threads = [
            threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(sources))
        ]
        for th in threads:
            th.start()
        time.sleep(min(2.0, seconds / 3))  # warm-up: index load, connections
        before, t = list(counts), time.perf_counter()
        time.sleep(seconds)
        dt, after = time.perf_counter() - t, list(counts)
        stop.set()
        for th in threads:
            th.join(timeout=30)
        per_rank = [(a - b) / dt for a, b in zip(after, before)]
        return {"samples_per_s": sum(per_rank), "min_rank_samples_per_s": min(per_rank)}

    local = measure(
        [LocalBatchSource(open_dataset(spec), mbs, gbs, r, ranks) for r in range(ranks)]
    )
    results = []
    for w in workers_list:
        procs = [_start_worker(work / f"r{i}") for i in range(w)]
        addresses = [addr for _, addr in procs]
        sources = [
            ServiceBatchSource(addresses, spec, mbs, gbs, r, ranks, rebalance_s=0)
            for r in range(ranks)
        ]
        try:
            r = measure(sources)
            r["streams_per_worker"] = [
                sum(s.current_address == a for s in sources) for a in addresses
            ]
        finally:
            for s in sources:
                s.close()
            for p, _ in procs:
                p.terminate()
                p.wait()
        r.update(workers=w, vs_in_process=r["samples_per_s"] / local["samples_per_s"])
        results.append(r)
    rows = [
        [
            "in-process",
            f"{local['samples_per_s']:.0f}",
            f"{local['min_rank_samples_per_s']:.0f}",
            "-",
            "1.00",
        ]
    ]
    rows += [
        [
            r["workers"],
            f"{r['samples_per_s']:.0f}",
            f"{r['min_rank_samples_per_s']:.0f}",
            "/".join(map(str, r["streams_per_worker"])),
            f"{r['vs_in_process']:.2f}",
        ]
        for r in results
    ]
    table(
        f"{ranks} ranks on loopback: samples of {seq_length + 1} tokens, micro-batch {mbs}",
        ["workers", "samples/s", "slowest rank", "streams per worker", "vs in-process"],
        rows,
    )
    return {
        "ranks": ranks,
        "seq_length": seq_length,
        "micro_batch_size": mbs,
        "in_process": local,
        "service": results,
    }


def bench_wait(
    work: Path, seq_length: int, mbs: int, accum: int, compute_ms: float, steps: int
) -> dict:
    from meshtrain.services.dataloader.rpc.client import ServiceBatchSource

    prefix = _synthetic(work / "wait", 9, docs=50_000, mean_len=1000)
    gbs = mbs * accum
    spec = DatasetSpec(
        (prefix,), (1.0,), seq_length, num_samples=gbs * (steps + 2), seed=1, split="1"
    )
    proc, address = _start_worker(work / "w")

    def run(source) -> list[float]:
        waits = []
        for step in range(steps):
            t = time.perf_counter()
            source.micro_batches(step)
            waits.append(time.perf_counter() - t)
            time.sleep(compute_ms / 1e3)  # the GPU's forward/backward for this step
        return waits[2:]  # the first steps include connection and index loading

    try:
        local = run(LocalBatchSource(open_dataset(spec), mbs, gbs))
        with ServiceBatchSource([address], spec, mbs, gbs, prefetch=2 * accum) as remote:
            service = run(remote)
    finally:
        proc.terminate()
        proc.wait()
    out = {
        "seq_length": seq_length,
        "micro_batch_size": mbs,
        "accumulation": accum,
        "compute_ms": compute_ms,
        "steps": steps,
        "in_process_wait_ms": {
            "mean": 1e3 * float(np.mean(local)),
            "p99": 1e3 * float(np.percentile(local, 99)),
        },
        "service_wait_ms": {
            "mean": 1e3 * float(np.mean(service)),
            "p99": 1e3 * float(np.percentile(service, 99)),
        },
    }
    table(
        f"trainer wait per step ({accum} micro-batches of {mbs} x {seq_length}, "
        f"{compute_ms:.0f} ms compute/step)",
        ["source", "mean ms", "p99 ms"],
        [
            [
                "in-process",
                f"{out['in_process_wait_ms']['mean']:.2f}",
                f"{out['in_process_wait_ms']['p99']:.2f}",
            ],
            [
                "service",
                f"{out['service_wait_ms']['mean']:.2f}",
                f"{out['service_wait_ms']['p99']:.2f}",
            ],
        ],
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--parts",
        nargs="+",
        default=["tokenize", "index", "stream", "ranks", "wait"],
        choices=["tokenize", "index", "stream", "ranks", "wait"],
    )
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--corpus-mb", type=float, default=20)
    p.add_argument("--tokenize-workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--index-samples", type=int, default=10_000_000)
    p.add_argument("--stream-workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--ranks", type=int, default=8, help="data-parallel ranks of the ranks part")
    p.add_argument("--ranks-workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--wait-compute-ms", type=float, default=50.0)
    p.add_argument("--wait-steps", type=int, default=40)
    args = p.parse_args()
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as tmp:
        work = Path(tmp)
        if "tokenize" in args.parts:
            results["tokenize"] = bench_tokenize(work, args.corpus_mb, args.tokenize_workers)
        if "index" in args.parts:
            results["index"] = bench_index(work, args.index_samples, 1024)
        if "stream" in args.parts:
            results["stream"] = bench_stream(
                work, args.stream_workers, args.seq_length, args.micro_batch_size, args.seconds
            )
        if "ranks" in args.parts:
            results["ranks"] = bench_ranks(
                work,
                args.ranks_workers,
                args.ranks,
                args.seq_length,
                args.micro_batch_size,
                args.seconds,
            )
        if "wait" in args.parts:
            results["wait"] = bench_wait(
                work, 2048, args.micro_batch_size, 8, args.wait_compute_ms, args.wait_steps
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
