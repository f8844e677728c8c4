"""Checkpoint conversion throughput and peak memory, against a plain copy of the same bytes.

    python benchmarks/checkpoint_convert.py --config deploy/configs/llama-1b.toml --out result.json
    python benchmarks/checkpoint_convert.py --num-layers 4 --optimizer  # smaller, with Adam state

Builds a synthetic training checkpoint with the shapes of the config's model (fp32 parameters
as the trainer stores them, optionally fp32 Adam moments), written with the same streaming
saver `convert` uses so building it never holds the model in memory. Then, each in a fresh
process so peak RSS (VmHWM) is that command's alone: a plain recursive copy of the step folder
(the baseline: the same bytes, no decoding), `convert` with no change (decode, verify, re-encode
every shard), `convert --dtype bf16`, `convert --target-tensor-parallel-size 2`, and
`export --format hf` (safetensors). GB/s counts logical tensor bytes read from the source.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.checkpoint.convert import save_streaming
from meshtrain.services.common import config as cfg
from meshtrain.services.common.config import to_dict
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT

# Runs in a child process: one command, then its wall time and peak RSS as JSON.
CHILD = r"""
import json, shutil, sys, time
sys.path.insert(0, sys.argv[1])
from meshtrain.services.checkpoint.convert import convert
from meshtrain.services.checkpoint.hf.convert import export_hf
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
kind, src, dst = sys.argv[2:5]
before = status("VmRSS")
start = time.perf_counter()
if kind == "copy":
    shutil.copytree(src, dst)
elif kind == "export":
    export_hf(src, dst)
else:
    args = json.loads(kind)
    convert(src, dst, progress=False, **args)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss_before": before, "peak_rss": status("VmHWM")}))
"""


def model_specs(model: ModelConfig, optimizer: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of a training checkpoint of `model`, built on the meta device."""
    with torch.device("meta"):
        gpt = GPT(model)
    specs = {}
    for name, p in gpt.named_parameters():
        shape = tuple(p.shape)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            shape = (model.vocab_size, *shape[1:])  # padded rows are not stored
        specs[name] = (shape, "float32")
        if optimizer:
            specs[f"optim.exp_avg.{name}"] = (shape, "float32")
            specs[f"optim.exp_avg_sq.{name}"] = (shape, "float32")
    specs["rng.torch_cpu"] = (tuple(torch.get_rng_state().shape), "uint8")
    return specs


def build_checkpoint(root: str, model: ModelConfig, optimizer: bool) -> int:
    """Writes step 1 of a synthetic checkpoint under `root`; returns its logical bytes."""
    specs = model_specs(model, optimizer)
    gen = torch.Generator().manual_seed(0)

    def load(name: str) -> torch.Tensor:
        shape, dtype = specs[name]
        if dtype == "uint8":
            return torch.get_rng_state()
        # uniform_ is several times faster than randn on CPU; the values do not matter here.
        return torch.empty(shape).uniform_(-0.05, 0.05, generator=gen)

    meta = {
        "format": "meshtrain-train/1",
        "iteration": 1,
        "optimizer_step": 1 if optimizer else 0,
        "config": to_dict(JobConfig(model=model)),
        "tokenizer": "byte",
    }
    _, nbytes = save_streaming(root, 1, specs, load, meta, progress=True, desc="build")
    return nbytes


def run_child(kind: str, src: str, dst: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}  # freed big blocks go back to the OS
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(Path(__file__).resolve().parents[1]), kind, src, dst],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/llama-1b.toml")
    p.add_argument(
        "--num-layers", type=int, help="override the config's layer count (smaller runs)"
    )
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument(
        "--optimizer", action="store_true", help="include fp32 Adam moments (3x the bytes)"
    )
    p.add_argument("--workdir", help="where to build (default: a temporary folder, removed after)")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()

    table = cfg.load_toml(args.config)["model"]
    table["vocab_size"] = args.vocab_size
    if args.num_layers:
        table["num_layers"] = args.num_layers
    model = cfg.build(ModelConfig, table, "model.")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt-convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = str(work / "src")
    try:
        start = time.perf_counter()
        nbytes = build_checkpoint(src, model, args.optimizer)
        build_s = time.perf_counter() - start
        specs = model_specs(model, args.optimizer)
        largest = max(torch.Size(s).numel() * 4 for s, _ in specs.values())
        cases = [
            (
                "plain copy (baseline)",
                "copy",
                str(work / "src" / "step_00000001"),
                str(work / "copy"),
            ),
            ("convert (same dtype)", json.dumps({}), src, str(work / "same")),
            ("convert --dtype bf16", json.dumps({"dtype": "bf16"}), src, str(work / "bf16")),
            ("convert --target-tp 2", json.dumps({"target_tp": 2}), src, str(work / "tp2")),
            ("export --format hf", "export", src, str(work / "hf")),
        ]
        rows = []
        for label, kind, a, b in cases:
            r = run_child(kind, a, b)
            grown = r["peak_rss"] - r["rss_before"]
            rows.append(
                {
                    "case": label,
                    "seconds": r["seconds"],
                    "gb_per_s": nbytes / r["seconds"] / 1e9,
                    "peak_rss_gb": r["peak_rss"] / 1e9,
                    "rss_growth_gb": grown / 1e9,
                    "growth_over_largest_tensor": grown / largest,
                }
            )
            shutil.rmtree(b, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    params = sum(
        torch.Size(s).numel() for n, (s, _) in specs.items() if not n.startswith(("optim.", "rng."))
    )
    result = {
        "benchmark": "checkpoint_convert",
        "config": args.config,
        "num_layers": model.num_layers,
        "parameters": params,
        "optimizer_state": args.optimizer,
        "checkpoint_bytes": nbytes,
        "largest_tensor_bytes": largest,
        "build_seconds": build_s,
        "rows": rows,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "time_unix": time.time(),
    }
    print(
        f"\n{params / 1e9:.2f}B parameters ({model.num_layers} layers), "
        f"{nbytes / 1e9:.2f} GB logical, largest tensor {largest / 1e6:.0f} MB, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        "| case | seconds | GB/s | ratio to copy | peak RSS GB | RSS growth GB | growth / largest |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['seconds']:.1f} | {r['gb_per_s']:.2f} "
            f"| {r['gb_per_s'] / rows[0]['gb_per_s']:.2f} "
            f"| {r['peak_rss_gb']:.2f} | {r['rss_growth_gb']:.2f} "
            f"| {r['growth_over_largest_tensor']:.1f}x |"
        )
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
