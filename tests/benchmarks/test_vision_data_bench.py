"""benchmarks/vision_data_bench.py on CPU at a tiny size: the data-service mode (real `meshtrain
data serve` workers, the trainer's client) writes every field, consistently; the in-process mode
still writes its rows; bad worker counts are refused by name."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/vision_data_bench.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.e2e
def test_service_mode_one_and_two_workers(tmp_path):
    out = tmp_path / "out.json"
    done = bench(
        "--workers=1,2",
        "--batches=6",
        "--records=8",
        "--micro-batch-size=2",
        f"--out={out}",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    s = json.loads(out.read_text())["service"]
    assert s["settings"]["ranks"] == 2 and "sched_setaffinity" in s["settings"]["pinning"]
    one, two = s["rows"]
    assert (one["workers"], two["workers"]) == (1, 2)
    assert one["streams_per_worker"] == [2] and two["streams_per_worker"] == [1, 1]
    cores = sorted(os.sched_getaffinity(0))
    for r in (one, two):
        # every sample holds exactly one image
        assert r["micro_batches"] == 6 and r["images_total"] == 6 * 2
        assert 0 < r["images_timed"] < r["images_total"] and r["timed_s"] > 0
        assert r["images_per_s"] == pytest.approx(r["images_timed"] / r["timed_s"], rel=0.02)
        assert r["images_per_s_per_worker"] == pytest.approx(
            r["images_per_s"] / r["workers"], abs=0.1
        )
        assert len(r["worker_cpu_s"]) == r["workers"] and all(c > 0 for c in r["worker_cpu_s"])
        assert r["images_per_worker_cpu_s"] == pytest.approx(
            r["images_total"] / sum(r["worker_cpu_s"]), abs=0.1
        )
        assert r["worker_cores"] == [[c] for c in cores[: r["workers"]]]
        left = cores[r["workers"] :]
        assert r["client_cores"] == (left or cores)
        assert r["client_shares_worker_cores"] == (not left)
    assert two["vs_1_worker"] == pytest.approx(two["images_per_s"] / one["images_per_s"], abs=1e-3)
    assert s["scaling_2_over_1"] == two["vs_1_worker"]
    g = s["h200_llava_1_5_7b"]
    assert g["flops_per_sample"] == pytest.approx(
        g["lm_flops_per_token"] * 2048 + g["vision_flops_per_image"]
    )
    # LLaVA-1.5-7B: about 6 x 6.6 G weights + attention per token; ViT-L/14 ~1.2 TFLOP an image
    assert 4.0e10 < g["lm_flops_per_token"] < 4.6e10
    assert 1.0e12 < g["vision_flops_per_image"] < 1.4e12
    assert g["images_per_s"] == pytest.approx(0.5 * 989e12 / g["flops_per_sample"])
    assert g["per_worker_images_per_s"] == one["images_per_s_per_worker"]
    assert g["workers_needed"] == math.ceil(g["images_per_s"] / one["images_per_s_per_worker"])
    assert "ceil" in g["workers_formula"] and "mfu" in g["formula"]
    assert "one H200, LLaVA-1.5-7B at 50% MFU" in done.stdout


@pytest.mark.e2e
def test_in_process_mode_is_unchanged(tmp_path):
    out = tmp_path / "out.json"
    done = bench("--records=8", "--micro-batch-size=4", f"--out={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["resize_mode"], r["wire_dtype"]) for r in rows] == [
        ("crop", "uint8"),
        ("pad", "uint8"),
        ("crop", "bfloat16"),
    ]
    assert all(r["images"] == 8 and r["images_per_cpu_s"] > 0 for r in rows)


@pytest.mark.parametrize("workers", ["0", "1,x", ","])
def test_bad_worker_counts_are_refused(workers):
    done = bench(f"--workers={workers}", timeout=120)
    assert done.returncode == 2 and "--workers" in done.stderr and "like 1,2" in done.stderr
