"""Data-worker image throughput: images/s per CPU core for 336^2 crops (decode, resize, crop or
pad, tokenize, wire encoding), as a data worker makes micro-batches, and how many workers one
GPU training LLaVA-1.5-7B needs.

Source images are JPEGs of COCO's typical size (640 x 480, quality 90) with smooth gradients and
noise, written as WebDataset shards with captions. Without `--workers`, the benchmark times
`MultimodalBatchSource.payload` (what a worker sends) in this one process, over whole epochs
of distinct records, and reports images per CPU-second (process time, so other load on the
machine does not count) and per wall second.

With `--workers 1,2`, it measures through the real data service instead: for each N it starts N
`meshtrain data serve` processes (port 0), each pinned to a core of its own
(`os.sched_setaffinity`, where the platform has it) with OMP/MKL threads 1, and streams
`--batches` multimodal micro-batches to `--ranks` data-parallel ranks in this process, each
`ServiceBatchSource` (the trainer's client) spread over the workers by its rank, this process
pinned to the cores left (all of them, shared, when none is left; the JSON says which). It reports
the images/s delivered after every rank has its first micro-batch, the scaling of N workers over
one, images per worker CPU-second, and, from a FLOPs count of LLaVA-1.5-7B
(`deploy/configs/llava-1.5-7b.toml`: `GPT.flops_per_token` over a 2,048-token sample plus
`vision_flops_per_image`, everything trained), the images/s one H200 consumes at 50% MFU of
989 TFLOP/s and so the workers it needs at the one-worker rate.

    python benchmarks/vision_data_bench.py --out benchmarks/results/vision-data.json
    python benchmarks/vision_data_bench.py --workers 1,2 --out vision-service.json
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshtrain.services.dataloader.vision.dataset import (  # noqa: E402 (after the sys.path entry)
    MultimodalBatchSource,
    MultimodalSpec,
    open_multimodal,
)


def write_jpegs(folder: Path, n: int, size=(640, 480), seed=0) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    with tarfile.open(folder / "bench-000000.tar", "w") as tar:
        for i in range(n):
            a, b, c = rng.uniform(0.2, 1.0, 3)
            img = np.stack(
                [np.sin(x / (40 * a)), np.cos(y / (50 * b)), np.sin((x + y) / (60 * c))], -1
            )
            img = (img * 60 + 128 + rng.normal(0, 12, img.shape)).clip(0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            for name, data in (
                (f"{i:06d}.jpg", buf.getvalue()),
                (f"{i:06d}.txt", f"A synthetic picture number {i}.".encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def bench_spec(
    folder: Path, mode: str, wire: str, num_samples: int, seq_length: int = 1024
) -> MultimodalSpec:
    return MultimodalSpec(
        (str(folder),),
        "byte",
        seq_length=seq_length,
        num_samples=num_samples,
        seed=0,
        image_token_id=257,
        tokens_per_image=576,
        image_size=336,
        resize_mode=mode,
        wire_dtype=wire,
        split="100,0,0",
    )


def measure(folder: Path, mode: str, wire: str, records: int, mbs: int) -> dict:
    spec = bench_spec(folder, mode, wire, records)
    src = MultimodalBatchSource(open_multimodal(spec, cache=False), mbs, mbs)
    src.payload(0, 0)  # warm: imports, first file opens
    cpu0, wall0 = time.process_time(), time.perf_counter()
    images = 0
    for step in range(records // mbs):
        images += src.payload(step, 0).images.shape[0]
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "resize_mode": mode,
        "wire_dtype": wire,
        "images": images,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "images_per_cpu_s": round(images / cpu, 1),
        "images_per_wall_s": round(images / wall, 1),
    }


# LLaVA-1.5-7B as one H200 trains it, for the workers-per-GPU estimate
LLAVA_CONFIG = ROOT / "deploy/configs/llava-1.5-7b.toml"
LLAVA_VOCAB = 32064  # llava-hf's padded vocabulary (32000 Llama tokens, the image token, padding)
H200_PEAK_TFLOPS = 989.0  # dense bf16
MFU = 0.5
# workers' math libraries single-threaded: one core a worker (torch's intra-op pool follows OMP)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def llava_images_per_s(mfu: float = MFU, peak_tflops: float = H200_PEAK_TFLOPS) -> dict:
    """Images/s one GPU consumes training LLaVA-1.5-7B at `mfu` of `peak_tflops`, one image per
    2,048-token sample, every weight trained: the same FLOPs count `vision_train.py` reports MFU
    with."""
    from benchmarks.vision_train import vision_flops_per_image
    from meshtrain.services.common.model_config import ModelConfig, VisionConfig
    from meshtrain.services.trainer.metrics import model_size

    model = tomllib.loads(LLAVA_CONFIG.read_text())["model"]
    vision = VisionConfig(**model["vision"])
    c = ModelConfig(
        **{k: v for k, v in model.items() if k != "vision"}, vocab_size=LLAVA_VOCAB, vision=vision
    )
    lm_per_token = model_size(c).flops_per_token
    vision_per_image = vision_flops_per_image(c, frozen=False)
    per_sample = lm_per_token * c.seq_length + vision_per_image
    return {
        "model": f"{LLAVA_CONFIG.relative_to(ROOT)} [model], vocab {LLAVA_VOCAB}: "
        f"{c.num_layers} LM blocks, ViT {vision.num_layers} blocks ({vision.layers_run} run: "
        f"select_layer {vision.select_layer}), seq {c.seq_length}, one image a sample, "
        "vision tower, projector and LM all trained",
        "lm_flops_per_token": lm_per_token,
        "vision_flops_per_image": vision_per_image,
        "flops_per_sample": per_sample,
        "mfu": mfu,
        "peak_tflops": peak_tflops,
        "images_per_s": mfu * peak_tflops * 1e12 / per_sample,
        "formula": "images_per_s = mfu * peak_tflops * 1e12 / (lm_flops_per_token * seq_length "
        "+ vision_flops_per_image); lm_flops_per_token = 6N + 12*L*s*hidden "
        "(GPT.flops_per_token), vision: vision_flops_per_image (benchmarks/vision_train.py)",
    }


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin_this_process(cores: set[int]) -> None:
    """Every thread of this process onto `cores` (threads started later inherit it)."""
    tasks = os.listdir("/proc/self/task") if Path("/proc/self/task").is_dir() else ["0"]
    for tid in tasks:
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass


class Worker:
    """One `meshtrain data serve` process on a loopback port, on `core` if given."""

    def __init__(self, folder: Path, core: int | None):
        pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "meshtrain", "data", "serve", "--port", "0"),
                *("--grace", "1", "--allow-root", str(folder)),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **ONE_THREAD, "PYTHONUNBUFFERED": "1"},
            preexec_fn=pin,  # in the child before exec: every thread it starts is on `core`
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("listening on "):
                self.address = line.split("listening on ", 1)[1].strip()
                break
        else:
            raise SystemExit(f"data worker exited with {self.proc.wait()} before listening")

    def cpu_seconds(self) -> float | None:
        return _cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def measure_service(
    folder: Path,
    workers: int,
    ranks: int,
    batches: int,
    mbs: int,
    mode: str,
    wire: str,
    seq_length: int,
) -> dict:
    """Images/s that `workers` data-service processes deliver to `ranks` client ranks over
    `batches` micro-batches (rounded up to whole steps of one micro-batch a rank)."""
    from meshtrain.services.dataloader.rpc.client import ServiceBatchSource

    steps = -(-batches // ranks)
    spec = bench_spec(folder, mode, wire, steps * mbs * ranks, seq_length)
    pinning = hasattr(os, "sched_setaffinity")
    cores = sorted(os.sched_getaffinity(0)) if pinning else []
    if pinning and workers > len(cores):
        raise SystemExit(f"--workers {workers}: only {len(cores)} cores to pin workers to")
    worker_cores = [cores[i] for i in range(workers)] if pinning else []
    client_cores = set(cores[workers:]) or set(cores)
    procs = [Worker(folder, worker_cores[i] if pinning else None) for i in range(workers)]
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(ranks)]
    failures: list[BaseException] = []

    def read(src: ServiceBatchSource, r: int) -> None:
        try:
            for step in range(steps):
                n = sum(
                    0 if b.images is None else int(b.images.shape[0])
                    for b in src.micro_batches(step)
                )
                arrivals[r].append((time.perf_counter(), n))
        except BaseException as e:  # raised in the main thread below
            failures.append(e)

    import torch

    threads_before = torch.get_num_threads()
    try:
        if pinning:
            _pin_this_process(client_cores)
        torch.set_num_threads(max(1, len(client_cores)))
        cpu0 = [w.cpu_seconds() for w in procs]
        client_cpu0 = time.process_time()
        addresses = [w.address for w in procs]
        sources = [
            ServiceBatchSource(addresses, spec, mbs, mbs * ranks, r, ranks, rebalance_s=0)
            for r in range(ranks)
        ]
        try:
            threads = [threading.Thread(target=read, args=(s, r)) for r, s in enumerate(sources)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            streams = [sum(s.current_address == a for s in sources) for a in addresses]
        finally:
            for s in sources:
                s.close()
        client_cpu = time.process_time() - client_cpu0
        cpu1 = [w.cpu_seconds() for w in procs]
    finally:
        for w in procs:
            w.stop()
        torch.set_num_threads(threads_before)
        if pinning:
            _pin_this_process(set(cores))
    if failures:
        raise failures[0]
    # the clock starts once every rank has its first micro-batch (workers up, datasets open,
    # streams flowing) and stops at the last; the ranks never wait on anything but their
    # stream, so nothing queued before the start is counted as work done after it
    start = max(a[0][0] for a in arrivals)
    end = max(a[-1][0] for a in arrivals)
    images = sum(n for a in arrivals for t, n in a if t > start)
    total = sum(n for a in arrivals for _, n in a)
    worker_cpu = [None if a is None or b is None else round(b - a, 3) for a, b in zip(cpu0, cpu1)]
    known: list[float] = [c for c in worker_cpu if c is not None]
    rate = images / (end - start)
    return {
        "workers": workers,
        "ranks": ranks,
        "micro_batches": steps * ranks,
        "streams_per_worker": streams,
        "images_timed": images,
        "timed_s": round(end - start, 3),
        "images_per_s": round(rate, 1),
        "images_per_s_per_worker": round(rate / workers, 1),
        "images_total": total,
        "worker_cpu_s": worker_cpu,
        "images_per_worker_cpu_s": (
            round(total / math.fsum(known), 1) if len(known) == workers and any(known) else None
        ),
        "client_cpu_s": round(client_cpu, 3),
        "worker_cores": [[c] for c in worker_cores] if pinning else None,
        "client_cores": sorted(client_cores) if pinning else None,
        "client_shares_worker_cores": bool(pinning and not cores[workers:]),
    }


def bench_service(a, folder: Path, workers_list: list[int]) -> dict:
    """The service rows, their scaling over one worker, and the workers one H200 needs."""
    ranks = a.ranks or max(workers_list)
    rows = [
        measure_service(
            folder,
            n,
            ranks,
            a.batches,
            a.micro_batch_size,
            a.resize_mode,
            a.wire_dtype,
            a.seq_length,
        )
        for n in workers_list
    ]
    by_n = {r["workers"]: r for r in rows}
    for r in rows:
        if 1 in by_n:
            r["vs_1_worker"] = round(r["images_per_s"] / by_n[1]["images_per_s"], 3)
    gpu = llava_images_per_s()
    one = by_n.get(1, rows[0])
    per_worker = one["images_per_s_per_worker"]
    gpu["per_worker_images_per_s"] = per_worker
    gpu["per_worker_from"] = f"{one['workers']} worker(s), delivered images/s per worker"
    gpu["workers_needed"] = math.ceil(gpu["images_per_s"] / per_worker)
    gpu["workers_formula"] = "workers_needed = ceil(images_per_s / per_worker_images_per_s)"
    return {
        "settings": {
            "resize_mode": a.resize_mode,
            "wire_dtype": a.wire_dtype,
            "seq_length": a.seq_length,
            "micro_batch_size": a.micro_batch_size,
            "ranks": ranks,
            "records": a.records,
            "pinning": (
                "each worker on its own core (os.sched_setaffinity), "
                + ", ".join(f"{k}=1" for k in ONE_THREAD)
                + "; the client (this process, all ranks' threads, torch threads = its cores) on "
                "the cores left, or sharing all of them when none is left"
                if hasattr(os, "sched_setaffinity")
                else "none: os.sched_setaffinity is not available here"
            ),
            "timing": "images delivered after every rank's first micro-batch, over the time to "
            "the last; images_per_worker_cpu_s counts every image over the workers' whole CPU "
            "time from the first request (dataset open included)",
        },
        "rows": rows,
        "scaling_2_over_1": by_n[2]["vs_1_worker"] if 1 in by_n and 2 in by_n else None,
        "h200_llava_1_5_7b": gpu,
    }


def worker_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give worker counts like 1,2") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give worker counts of at least 1, like 1,2")
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=256, help="distinct JPEG records written")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument(
        "--workers",
        type=worker_counts,
        default=None,
        help="measure through the data service with these worker counts (e.g. 1,2) instead of "
        "in this process",
    )
    p.add_argument(
        "--batches", type=int, default=128, help="micro-batches streamed for each worker count"
    )
    p.add_argument("--ranks", type=int, default=None, help="client ranks (default: most workers)")
    p.add_argument("--resize-mode", choices=("crop", "pad"), default="crop")
    p.add_argument("--wire-dtype", choices=("uint8", "bfloat16"), default="uint8")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    for name in ("records", "micro_batch_size", "batches", "ranks", "seq_length"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    service = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_jpegs(folder, a.records)
        if a.workers:
            service = bench_service(a, folder, a.workers)
            rows = []
        else:
            rows = [
                measure(folder, mode, wire, a.records, a.micro_batch_size)
                for mode, wire in (("crop", "uint8"), ("pad", "uint8"), ("crop", "bfloat16"))
            ]
    import PIL

    result: dict[str, object] = {
        "benchmark": "vision_data_bench",
        "source": f"640x480 JPEG q90 -> 336x336, byte tokenizer, "
        f"seq {a.seq_length if a.workers else 1024}, 576 tokens/image",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": sys.version,
        },
        "pillow": PIL.__version__,
    }
    if service is None:
        result["rows"] = rows
        for r in rows:
            print(
                f"{r['resize_mode']:5s} {r['wire_dtype']:9s} {r['images_per_cpu_s']:8.1f} "
                f"images/cpu-s {r['images_per_wall_s']:8.1f} images/s wall"
            )
    else:
        result["service"] = service
        for r in service["rows"]:
            print(
                f"{r['workers']} worker(s), {r['ranks']} ranks: {r['images_per_s']:8.1f} images/s "
                f"({r['images_per_s_per_worker']:.1f} a worker, "
                f"{r['images_per_worker_cpu_s']} per worker CPU-s), "
                f"x{r.get('vs_1_worker', 1.0):.2f} one worker"
            )
        g = service["h200_llava_1_5_7b"]
        print(
            f"one H200, LLaVA-1.5-7B at {g['mfu']:.0%} MFU: {g['images_per_s']:.2f} images/s "
            f"-> {g['workers_needed']} worker(s) at {g['per_worker_images_per_s']} images/s each"
        )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
