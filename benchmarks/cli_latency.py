"""How long `meshtrain` takes to answer a mistake: a bad flag and a missing config file, against
`meshtrain --help` in the same run.

    python benchmarks/cli_latency.py --runs 5 [--out FILE] [--no-reference]

Each command runs in a fresh interpreter (`python -m meshtrain ...`, what the `meshtrain` script
runs), the commands taking turns round by round so load from other work falls on each alike;
every figure is the median wall time over `--runs`. The reference row times
`import meshtrain.services.trainer.train` alone: what every mistake cost while the trainer was
imported before the command line was checked. The load average before and after is recorded,
since on a shared machine it decides the absolute figures. Prints a table and writes JSON
(default: benchmarks/results/DATE-cli-latency.json).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, arguments after `python`, the exit status the command must give)
COMMANDS = [
    ("meshtrain --help (baseline)", ["-m", "meshtrain", "--help"], 0),
    ("meshtrain train --help", ["-m", "meshtrain", "train", "--help"], 0),
    ("meshtrain train --bogus-flag", ["-m", "meshtrain", "train", "--bogus-flag"], 2),
    (
        "meshtrain train --config missing.toml",
        ["-m", "meshtrain", "train", "--config", "missing.toml"],
        2,
    ),
]
REFERENCE = (
    "import meshtrain.services.trainer.train (reference)",
    ["-c", "import meshtrain.services.trainer.train"],
    0,
)


def time_once(args: list[str], expect: int, cwd: str) -> float:
    """Wall seconds of one `python ARGS` in a fresh process, checked for its exit status."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != expect:
        raise SystemExit(f"python {' '.join(args)}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="runs of each command (median reported)")
    p.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/...)")
    p.add_argument(
        "--no-reference", action="store_true", help="skip timing the trainer import itself"
    )
    args = p.parse_args(argv)
    commands = COMMANDS + ([] if args.no_reference else [REFERENCE])
    times: dict[str, list[float]] = {name: [] for name, _, _ in commands}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as cwd:  # missing.toml is missing there
        # One untimed round first: the first process after a while reads the files from disk.
        for _, cmd, expect in commands:
            time_once(cmd, expect, cwd)
        for _ in range(args.runs):
            for name, cmd, expect in commands:
                times[name].append(time_once(cmd, expect, cwd))
    load_after = os.getloadavg()
    baseline = statistics.median(times[COMMANDS[0][0]])
    rows = {
        name: {
            "median_s": statistics.median(ts),
            "runs_s": ts,
            "vs_baseline": statistics.median(ts) / baseline,
        }
        for name, ts in times.items()
    }
    record = {
        "benchmark": "cli_latency",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        "runs": args.runs,
        "results": rows,
    }
    print(f"{'command':<55} {'median s':>9} {'x --help':>9}")
    for name, row in rows.items():
        print(f"{name:<55} {row['median_s']:9.2f} {row['vs_baseline']:9.2f}")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{record['date']}-cli-latency.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
