"""FP8 against bf16 on the loss: two real `meshtrain train` runs, same data and seed, one plot.

    python benchmarks/fp8_loss_curve.py --out fp8-loss.json --plot fp8-loss.png
    python benchmarks/fp8_loss_curve.py --config deploy/configs/llama-1b.toml --fp8-format e4m3 \
        --fp8-recipe rowwise --steps 500 --out llama.json --plot llama.png \
        --data.default_corpus_bytes=4000000

Runs `meshtrain train` twice, each in its own process (the command a user runs): bf16, then the same
job with `--train.fp8=FORMAT` (and `--train.fp8_recipe=RECIPE` where given, and the `--fp8-extra`
flags), for `--steps` steps from the same initialization over the same batches. Every step is logged
(log.log_interval=1), nothing is evaluated, and the run's closing checkpoint goes to memory (not
timed, not kept). The JSON holds each run's per-step losses, the mean loss over the last `--tail`
steps of each, FP8's relative difference to bf16 in that mean (the FP8 goal: within 1%), and each
run's tokens/s after its first `--skip` steps (compilation); the PNG plots both curves, raw and
smoothed, over their relative difference. Flags the script does not know go to both runs
(`--data.default_corpus_bytes=...`).

Defaults: gpt2-350m (deploy/configs/gpt2-350m.toml) at sequence 1024, micro-batch 8 and global batch
8 (no accumulation): 8,192 tokens a step, 8.2M over 1,000 steps, about a minute a run on one H200 at
~150k tokens/s after ~1 min of compilation, so that both runs fit the GPU suite (gpu_suite.sh fp8).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise", "delayed")


def fp8_flags(args) -> list[str]:
    """The flags that make the FP8 run of the bf16 one."""
    recipe = [f"--train.fp8_recipe={args.fp8_recipe}"] if args.fp8_recipe else []
    return [f"--train.fp8={args.fp8_format}", *recipe, *shlex.split(args.fp8_extra)]


def run_flags(args, overrides: list[str], fp8: bool) -> list[str]:
    """The `meshtrain train` flags of one run (the bf16 run's with fp8 False): the shared job, then
    the FP8 keys."""
    return [
        "--config",
        args.config,
        "--train-iters",
        str(args.steps),
        "--bf16",
        f"--train.micro_batch_size={args.micro_batch_size}",
        f"--train.global_batch_size={args.global_batch_size}",
        f"--model.seq_length={args.seq_length}",
        "--train.eval_interval=0",
        "--log.log_interval=1",
        "--log.plot=false",
        *overrides,
        *(fp8_flags(args) if fp8 else []),
    ]


def train(name: str, flags: list[str], run_base: Path, timeout_s: float | None) -> Path:
    """Run `meshtrain train FLAGS` into RUN_BASE/NAME (its output in RUN_BASE/NAME.log);
    returns the run directory. Raises RuntimeError with the log's tail if the run fails or
    outlives `timeout_s`."""
    run_dir = run_base / name
    if (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(
            f"{run_dir} holds an earlier run's metrics.jsonl: choose another --run-dir or remove it"
        )
    run_base.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "meshtrain",
        "train",
        *flags,
        "--run-dir",
        str(run_dir),
        f"--checkpoint.save=memory://fp8-loss-curve-{os.getpid()}/{name}",
    ]
    log_path = run_base / f"{name}.log"
    print(f"{name}: {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            # in this directory, as the paths given are;
            # this checkout's meshtrain whether installed or not
            path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            done = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
                check=False,
            )
            failed = f"exit {done.returncode}" if done.returncode else None
        except subprocess.TimeoutExpired:
            failed = f"still running after {timeout_s} s"
    if failed:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"the {name} run failed ({failed}); the end of {log_path}:\n{tail}")
    print(f"{name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


def read_run(run_dir: Path, steps: int) -> dict:
    """RUN_DIR's resolved [train] section and its metrics.jsonl records by step. Raises ValueError
    naming the file if a step of 1..steps is missing or logged twice."""
    path = run_dir / "metrics.jsonl"
    records = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "loss" not in record:  # an evaluation's record
            continue
        if record["step"] in records:
            raise ValueError(
                f"{path}:{n}: step {record['step']} logged twice (two runs into one directory?)"
            )
        records[record["step"]] = record
    missing = [s for s in range(1, steps + 1) if s not in records]
    if missing:
        raise ValueError(
            f"{path}: {len(missing)} of steps 1..{steps} not logged (first: {missing[0]})"
        )
    config = tomllib.loads((run_dir / "config.toml").read_text())
    return {
        "train": config.get("train", {}),
        "model": config.get("model", {}),
        "records": [records[s] for s in range(1, steps + 1)],
    }


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN; a diverged FP8 run shows as nulls


def summarize(run: dict, tail: int, skip: int) -> dict:
    """One run's row: per-step losses, the mean of the last `tail`, and tokens/s over the steps
    after `skip` (their tokens over their time, and the median step's)."""
    records = run["records"]
    losses = [r["loss"] for r in records]
    timed = records[skip:]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
    t = run["train"]
    return {
        "losses": [finite_or_none(x) for x in losses],
        "finite": all(math.isfinite(x) for x in losses),
        "tail_mean_loss": finite_or_none(statistics.fmean(losses[-tail:])),
        "tokens_per_s": tokens / sum(r["step_time_s"] for r in timed),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "fp8": {k: v for k, v in t.items() if k.startswith("fp8")},
        "micro_batch_size": t.get("micro_batch_size"),
        "global_batch_size": t.get("global_batch_size"),
        "seq_length": run["model"].get("seq_length"),
    }


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average: point i is the mean of values[max(0, i - window + 1) : i + 1]."""
    out, total = [], 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare(bf16: dict, fp8: dict, tail: int, tolerance: float) -> dict:
    """The result's comparison: FP8's tail mean relative to bf16's, and its speed relative
    to bf16's."""
    a, b = bf16["tail_mean_loss"], fp8["tail_mean_loss"]
    rel = (b - a) / a if a is not None and b is not None else None
    steps = [
        (i + 1, (y - x) / x)
        for i, (x, y) in enumerate(zip(bf16["losses"], fp8["losses"], strict=True))
        if x is not None and y is not None
    ]
    worst = max(steps, key=lambda p: abs(p[1]), default=(None, None))
    return {
        "tail_steps": tail,
        "tail_mean_loss_rel_diff": rel,
        "tolerance": tolerance,
        "within_tolerance": rel is not None and abs(rel) <= tolerance,
        "worst_step": worst[0],
        "worst_step_rel_diff": worst[1],  # the largest per-step gap, and where
        "fp8_speedup": fp8["tokens_per_s"] / bf16["tokens_per_s"],
    }


def plot(result: dict, path: Path, window: int) -> None:
    """Loss against step for both runs (raw, faint; smoothed, solid) over the smoothed curves'
    relative difference, with the tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 6), dpi=110, sharex=True, height_ratios=(3, 1)
    )
    curves = {}
    for name, color in (("bf16", "tab:blue"), ("fp8", "tab:orange")):
        run = result["runs"][name]
        pairs = [(i + 1, x) for i, x in enumerate(run["losses"]) if x is not None]
        steps, losses = [p[0] for p in pairs], [p[1] for p in pairs]
        curves[name] = dict(zip(steps, smooth(losses, window)))
        top.plot(steps, losses, color=color, lw=0.6, alpha=0.3)
        mean = run["tail_mean_loss"]
        label = f"{name} ({window}-step mean); last {result['tail_steps']}: "
        label += f"{mean:.4f}" if mean is not None else "n/a"
        top.plot(steps, list(curves[name].values()), color=color, lw=1.6, label=label)
    top.set_ylabel("train loss (nats/token)")
    rel = result["tail_mean_loss_rel_diff"]
    fp8 = result["runs"]["fp8"][
        "fp8"
    ]  # the FP8 run's resolved keys: its recipe too where the trainer chose it
    top.set_title(
        f"{Path(result['config']).stem}: FP8 ({fp8.get('fp8')}, {fp8.get('fp8_recipe')}) vs bf16, "
        f"{result['steps']} steps, "
        f"{result['tokens_per_step']:,} tokens/step; last-{result['tail_steps']} mean "
        + (f"{rel * 100:+.2f}%" if rel is not None else "n/a"),
        fontsize=9,
    )
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    common = sorted(set(curves["bf16"]) & set(curves["fp8"]))
    bottom.plot(
        common,
        [(curves["fp8"][s] / curves["bf16"][s] - 1) * 100 for s in common],
        color="black",
        lw=1,
    )
    tol = result["tolerance"] * 100
    for y in (-tol, 0.0, tol):
        bottom.axhline(y, color="gray", lw=0.8, ls="--" if y else "-")
    bottom.set_ylabel("FP8 / bf16 - 1 (%)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(the script's arguments, the flags it passes on to both runs); exits with a usage
    error on bad ones."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="deploy/configs/gpt2-350m.toml")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument(
        "--fp8-format", choices=FORMATS, default="hybrid", help="train.fp8 of the FP8 run"
    )
    p.add_argument(
        "--fp8-recipe",
        choices=RECIPES,
        help="train.fp8_recipe of the FP8 run (unset: the trainer's)",
    )
    p.add_argument(
        "--fp8-extra",
        default="",
        metavar="FLAGS",
        help="more flags for the FP8 run alone, one string "
        "(e.g. '--train.fp8_bf16_first_last=true')",
    )
    p.add_argument(
        "--tail", type=int, default=100, help="steps at the end whose mean loss is compared"
    )
    p.add_argument(
        "--skip", type=int, default=10, help="first steps left out of tokens/s (compilation)"
    )
    p.add_argument(
        "--smooth", type=int, default=50, help="moving-average window of the plot's solid lines"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="allowed |relative difference| of the tail means",
    )
    p.add_argument(
        "--run-dir",
        default="runs/fp8-loss-curve",
        help="the two runs go to RUN_DIR/bf16 and RUN_DIR/fp8",
    )
    p.add_argument("--timeout-s", type=float, help="give up on a run after this many seconds")
    p.add_argument("--out", default="fp8_loss_curve.json")
    p.add_argument("--plot", default="fp8_loss_curve.png")
    args, overrides = p.parse_known_args(argv)
    for key in ("steps", "micro_batch_size", "global_batch_size", "seq_length", "tail", "smooth"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    if args.tail > args.steps or not 0 <= args.skip < args.steps:
        p.error(
            f"--tail ({args.tail}) must be at most --steps ({args.steps}) "
            f"and --skip ({args.skip}) below it"
        )
    if args.global_batch_size % args.micro_batch_size:
        p.error(
            f"--global-batch-size ({args.global_batch_size}) must be a multiple of "
            f"--micro-batch-size ({args.micro_batch_size})"
        )
    try:
        import matplotlib  # noqa: F401  (before two runs, not after)
    except ImportError:
        p.error("the plot needs matplotlib (pip install 'meshtrain[plot]')")
    return args, overrides


def main(argv: list[str] | None = None) -> dict:
    args, overrides = parse_args(argv)
    run_base = Path(args.run_dir)
    runs = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        run_dir = train(name, run_flags(args, overrides, fp8), run_base, args.timeout_s)
        runs[name] = summarize(read_run(run_dir, args.steps), args.tail, args.skip)
    result = {
        "config": args.config,
        "steps": args.steps,
        "overrides": overrides,
        "fp8_flags": " ".join(fp8_flags(args)),
        "tokens_per_step": args.global_batch_size * args.seq_length,
        "skip": args.skip,
        **compare(runs["bf16"], runs["fp8"], args.tail, args.tolerance),
        "runs": runs,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    plot(result, Path(args.plot), args.smooth)
    for name, run in runs.items():
        mean = run["tail_mean_loss"]
        print(
            f"{name:>5}: last-{args.tail} mean loss "
            + (f"{mean:.4f}" if mean is not None else "n/a (not finite)")
            + f"  {run['tokens_per_s']:,.0f} tokens/s "
            f"(median step {run['tokens_per_s_median']:,.0f})"
        )
    rel = result["tail_mean_loss_rel_diff"]
    print(
        f"FP8 vs bf16: last-{args.tail} mean "
        + (f"{rel * 100:+.3f}%" if rel is not None else "n/a")
        + f" ({'within' if result['within_tolerance'] else 'NOT within'} {args.tolerance:.1%}), "
        f"speed {result['fp8_speedup']:.3f}x"
    )
    if result["worst_step"] is not None:
        print(
            f"largest per-step gap: {result['worst_step_rel_diff'] * 100:+.2f}% "
            f"at step {result['worst_step']}"
        )
    print(f"wrote {args.out} and {args.plot}")
    return result


if __name__ == "__main__":
    main()
