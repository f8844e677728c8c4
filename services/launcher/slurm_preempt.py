"""Slurm preemption timed to the checkpoint: how long before its time limit a job must be told to
stop so that its final checkpoint is committed in time, and a timer that tells it then.

`#SBATCH --signal=B:TERM@SECONDS` takes a constant, written before the job knows its model, and
`scontrol update` cannot change a job's signal. So `deploy/slurm/train.sbatch` computes the lead
from the training arguments at start (`lead`) and runs a timer beside the ranks (`arm`) that
sends SIGTERM to the batch script `lead` seconds before the job's end, re-reading the time left
from Slurm (`squeue -o %L`) so a limit changed while the job runs is followed. The lead covers
the steps until the ranks act on the signal (they agree to stop at the next logging step), the
write of a checkpoint (fp32 weights and both AdamW moments: 12 bytes a trained parameter, 4 a
frozen one) at the storage's write bandwidth, twice where periodic saves are asynchronous (the
final save waits for one still uploading), and a margin for the commit and the requeue:

    lead = (log_interval + 1) * step_time + writes * checkpoint_bytes / write_bandwidth + margin

    python -m meshtrain.services.launcher.slurm_preempt lead [--write-mb-s 200] [--margin-s 60] \\
        [--step-time-s S] [--run-dir DIR] -- --config deploy/configs/gpt2-125m.toml \\
        [train overrides]
    python -m meshtrain.services.launcher.slurm_preempt arm --job JOBID --pid PID --lead SECONDS

`lead` prints the seconds on stdout and the reckoning on stderr. Step time: `--step-time-s`, else
the slowest of the last logged steps in the run directory's metrics.jsonl (a requeued run has
them), else 0 (the margin must cover it). `arm` exits once it has signalled, when the process it
guards is gone, or at once (with the reason) when the job's whole time is shorter than the lead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from meshtrain.services.common.errors import ConfigError, MeshtrainError

BYTES_PER_TRAINED_PARAMETER = 12
"""fp32 weight + AdamW's exp_avg and exp_avg_sq, all fp32 in a checkpoint."""
BYTES_PER_FROZEN_PARAMETER = 4
"""fp32 weight, no moments (the router's expert bias)."""
DEFAULT_WRITE_MB_S = 200.0
"""Aggregate checkpoint write bandwidth when none is given: below what one checkpoint-service
replica writes to local disk, above a save to S3 on loopback (measured: BENCHMARKS.md, 'Services
at scale' and 'Checkpoints: persist, load and stall')."""
DEFAULT_MARGIN_S = 60.0
"""Commit, process exit, requeue."""


@dataclass(frozen=True)
class Lead:
    """The reckoning of a preemption lead."""

    parameters: int
    checkpoint_bytes: int
    write_mb_s: float
    step_time_s: float
    steps_to_stop: int
    margin_s: float
    writes: int = 1
    """Checkpoint writes to wait for: 2 where a periodic asynchronous save may still be
    uploading."""

    @property
    def write_s(self) -> float:
        return self.writes * self.checkpoint_bytes / (self.write_mb_s * 1e6)

    @property
    def seconds(self) -> int:
        return math.ceil(self.steps_to_stop * self.step_time_s + self.write_s + self.margin_s)

    def explain(self) -> str:
        times = "" if self.writes == 1 else f"{self.writes} x "
        return (
            f"{self.parameters:,} parameters, {times}checkpoint {self.checkpoint_bytes / 1e6:,.1f} "
            f"MB at {self.write_mb_s:g} MB/s = {self.write_s:.1f} s; {self.steps_to_stop} steps of "
            f"{self.step_time_s:.2f} s; margin {self.margin_s:g} s: lead {self.seconds} s"
        )


def checkpoint_size(job) -> tuple[int, int]:
    """(parameters, checkpoint bytes) of the model of `job` (a trainer JobConfig).

    The model is built on the meta device (no memory, exact for every architecture setting);
    the vocabulary is model.vocab_size, or the tokenizer's as the trainer would find it.

    Raises:
        ConfigError: its tokenizer cannot be read.
    """
    import torch

    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
    from meshtrain.services.trainer.config.load import replace
    from meshtrain.services.trainer.model.gpt import GPT

    if job.model.vocab_size is None:
        d = job.data
        if not d.data_path and d.tokenizer == "bpe":  # trained by the trainer on the default corpus
            vocab = d.default_vocab_size
        else:
            try:
                vocab = build_tokenizer(d.tokenizer).vocab_size
            except (OSError, ValueError, MeshtrainError) as e:
                raise ConfigError(
                    f"data.tokenizer={d.tokenizer!r} cannot be read for the vocabulary size "
                    f"({e}); set model.vocab_size"
                ) from e
        job = replace(job, model={"vocab_size": vocab})
    with torch.device("meta"):
        model = GPT(job.model)
    parameters = model.num_parameters()  # padded vocabulary rows are not stored
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    size = (parameters - frozen) * BYTES_PER_TRAINED_PARAMETER + frozen * BYTES_PER_FROZEN_PARAMETER
    return parameters, size


def logged_step_time(run_dir: Path, last: int = 20) -> float | None:
    """The slowest step_time_s of the last `last` lines of run_dir/metrics.jsonl; None without
    any."""
    metrics = run_dir / "metrics.jsonl"
    try:
        lines = metrics.read_text().splitlines()[-last:]
    except OSError:
        return None
    times = []
    for line in lines:
        try:
            value = json.loads(line).get("step_time_s")
        except (json.JSONDecodeError, AttributeError):
            continue  # a line cut short by the kill that ended the last run
        if isinstance(value, (int, float)) and value > 0:
            times.append(float(value))
    return max(times) if times else None


def compute_lead(
    train_args: list[str],
    write_mb_s: float = DEFAULT_WRITE_MB_S,
    margin_s: float = DEFAULT_MARGIN_S,
    step_time_s: float | None = None,
    run_dir: str | None = None,
) -> Lead:
    """The lead for a job of `train_args` (see the module docstring).

    Raises:
        ConfigError: the arguments do not make a valid job, or a setting here is out of range.

    Args:
        train_args: the trainer's arguments (`--config FILE`, overrides).
        write_mb_s: aggregate write bandwidth of the checkpoint storage, MB/s.
        margin_s: seconds added for the commit, the exit and the requeue.
        step_time_s: seconds per training step; None: from run_dir's metrics, else 0.
        run_dir: the job's run directory, used when the arguments set no log.run_dir.
    """
    from meshtrain.services.trainer.config.load import load_config

    if write_mb_s <= 0:
        raise ConfigError(f"the checkpoint write bandwidth must be positive, got {write_mb_s} MB/s")
    if margin_s < 0:
        raise ConfigError(f"the preemption margin must not be negative, got {margin_s} s")
    if step_time_s is not None and step_time_s < 0:
        raise ConfigError(f"the step time must not be negative, got {step_time_s} s")
    job = load_config(train_args)
    if step_time_s is None:
        folder = job.log.run_dir or run_dir
        step_time_s = (logged_step_time(Path(folder)) if folder else None) or 0.0
    parameters, size = checkpoint_size(job)
    c = job.checkpoint
    writes = 2 if c.save_interval > 0 and c.async_save else 1
    return Lead(
        parameters, size, write_mb_s, step_time_s, job.log.log_interval + 1, margin_s, writes
    )


def parse_time_left(text: str) -> int | None:
    """Seconds of squeue's `%L` ([days-][hours:]minutes:seconds); None for no limit.

    Raises:
        ValueError: anything else.
    """
    text = text.strip()
    if text in ("UNLIMITED", "NOT_SET", "INFINITE"):
        return None
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if (
        not 2 <= len(parts) <= 3
        or not all(p.isdigit() for p in parts)
        or (days and not days.isdigit())
    ):
        raise ValueError(f"not a Slurm time left: {text!r}")
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


def time_left(job_id: str) -> int | None:
    """Seconds until job `job_id` reaches its time limit, from Slurm; None when it has none.

    Raises:
        RuntimeError: squeue failed or does not know the job.
    """
    result = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%L"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0 or not result.stdout.strip():
        raise RuntimeError(f"squeue -j {job_id}: {result.stderr.strip() or 'no such job'}")
    try:
        return parse_time_left(result.stdout.splitlines()[0])
    except ValueError as e:
        raise RuntimeError(f"squeue -j {job_id}: {e}") from e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def arm(
    job_id: str,
    pid: int,
    lead_s: int,
    poll_s: float = 60.0,
    clock=time.monotonic,
    sleep=time.sleep,
    query=time_left,
) -> str:
    """Send SIGTERM to `pid` once job `job_id` has `lead_s` seconds or less left.

    Polls Slurm every `poll_s` at most (sleeping straight to the moment when it is nearer), so
    a time limit raised or lowered meanwhile is followed. A job with no time limit is polled on.

    Returns:
        What ended the timer: "signalled", "gone" (pid ended first) or "too short" (the job's
        time left at the first poll is not more than the lead: signalling at once would requeue
        the job forever).
    """
    first = True
    failures = 0
    while _alive(pid):
        try:
            left = query(job_id)
            failures = 0
        except RuntimeError as e:
            failures += 1
            if failures == 1:
                print(
                    f"train: preemption timer: {e}; retrying every {poll_s:g} s",
                    file=sys.stderr,
                    flush=True,
                )
            sleep(poll_s)
            continue
        if left is not None and first and left <= lead_s:
            print(
                f"train: preemption timer: the job has {left} s, not more than the {lead_s} s a "
                "checkpoint needs; not armed (--signal's lead applies): give the job a longer "
                "--time",
                flush=True,
            )
            return "too short"
        if first:
            print(
                f"train: preemption timer: SIGTERM {lead_s} s before the time limit "
                f"({'no limit' if left is None else f'{left} s left now'})",
                flush=True,
            )
        first = False
        if left is not None and left <= lead_s:
            print(
                f"train: preemption timer: {left} s left, the checkpoint needs {lead_s} s: SIGTERM",
                flush=True,
            )
            os.kill(pid, signal.SIGTERM)
            return "signalled"
        sleep(poll_s if left is None else max(1.0, min(poll_s, left - lead_s)))
    return "gone"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(
        prog="python -m meshtrain.services.launcher.slurm_preempt",
        description="Slurm preemption lead from the checkpoint size, and its timer.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser(
        "lead", help="print the preemption lead in seconds (train arguments after --)"
    )
    lp.add_argument(
        "--write-mb-s",
        type=float,
        default=DEFAULT_WRITE_MB_S,
        help=f"checkpoint write bandwidth, MB/s (default {DEFAULT_WRITE_MB_S:g})",
    )
    lp.add_argument(
        "--margin-s",
        type=float,
        default=DEFAULT_MARGIN_S,
        help=f"seconds for the commit, exit and requeue (default {DEFAULT_MARGIN_S:g})",
    )
    lp.add_argument(
        "--step-time-s",
        type=float,
        default=None,
        help="seconds per step (default: from RUN_DIR/metrics.jsonl, else 0)",
    )
    lp.add_argument(
        "--run-dir", default=None, help="the job's run directory (the arguments' log.run_dir wins)"
    )
    ap = sub.add_parser("arm", help="SIGTERM a process LEAD seconds before the job's time limit")
    ap.add_argument("--job", required=True, help="Slurm job id")
    ap.add_argument("--pid", type=int, required=True, help="process to signal (the batch script)")
    ap.add_argument("--lead", type=int, required=True, help="seconds before the time limit")
    ap.add_argument(
        "--poll-s", type=float, default=60.0, help="longest sleep between looks at the time left"
    )
    args = p.parse_args(own)
    if args.cmd == "lead":
        try:
            lead = compute_lead(
                train_args, args.write_mb_s, args.margin_s, args.step_time_s, args.run_dir
            )
        except MeshtrainError as e:
            print(f"slurm_preempt: error: {e}", file=sys.stderr)
            return 2
        print(f"train: preemption lead: {lead.explain()}", file=sys.stderr)
        print(lead.seconds)
        return 0
    if train_args:
        p.error("arm takes no training arguments")
    if args.lead < 0 or args.poll_s <= 0:
        p.error("--lead must not be negative and --poll-s must be positive")
    arm(args.job, args.pid, args.lead, args.poll_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
