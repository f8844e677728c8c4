"""Data-worker image throughput: images/s per CPU core for 336^2 crops (decode, resize, crop or
pad, tokenize, wire encoding), as a data worker makes micro-batches.

Source images are JPEGs of COCO's typical size (640 x 480, quality 90) with smooth gradients and
noise, written as WebDataset shards with captions; the benchmark times
`MultimodalBatchSource.payload` (what a worker sends) in this one process, over whole epochs
of distinct records, and reports images per CPU-second (process time, so other load on the
machine does not count) and per wall second.

    python benchmarks/vision_data_bench.py --out benchmarks/results/vision-data.json
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import tarfile
import tempfile
import time
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


def measure(folder: Path, mode: str, wire: str, records: int, mbs: int) -> dict:
    spec = MultimodalSpec(
        (str(folder),),
        "byte",
        seq_length=1024,
        num_samples=records,
        seed=0,
        image_token_id=257,
        tokens_per_image=576,
        image_size=336,
        resize_mode=mode,
        wire_dtype=wire,
        split="100,0,0",
    )
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_jpegs(folder, a.records)
        rows = [
            measure(folder, mode, wire, a.records, a.micro_batch_size)
            for mode, wire in (("crop", "uint8"), ("pad", "uint8"), ("crop", "bfloat16"))
        ]
    import PIL

    result = {
        "benchmark": "vision_data_bench",
        "source": "640x480 JPEG q90 -> 336x336, byte tokenizer, seq 1024, 576 tokens/image",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": sys.version},
        "pillow": PIL.__version__,
        "rows": rows,
    }
    for r in rows:
        print(
            f"{r['resize_mode']:5s} {r['wire_dtype']:9s} {r['images_per_cpu_s']:8.1f} images/cpu-s "
            f"{r['images_per_wall_s']:8.1f} images/s wall"
        )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
