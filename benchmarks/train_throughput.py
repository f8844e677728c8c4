"""End-to-end training throughput: meshtrain's trainer vs a plain compiled PyTorch GPT.

    python benchmarks/train_throughput.py --config deploy/configs/gpt2-125m.toml --steps 300 \
        --out result.json
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py \
        --config deploy/configs/llama-1b.toml --skip-baseline --use-distributed-optimizer \
        --overlap-grad-reduce --out dp2.json

Under torchrun the meshtrain side runs on every rank (tp/dp from the usual flags) and rank 0
reports; tokens/s counts the whole global batch, MFU is per GPU.

Both sides train the same architecture with the same micro/global batch and sequence length,
in bf16 autocast with fused AdamW and torch.compile, in the same process one after the other
(with `--rounds R`: all built at once and timed in turn, R times over, so that a drift of the
machine falls on every side alike).
meshtrain runs its real loop step (data from its dataloader, gradient accumulation, clipping, LR
schedule); the baseline (`baseline_gpt.py`) trains on random tokens. Compile and warm-up steps are
excluded. Prints a table and writes JSON; the ratio is the number that counts. The table's s/step is
the mean over the timed steps (tokens/s and the ratios come from it), "median" the median step, and
"spread" the slowest step over the fastest, less one. Each ratio is also given from the median steps
(`*_median` in the JSON), which one stalled step does not move, and each row counts the CUDA
allocator's events inside its timed steps (`allocator`: cache releases, syncs, cudaMalloc and
cudaFree calls). `--baseline-float8 tensorwise|rowwise` adds the baseline with torchao's float8
linear layers (the FP8 target a PyTorch user has at hand), with meshtrain's ratio to it, and with
`--variant` (e.g. meshtrain's own FP8) the variant's ratio to it too. `--variant` may be given more
than once (FP8 recipes side by side): each variant is a side of its own, and (sides in turn,
`--rounds 1`) a variant that fails to build or train (a refused option, a CUDA graph that cannot be
captured) is reported as failed while the others are still timed. With sides in turn, --out is
written after each side (`"partial": true`, the sides timed so far), so a run cut short by a time
limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baseline_gpt import FLOAT8_RECIPES, BaselineGPT, convert_to_float8, make_optimizer  # noqa: E402
from benchmarks.step_breakdown import format_breakdown, profile_steps  # noqa: E402
from meshtrain.kernels import dispatch  # noqa: E402
from meshtrain.services.common.logging import setup_logging  # noqa: E402
from meshtrain.services.trainer.config.load import load_config  # noqa: E402
from meshtrain.services.trainer.metrics import peak_tflops  # noqa: E402
from meshtrain.services.trainer.train import Trainer  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(step_fn, warmup: int, device: torch.device) -> None:
    """Run steps 0..warmup-1 untimed (compilation, autotuning, the allocator's first sizes)."""
    for i in range(warmup):
        step_fn(i)
    sync(device)


def time_steps(step_fn, first: int, steps: int, device: torch.device) -> dict:
    """Time steps first..first+steps-1: {"step_time_s": the mean (total over the steps),
    "step_times_s": each step's seconds, "step_time_median_s"}.

    On CUDA each step is bounded by events on the current stream, so the host never waits inside
    the timed steps (the one synchronization is at the end); a step's time is the device's from
    one boundary to the next, idle gaps included. The per-step times tell a uniformly slower run
    (clocks, a kernel choice) from one with a few slow steps (a host stall).
    """
    sync(device)
    before = _allocator_counts(device)
    marks = []
    start = time.perf_counter()
    for i in range(first, first + steps):
        marks.append(_mark(device))
        step_fn(i)
    marks.append(_mark(device))
    sync(device)
    total = time.perf_counter() - start
    if device.type == "cuda":
        each = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
        after = _allocator_counts(device)
        allocator = {key: after[key] - before[key] for key in ALLOCATOR_COUNTS}
    else:
        each = [b - a for a, b in itertools.pairwise(marks)]
        allocator = None
    return {
        "step_time_s": total / steps,
        "step_times_s": each,
        "step_time_median_s": statistics.median(each),
        "allocator": allocator,
    }


ALLOCATOR_COUNTS = {  # JSON name -> torch.cuda.memory_stats() counter
    # no free block: the cache released (a device-wide sync), then again
    "alloc_retries": "num_alloc_retries",
    # the allocator waited for every stream to free blocks
    "sync_all_streams": "num_sync_all_streams",
    # cudaMalloc / cuMemMap: new memory, host time each
    "device_allocs": "num_device_alloc",
    # cudaFree / cuMemUnmap: a synchronization each
    "device_frees": "num_device_free",
}
"""The CUDA caching allocator's event counters that `time_steps` reports for its steps. Each one
that is not 0 inside timed steps is memory management, not the step's own work: the host waits
or the device is synchronized, so the steps around it run slower."""


def _allocator_counts(device: torch.device) -> dict | None:
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {key: stats.get(counter, 0) for key, counter in ALLOCATOR_COUNTS.items()}


def _mark(device: torch.device):
    """A step boundary: a recorded CUDA event on the device, the host clock elsewhere."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


PROFILE_MAX = 4
STARTED = (
    time.monotonic()
)  # "N s into the run" in each side's line: its build and compilation show as the gap
"""Steps `--profile-steps` may add. The run is planned for warmup + steps + PROFILE_MAX steps
whether it profiles or not: train.train_iters decides the sample order and the LR schedule,
so a profiled run must not plan a different length than the unprofiled rows it is compared
with (it once did, and its losses differed from theirs from the first step)."""


def meshtrain_step(args, overrides):
    """(trainer, step(i), losses): meshtrain's real loop step on the config,
    each step's loss appended."""
    planned = args.warmup + args.rounds * args.steps + PROFILE_MAX
    job = load_config(
        [
            "--config",
            args.config,
            "--train-iters",
            str(planned),
            "--eval-interval",
            "0",
            "--run-dir",
            args.run_dir,
            *overrides,
        ]
    )
    trainer = Trainer(job)
    losses = []

    def step(i):
        loss, _ = trainer.train_step(i)
        losses.append(loss)

    return trainer, step, losses


def variant_inputs(args, overrides, index: int) -> tuple[argparse.Namespace, list[str]]:
    """(args, overrides) for meshtrain's run of the `index`-th --variant: its own run directory, the
    variant's flags added."""
    suffix = "-variant" if index == 0 else f"-variant{index + 1}"
    return (
        argparse.Namespace(**{**vars(args), "run_dir": args.run_dir + suffix}),
        overrides + shlex.split(args.variant[index]),
    )


def variant_name(flags: str) -> str:
    """A --variant's side in the table and the JSON."""
    return f"meshtrain {flags}"


def meshtrain_row(trainer, losses, timed: dict) -> dict:
    """meshtrain's result row: the timing, the first and last step's loss (the whole batch's)."""
    first_last = torch.stack([losses[0], losses[-1]])
    if trainer.mesh.dp > 1:  # each dp rank's loss covers its share of the batch: report the batch's
        torch.distributed.all_reduce(first_last, group=trainer.mesh.group("dp"))
        first_last /= trainer.mesh.dp
    return {
        **timed,
        "loss_first": first_last[0].item(),
        "loss_last": first_last[1].item(),
        "flops_per_token": trainer.flops_per_token,
        "params": trainer.num_parameters,  # the whole model's
        "bf16_weight_copies": trainer.weight_copies is not None,
        "gradient_accumulation_fusion": trainer.weight_copies is not None
        and trainer.weight_copies.fused,
    }


def run_meshtrain(args, overrides) -> dict:
    trainer, step, losses = meshtrain_step(args, overrides)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    warm_up(step, args.warmup, trainer.device)
    timed = time_steps(step, args.warmup, args.steps, trainer.device)
    out = {
        **meshtrain_row(trainer, losses, timed),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9
        if torch.cuda.is_available()
        else None,
    }
    if args.profile_steps:
        out["breakdown"] = profile_steps(
            step,
            args.warmup + args.steps,
            args.profile_steps,
            trainer.device,
            trace_path(args, "meshtrain"),
        )
        out["breakdown"]["timed_ms"] = timed["step_time_s"] * 1e3
    return out, trainer.job


def trace_path(args, name: str) -> str | None:
    if not args.trace_dir:
        return None
    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(args.trace_dir) / f"{name}-rank{os.environ.get('RANK', '0')}.json")


class Baseline(NamedTuple):
    """One plain-PyTorch side of the run: its row's name, a short key (trace files), whether its
    residual stream is cast to bf16, and its torchao float8 recipe (None: no float8)."""

    name: str
    key: str
    bf16_residual: bool = False
    float8: str | None = None


PLAIN = Baseline("baseline (plain torch)", "baseline")
BF16_RESIDUAL = Baseline("baseline, bf16 residual", "baseline-bf16-residual", bf16_residual=True)


def float8_baseline(recipe: str) -> Baseline:
    return Baseline(
        f"baseline + torchao float8 ({recipe})", f"baseline-float8-{recipe}", float8=recipe
    )


def baseline_step(job, spec: Baseline = PLAIN):
    """(step(i), device, losses, info): the plain baseline's step on random tokens, each step's last
    micro-batch loss (divided by the micro-batch count) appended; `info` goes into its row (the
    float8 recipe and how many linear layers it converted)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = BaselineGPT(job.model, spec.bf16_residual).to(device)
    info = {}
    if spec.float8:
        info = {"float8": spec.float8, "float8_layers": len(convert_to_float8(model, spec.float8))}
    opt = make_optimizer(model, job.optim.lr, job.optim.weight_decay)
    fwd = torch.compile(model) if job.train.compile else model
    t = job.train
    n_micro = t.global_batch_size // t.micro_batch_size
    shape = (t.micro_batch_size, job.model.seq_length)
    vocab = job.model.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [
        torch.randint(0, vocab, (shape[0], shape[1] + 1), device=device, generator=gen)
        for _ in range(4)
    ]
    losses = []

    def step(i):
        for m in range(n_micro):
            b = batches[(i * n_micro + m) % len(batches)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.bf16):
                loss = fwd(b[:, :-1], b[:, 1:]) / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.clip_grad, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return step, device, losses, info


def baseline_row(job, losses, timed: dict, info: dict) -> dict:
    """The baseline's result row: the timing, the last step's loss (the whole batch's)
    and `info`."""
    n_micro = job.train.global_batch_size // job.train.micro_batch_size
    return {**timed, "loss_last": (losses[-1] * n_micro).item(), **info}


def run_baseline(args, job, spec: Baseline) -> dict:
    step, device, losses, info = baseline_step(job, spec)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    warm_up(step, args.warmup, device)
    timed = time_steps(step, args.warmup, args.steps, device)
    out = {
        **baseline_row(job, losses, timed, info),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9
        if torch.cuda.is_available()
        else None,
    }
    if args.profile_steps:
        out["breakdown"] = profile_steps(
            step, args.warmup + args.steps, args.profile_steps, device, trace_path(args, spec.key)
        )
        out["breakdown"]["timed_ms"] = timed["step_time_s"] * 1e3
    return out


def run_rounds(args, overrides, baselines: list[Baseline]) -> tuple[dict, object]:
    """--rounds R: build every side first and keep them all, warm each up, then time `steps` steps
    of each side in turn, R times over (the order rotating by one side a round). A drift of the
    machine over the run (clocks, a neighbour) then falls on every side alike, and the per-round
    ratios show how far one round's ratio can be trusted. Every side's weights, optimizer state and
    compiled graphs stay resident together, so peak memory is the process's, not a side's. Every
    side compiles after a float8 baseline is built, so with torchao's process-wide Inductor patch
    (run_sequential)."""
    sides = {}  # name -> (step, device, losses, trainer or the baseline's row info)
    trainer, step, losses = meshtrain_step(args, overrides)
    sides["meshtrain"] = (step, trainer.device, losses, trainer)
    job = trainer.job
    for spec in baselines:
        step, device, losses, info = baseline_step(job, spec)
        sides[spec.name] = (step, device, losses, info)
    for index, flags in enumerate(args.variant):
        before = dispatch.configured()
        other, step, losses = meshtrain_step(*variant_inputs(args, overrides, index))
        if dispatch.configured() != before:
            raise SystemExit(
                f"--rounds keeps every side's compiled graphs together, and --variant={flags} "
                f"changes the kernel choice ({before} -> {dispatch.configured()}), which drops "
                "them (meshtrain.kernels.dispatch.set_mode): time this variant with --rounds 1"
            )
        sides[variant_name(flags)] = (step, other.device, losses, other)
    for step, device, _, _ in sides.values():
        warm_up(step, args.warmup, device)
    names = list(sides)
    timed = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, device, _, _ = sides[name]
            timed[name].append(time_steps(step, args.warmup + r * args.steps, args.steps, device))
    rows = {}
    for name, (_, _, losses, owner) in sides.items():
        each = [t for one in timed[name] for t in one["step_times_s"]]
        merged = {
            "step_time_s": statistics.fmean(one["step_time_s"] for one in timed[name]),
            "step_times_s": each,
            "step_time_median_s": statistics.median(each),
            "round_step_time_s": [one["step_time_s"] for one in timed[name]],
            "round_allocator": [one["allocator"] for one in timed[name]],
            "allocator": _total(one["allocator"] for one in timed[name]),
            "peak_mem_gb": None,
        }
        if isinstance(owner, dict):
            rows[name] = baseline_row(job, losses, merged, owner)
        else:
            rows[name] = meshtrain_row(owner, losses, merged)
    return rows, job


def _total(counts) -> dict | None:
    """Per-round allocator counts summed, None where they are (off CUDA)."""
    counts = list(counts)
    return (
        None if None in counts else {key: sum(c[key] for c in counts) for key in ALLOCATOR_COUNTS}
    )


def release(job, reset: bool = True) -> None:
    """Before the next side builds its model: the last one's memory back (it is out of scope by
    now), and with `reset` its compiled graphs dropped."""
    if reset and job.train.compile:
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_sequential(
    args, overrides, baselines: list[Baseline], failed: dict[str, str]
) -> tuple[dict | None, object]:
    """The default: each side built, timed and released in turn (one side's memory at a time).
    Rows are None on ranks other than 0, which only take part in meshtrain's run. A variant that
    raises goes into `failed` (its name -> the error) and the next side runs. The float8
    baseline goes last: torchao's conversion patches Inductor's Triton min/max codegen for the
    whole process (a workaround for a Triton fp8 miscompile), and the sides before it compile
    as they would without it."""
    mesh, job = run_meshtrain(args, overrides)
    if int(os.environ.get("RANK", "0")) != 0:
        return None, job
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows: dict = {}

    def keep(name: str, row: dict) -> None:
        rows[name] = row
        save_partial(args, job, rows, failed)
        _done(name, row)

    keep(f"meshtrain x{world}" if world > 1 else "meshtrain", mesh)
    for spec in [b for b in baselines if not b.float8]:
        release(
            job, reset=spec.bf16_residual
        )  # the bf16-stream baseline compiles afresh: the plain one's graphs go
        keep(spec.name, run_baseline(args, job, spec))
    for index, flags in enumerate(args.variant):
        release(job)
        name = variant_name(flags)
        try:
            row, _ = run_meshtrain(*variant_inputs(args, overrides, index))
        except Exception as e:  # noqa: BLE001 (any failure of one variant: the other sides still count)
            failed[name] = f"{type(e).__name__}: {e}"
            save_partial(args, job, rows, failed)
            print(
                f"failed {name}: {failed[name]} ({time.monotonic() - STARTED:.0f} s into the run)",
                flush=True,
            )
            continue
        keep(name, row)
    for spec in [b for b in baselines if b.float8]:
        release(job)
        keep(spec.name, run_baseline(args, job, spec))
    return rows, job


def save_partial(args, job, rows: dict, failed: dict[str, str]) -> None:
    """The sides timed so far, written to --out after each side: a run cut short (a time limit
    while a later side compiles, a crash) keeps their numbers. `partial` is true until the
    complete result (ratios, MFU) replaces the file at the end."""
    tokens = job.train.global_batch_size * job.model.seq_length
    partial = {
        "partial": True,
        "config": args.config,
        "steps": args.steps,
        "warmup": args.warmup,
        "seq_length": job.model.seq_length,
        "global_batch_size": job.train.global_batch_size,
        "results": {
            name: {**row, "tokens_per_s": tokens / row["step_time_s"]} for name, row in rows.items()
        },
        "failed": dict(failed),
        "pending": [
            variant_name(flags)
            for flags in args.variant
            if variant_name(flags) not in rows and variant_name(flags) not in failed
        ],
    }
    Path(args.out).write_text(json.dumps(partial, indent=2))


def ratio(rows: dict, side: str, other: str) -> tuple[float, float]:
    """How much faster `side` is than `other`: from their tokens/s, and from their median steps
    (which one stalled step does not move)."""
    return (
        rows[side]["tokens_per_s"] / rows[other]["tokens_per_s"],
        rows[other]["step_time_median_s"] / rows[side]["step_time_median_s"],
    )


def _done(name: str, row: dict) -> dict:
    """Say a side's step time as soon as it is timed, and when since the script started (a side's
    build and compilation show as the gap): a run cut short (a time limit) still tells."""
    print(
        f"timed {name}: {row['step_time_s']:.4f} s/step (median {row['step_time_median_s']:.4f}), "
        f"{time.monotonic() - STARTED:.0f} s into the run",
        flush=True,
    )
    return row


def parse_args() -> tuple[argparse.Namespace, list[str], int]:
    """The options, the trainer overrides (the unknown flags) and the world size; the
    combinations that cannot run are refused here."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=100, help="timed optimizer steps")
    p.add_argument(
        "--warmup", type=int, default=10, help="untimed steps first (compile, allocator)"
    )
    p.add_argument("--run-dir", default="runs/bench")
    p.add_argument("--out", default="train_throughput.json")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument(
        "--baseline-bf16-residual",
        action="store_true",
        help="also run the baseline with its residual stream cast to bf16 (the plain baseline "
        "stays the ratio's denominator; this row shows what that cast alone is worth)",
    )
    p.add_argument(
        "--baseline-float8",
        choices=FLOAT8_RECIPES,
        metavar="RECIPE",
        help="also run the plain baseline with its blocks' linear layers in torchao's float8 "
        f"training (recipe: {' or '.join(FLOAT8_RECIPES)}; the output head stays bf16), and report "
        "meshtrain's ratio to it (needs torchao; not under torchrun; --skip-baseline leaves it)",
    )
    p.add_argument(
        "--variant",
        metavar="FLAGS",
        action="append",
        default=[],
        help="one process: after meshtrain, run meshtrain again with these overrides added (one "
        "string, e.g. --variant=--no-gradient-accumulation-fusion) and report meshtrain's ratio "
        "to it: what one option is worth, both sides measured in the same process. Repeatable: "
        "each variant is its own side, with its speedup over meshtrain in the JSON's `variants`",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="one process: keep every side built and time --steps steps of each in turn, this many "
        "times over (per-round ratios in the JSON; needs the memory of all sides at once)",
    )
    p.add_argument(
        "--single-gpu-json", help="a 1-GPU result of this script, for speedup / scaling efficiency"
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after timing, profile this many more steps of each side: kernel time by kind, "
        "device idle, exposed communication (benchmarks/step_breakdown.py)",
    )
    p.add_argument("--trace-dir", help="with --profile-steps, also write Chrome traces here")
    args, overrides = p.parse_known_args()
    if not 0 <= args.profile_steps <= PROFILE_MAX:
        p.error(f"--profile-steps must be between 0 and {PROFILE_MAX}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.variant and (world > 1 or not all(shlex.split(flags) for flags in args.variant)):
        p.error("--variant needs one process and at least one override")
    if len(set(args.variant)) < len(args.variant):
        p.error("--variant: each variant once")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.rounds > 1 and (world > 1 or args.profile_steps):
        p.error(
            "--rounds interleaves the sides of one process: not with torchrun or --profile-steps"
        )
    if args.baseline_float8 and world > 1:
        p.error("--baseline-float8 runs in one process, not under torchrun")
    return args, overrides, world


def main() -> None:
    args, overrides, world = parse_args()
    setup_logging("WARNING")
    baselines = [] if args.skip_baseline or world > 1 else [PLAIN]
    if baselines and args.baseline_bf16_residual:
        baselines.append(BF16_RESIDUAL)
    if args.baseline_float8:
        baselines.append(float8_baseline(args.baseline_float8))
    failed: dict[str, str] = {}
    if args.rounds > 1:
        rows, job = run_rounds(args, overrides, baselines)
    else:
        rows, job = run_sequential(args, overrides, baselines, failed)
    if rows is None:  # not rank 0
        return
    result = build_result(args, overrides, rows, job, failed, world)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_report(args, job, rows, result)
    print(f"wrote {args.out}")


def ratio_pairs(args) -> dict[str, tuple[str | None, str | None]]:
    """JSON key -> (the faster-is-larger side, the side it is divided by): the ratio of their
    tokens/s. The first --variant has the single-variant keys."""
    variant = variant_name(args.variant[0]) if args.variant else None
    float8 = float8_baseline(args.baseline_float8).name if args.baseline_float8 else None
    return {
        "ratio_tokens_per_s": ("meshtrain", PLAIN.name),
        "ratio_vs_bf16_residual_baseline": ("meshtrain", BF16_RESIDUAL.name),
        "ratio_vs_variant": ("meshtrain", variant),
        "ratio_vs_float8_baseline": ("meshtrain", float8),
        "variant_ratio_vs_float8_baseline": (
            variant,
            float8,
        ),  # meshtrain with --variant (FP8) against it
        "float8_baseline_speedup": (
            float8,
            PLAIN.name,
        ),  # what torchao's float8 is worth to the plain model
    }


def build_result(args, overrides, rows: dict, job, failed: dict[str, str], world: int) -> dict:
    """The JSON: the run's settings, every side's row (tokens/s and MFU added) and the ratios."""
    mesh = rows[next(iter(rows))]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = peak_tflops(device, job.train.peak_tflops)
    tokens = job.train.global_batch_size * job.model.seq_length
    for r in rows.values():
        r["tokens_per_s"] = tokens / r["step_time_s"]
        r["mfu"] = (
            mesh["flops_per_token"] * r["tokens_per_s"] / (peak * 1e12 * world) if peak else None
        )
    result = {
        "config": args.config,
        "overrides": overrides,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "seq_length": job.model.seq_length,
        "micro_batch_size": job.train.micro_batch_size,
        "global_batch_size": job.train.global_batch_size,
        "bf16": job.train.bf16,
        "compile": job.train.compile,
        "cuda_graph": job.train.cuda_graph,
        "kernels": job.train.kernels,
        "compiled_triton_ops": job.train.compiled_triton_ops,
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "world_size": world,
        "parallel": {
            k: getattr(job.parallel, k)
            for k in (
                "tp",
                "sequence_parallel",
                "tp_comm_overlap",
                "tp_async_grad_reduce",
                "use_distributed_optimizer",
                "overlap_grad_reduce",
                "overlap_param_gather",
                "grad_reduce_dtype",
                "recompute_granularity",
            )
        },
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "results": rows,
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("NCCL_", "TORCH_NCCL_")) or k == "CUDA_DEVICE_MAX_CONNECTIONS"
        },
    }
    if args.variant:
        result["variant"] = args.variant[0]
    pairs = ratio_pairs(args)
    float8 = pairs["ratio_vs_float8_baseline"][1]
    versus = {k: pair for k, pair in pairs.items() if pair[0] in rows and pair[1] in rows}
    if len(args.variant) > 1 or failed:
        result["variants"] = variant_results(args, rows, failed, float8)
    for key, (side, other) in versus.items():
        result[key], result[key + "_median"] = ratio(rows, side, other)
        if args.rounds > 1:  # each round's ratio, from that round's mean step times
            result[key + "_rounds"] = [
                o / m
                for m, o in zip(
                    rows[side]["round_step_time_s"], rows[other]["round_step_time_s"], strict=True
                )
            ]
    if (
        args.single_gpu_json
    ):  # scaling efficiency against a 1-GPU run recorded earlier in the same job
        single = json.loads(Path(args.single_gpu_json).read_text())["results"]["meshtrain"][
            "tokens_per_s"
        ]
        result["speedup_vs_1gpu"] = rows[next(iter(rows))]["tokens_per_s"] / single
        result["scaling_efficiency"] = result["speedup_vs_1gpu"] / world
    return result


def variant_results(args, rows: dict, failed: dict[str, str], float8: str | None) -> dict:
    """Every --variant's speedup over meshtrain (and over torchao float8), or its failure."""
    out: dict = {}
    for flags in args.variant:
        name = variant_name(flags)
        if name in failed:
            out[flags] = {"failed": failed[name]}
            continue
        one = dict(
            zip(
                ("speedup_vs_meshtrain", "speedup_vs_meshtrain_median"),
                ratio(rows, name, "meshtrain"),
            )
        )
        if float8 in rows:
            one["ratio_vs_float8_baseline"] = ratio(rows, name, float8)[0]
        out[flags] = one
    return out


def print_report(args, job, rows: dict, result: dict) -> None:
    """The table of sides and every ratio, variant and note of `result`."""
    pairs = ratio_pairs(args)
    variant, float8 = pairs["variant_ratio_vs_float8_baseline"]
    print(
        f"\n{args.config}  seq {job.model.seq_length}  mbs {job.train.micro_batch_size}  "
        f"gbs {job.train.global_batch_size}  {result['device']}"
    )
    width = max(24, *(len(name) + 2 for name in rows))
    print(
        f"{'impl':<{width}}{'tokens/s':>12}{'MFU':>8}{'s/step':>9}"
        f"{'median':>9}{'spread':>8}{'peak GB':>9}"
    )
    for name, r in rows.items():
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gb']:.1f}" if r["peak_mem_gb"] is not None else "-"
        spread = f"{(max(r['step_times_s']) / min(r['step_times_s']) - 1) * 100:.1f}%"
        print(
            f"{name:<{width}}{r['tokens_per_s']:>12,.0f}{mfu:>8}{r['step_time_s']:>9.3f}"
            f"{r['step_time_median_s']:>9.3f}{spread:>8}{mem:>9}"
        )
    if "ratio_tokens_per_s" in result:
        print(f"ratio meshtrain / baseline: {result['ratio_tokens_per_s']:.3f}")
    if "ratio_vs_bf16_residual_baseline" in result:
        print(
            "ratio meshtrain / bf16-residual baseline: "
            f"{result['ratio_vs_bf16_residual_baseline']:.3f}"
        )
    if "ratio_vs_variant" in result:
        print(f"ratio meshtrain / {variant}: {result['ratio_vs_variant']:.3f}")
    if "ratio_vs_float8_baseline" in result:
        print(f"ratio meshtrain / {float8}: {result['ratio_vs_float8_baseline']:.3f}")
    if "variant_ratio_vs_float8_baseline" in result:
        print(f"ratio {variant} / {float8}: {result['variant_ratio_vs_float8_baseline']:.3f}")
    if "float8_baseline_speedup" in result:
        print(f"ratio {float8} / baseline (plain torch): {result['float8_baseline_speedup']:.3f}")
    for key in pairs:
        if key + "_median" in result:
            print(f"{key} from the median steps: {result[key + '_median']:.3f}")
        if key + "_rounds" in result:
            print(f"{key} by round: {' '.join(f'{x:.3f}' for x in result[key + '_rounds'])}")
    for name, r in rows.items():
        if r["allocator"] and any(r["allocator"].values()):
            counts = ", ".join(f"{key} {n}" for key, n in r["allocator"].items() if n)
            print(
                f"note: {name}: the CUDA allocator inside the timed steps: {counts} "
                "(its slowest steps may be these)"
            )
    for flags, one in result.get("variants", {}).items():
        if "failed" in one:
            print(f"variant {flags}: failed ({one['failed']})")
            continue
        against = (
            f", {one['ratio_vs_float8_baseline']:.3f}x {float8}"
            if "ratio_vs_float8_baseline" in one
            else ""
        )
        print(
            f"variant {flags}: {one['speedup_vs_meshtrain']:.3f}x meshtrain (median steps "
            f"{one['speedup_vs_meshtrain_median']:.3f}x){against}"
        )
    if "speedup_vs_1gpu" in result:
        print(
            f"speedup vs 1 GPU: {result['speedup_vs_1gpu']:.3f}x "
            f"(scaling efficiency {result['scaling_efficiency']:.3f})"
        )
    for name, r in rows.items():
        if "breakdown" in r:
            print(format_breakdown(name, r["breakdown"]))


if __name__ == "__main__":
    main()
