"""benchmarks/memory_breakdown.py: the trace replay and the grouping by site
(the GPU run itself is on the H200)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.memory_breakdown import (
    NO_FRAME,
    REPO,
    STDLIB_DIR,
    group,
    peak_live,
    site_and_owner,
)

TORCH_FILE = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "module.py")
MODEL = os.path.join(REPO, "services", "trainer", "model", "gpt.py")


def alloc(addr, size, frames=()):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr, size, action="free_requested"):
    return {"action": action, "addr": addr, "size": size, "frames": []}


def test_peak_is_the_highest_total_at_or_after_the_start_with_the_blocks_alive_there():
    trace = [
        alloc(1, 100),
        alloc(2, 1000),
        free(2, 1000),  # before the step: a higher total
        alloc(3, 50),
        alloc(4, 300),
        free(3, 50),
        free(3, 50, "free_completed"),
        alloc(5, 20),
        free(4, 300),
    ]
    peak, at, live = peak_live(trace, start=3, base=7)
    assert (peak, at) == (7 + 100 + 50 + 300, 4)
    assert sorted(live) == [1, 3, 4]


def test_a_free_completed_without_its_request_still_frees_and_unknown_frees_are_ignored():
    trace = [alloc(1, 10), free(1, 10, "free_completed"), free(99, 5), alloc(2, 4)]
    assert peak_live(trace, start=1)[:2] == (4, 3)


def test_a_step_without_allocations_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="allocated nothing"):
        peak_live([alloc(1, 10)], start=1)


def test_site_is_the_first_frame_outside_torch_and_owner_the_first_in_the_repo(tmp_path):
    generated = tmp_path / "cxyz.py"
    generated.write_text(
        "def call(args):\n"
        "    buf0 = empty_strided_cuda((16, 1024, 3072), (1, 1, 1), torch.bfloat16)\n"
    )
    frames = [
        {"filename": TORCH_FILE, "line": 10, "name": "_call_impl"},
        {"filename": str(generated), "line": 2, "name": "call"},
        {"filename": TORCH_FILE, "line": 20, "name": "forward"},
        {"filename": MODEL, "line": 150, "name": "forward"},
    ]
    site, owner = site_and_owner(frames)
    assert site == (
        "cxyz.py:2 call  [buf0 = empty_strided_cuda((16, 1024, 3072), (1, 1, 1), torch.bfloat16)]"
    )
    assert owner == "services/trainer/model/gpt.py:150 forward"
    # a repository frame is its own site and owner, without source text
    assert site_and_owner(frames[3:]) == ("services/trainer/model/gpt.py:150 forward",) * 2
    assert site_and_owner([]) == (NO_FRAME, "")
    assert site_and_owner(
        [{"filename": os.path.join(STDLIB_DIR, "contextlib.py"), "line": 1, "name": "f"}]
    ) == (NO_FRAME, "")


def test_groups_sum_by_site_and_owner_largest_first():
    here = [{"filename": MODEL, "line": 1, "name": "a"}]
    there = [{"filename": MODEL, "line": 2, "name": "b"}]
    live = {1: alloc(1, 10, here), 2: alloc(2, 30, there), 3: alloc(3, 25, here), 4: alloc(4, 1)}
    assert [(g["site"], g["bytes"], g["blocks"]) for g in group(live)] == [
        ("services/trainer/model/gpt.py:1 a", 35, 2),
        ("services/trainer/model/gpt.py:2 b", 30, 1),
        (NO_FRAME, 1, 1),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.e2e
def test_without_a_gpu_it_says_it_needs_one():
    script = str(Path(REPO) / "benchmarks" / "memory_breakdown.py")
    run = subprocess.run(
        [sys.executable, script, "--config", "deploy/configs/tiny.toml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2 and "needs a CUDA device" in run.stderr
