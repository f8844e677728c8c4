"""Peak activation memory and step time with and without activation recompute.

    python benchmarks/recompute_memory.py --config deploy/configs/llama-1b.toml --out recompute.json

For each plan (none, selective, full uniform, full block of half the layers) one micro-batch
forward + backward of the configured model on one device, after a warm-up; reports peak
memory above the weights and the fwd+bwd time, so the baseline (no recompute) is measured in
the same run. On CUDA: bf16 autocast, allocator statistics. On CPU: fp32, each plan in a fresh
process, peak resident memory (VmHWM) minus the resident memory after the warm-up's weights
and optimizer-free gradients exist. Eager mode: recompute's memory effect is the question
here, not compiled speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.trainer.config.load import load_config, replace  # noqa: E402
from meshtrain.services.trainer.config.parallel import ParallelConfig  # noqa: E402
from meshtrain.services.trainer.model.gpt import GPT  # noqa: E402
from meshtrain.services.trainer.parallel import recompute  # noqa: E402

PLANS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full-uniform-1": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full-block-half": {"recompute_granularity": "full", "recompute_method": "block"},
}


def measure(job, plan: dict, device: torch.device, iters: int) -> dict:
    cfg = replace(job, model={"vocab_size": job.model.vocab_size or 32768}).model
    if plan.get("recompute_method") == "block":
        plan = dict(plan, recompute_num_layers=cfg.num_layers // 2)
    torch.manual_seed(0)
    model = recompute.apply(GPT(cfg), ParallelConfig(**plan)).to(device)
    b, s = job.train.micro_batch_size, cfg.seq_length
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=False)

    step()
    sync()
    weights = torch.cuda.memory_allocated() if device.type == "cuda" else _rss("VmRSS")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    seconds = (time.perf_counter() - start) / iters
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss("VmHWM")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"fwd_bwd_s": seconds, "peak_gb": peak / 1e9, "activation_gb": (peak - weights) / 1e9}


def _rss(field: str) -> int:
    """Resident (VmRSS) or peak resident (VmHWM) bytes of this process, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default="recompute_memory.json")
    p.add_argument(
        "--plan", help=argparse.SUPPRESS
    )  # internal: one plan in this process, JSON on stdout
    args, overrides = p.parse_known_args()
    job = load_config(["--config", args.config, *overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.plan:
        print(json.dumps(measure(job, PLANS[args.plan], device, args.iters)))
        return
    if device.type == "cuda":
        rows = {name: measure(job, plan, device, args.iters) for name, plan in PLANS.items()}
    else:  # a process's peak RSS never goes down: one fresh process per plan
        rows = {}
        for name in PLANS:
            cmd = [
                sys.executable,
                __file__,
                "--config",
                args.config,
                "--iters",
                str(args.iters),
                "--plan",
                name,
                *overrides,
            ]
            rows[name] = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            )
    base = rows["none"]
    print(
        f"\n{args.config}  micro-batch {job.train.micro_batch_size} "
        f"x seq {job.model.seq_length}  {device}"
    )
    print(
        f"{'plan':<18}{'peak GB':>9}{'act. GB':>9}"
        f"{'act. ratio':>11}{'fwd+bwd s':>11}{'time ratio':>11}"
    )
    for name, r in rows.items():
        ratio = (
            r["activation_gb"] / base["activation_gb"] if base["activation_gb"] else float("nan")
        )
        print(
            f"{name:<18}{r['peak_gb']:>9.2f}{r['activation_gb']:>9.2f}{ratio:>11.2f}"
            f"{r['fwd_bwd_s']:>11.3f}{r['fwd_bwd_s'] / base['fwd_bwd_s']:>11.2f}"
        )
    Path(args.out).write_text(
        json.dumps({"config": args.config, "device": str(device), "results": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
