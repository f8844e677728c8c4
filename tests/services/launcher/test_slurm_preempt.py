"""The Slurm preemption lead (checkpoint bytes from the model config) and its timer.

The timer signals a real child process; Slurm's answer is given as a function so the schedule
can be checked without waiting out real minutes (tests/deploy/test_slurm.py runs it on a real
Slurm job against squeue).
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher import slurm_preempt
from meshtrain.services.launcher.slurm_preempt import (
    arm,
    compute_lead,
    logged_step_time,
    parse_time_left,
)

REPO = Path(__file__).resolve().parents[3]
TINY = ["--config", "deploy/configs/tiny.toml"]


def gpt2_parameters(layers, hidden, vocab, positions):
    """GPT-2 with biases, tied embeddings: per block 12h^2 + 13h, final norm 2h."""
    return (
        vocab * hidden
        + positions * hidden
        + layers * (12 * hidden * hidden + 13 * hidden)
        + 2 * hidden
    )


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("0:59", 59),
        ("12:03", 723),
        ("1:00:00", 3600),
        ("2-03:04:05", 2 * 86400 + 3 * 3600 + 4 * 60 + 5),
        ("UNLIMITED", None),
        ("NOT_SET", None),
        (" 5:00\n", 300),
    ],
)
def test_squeue_time_left_is_parsed(text, seconds):
    assert parse_time_left(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "a:b", "1:2:3:4", "x-1:00", "INVALID"])
def test_an_unreadable_time_left_is_an_error_naming_it(text):
    with pytest.raises(ValueError, match="not a Slurm time left"):
        parse_time_left(text)


def test_the_lead_counts_weights_and_both_adam_moments_at_the_write_bandwidth(monkeypatch):
    monkeypatch.chdir(REPO)
    lead = compute_lead(TINY, write_mb_s=2.0, margin_s=30, step_time_s=0.5)
    n = gpt2_parameters(
        layers=4, hidden=128, vocab=4096, positions=128
    )  # tiny.toml, its BPE's 4096
    assert lead.parameters == n
    assert lead.checkpoint_bytes == 12 * n
    assert lead.steps_to_stop == 11  # log_interval 10: the ranks stop at the next logging step
    assert lead.writes == 2  # save_interval 100, asynchronous: a periodic save may be uploading
    assert lead.seconds == -(-(11 * 0.5 + 2 * 12 * n / 2e6 + 30) // 1)
    assert f"lead {lead.seconds} s" in lead.explain() and "2 x checkpoint" in lead.explain()
    for only_final in (["--checkpoint.save_interval=0"], ["--checkpoint.async_save=false"]):
        assert (
            compute_lead([*TINY, *only_final], write_mb_s=2.0, margin_s=30, step_time_s=0.5).writes
            == 1
        )
    # overrides count: a wider model needs a longer lead
    wider = compute_lead(
        [*TINY, "--model.hidden_size=256"], write_mb_s=2.0, margin_s=30, step_time_s=0.5
    )
    assert wider.parameters == gpt2_parameters(4, 256, 4096, 128) and wider.seconds > lead.seconds


def test_the_step_time_comes_from_the_run_directory_when_not_given(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert logged_step_time(tmp_path) is None
    lines = [
        json.dumps({"step": i, "step_time_s": t})
        for i, t in enumerate([9.0] + [0.2] * 20 + [0.7, 0.3])
    ]
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(lines) + '\n{"step": 24, "loss"'
    )  # last line cut short
    assert (
        logged_step_time(tmp_path) == 0.7
    )  # the slowest of the last 20, not the first step's compile
    lead = compute_lead([*TINY, "--log.log_interval=1"], margin_s=0, run_dir=str(tmp_path))
    assert lead.step_time_s == 0.7 and lead.steps_to_stop == 2
    assert compute_lead(TINY, margin_s=0, run_dir=str(tmp_path / "new")).step_time_s == 0.0


def test_bad_settings_and_arguments_are_errors_naming_them(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="write bandwidth must be positive"):
        compute_lead(TINY, write_mb_s=0)
    with pytest.raises(ConfigError, match="data.tokenizer='/no/such.json' cannot be read"):
        compute_lead([*TINY, "--data.tokenizer=/no/such.json"])
    assert slurm_preempt.main(["lead", "--", *TINY, "--model.no_such_key=1"]) == 2
    assert "model.no_such_key" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_command_prints_the_lead_alone_on_stdout():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtrain.services.launcher.slurm_preempt",
            "lead",
            "--write-mb-s",
            "1",
            "--margin-s",
            "5",
            "--step-time-s",
            "0",
            "--",
            *TINY,
            "--checkpoint.save_interval=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=REPO,
    )
    n = gpt2_parameters(4, 128, 4096, 128)
    assert out.stdout == f"{-(-(12 * n / 1e6 + 5) // 1):.0f}\n"
    assert f"{n:,} parameters" in out.stderr


class FakeSlurm:
    """Time left as Slurm would report it on a clock the timer's sleeps advance: the job ends at
    `end` (None: no limit), moved to `new_end` at time `at` when `limit_change` is (at, new_end)."""

    def __init__(self, end, limit_change=None):
        self.end, self.now, self.sleeps, self.limit_change = end, 0.0, [], limit_change

    def query(self, job):
        assert job == "42"
        if self.limit_change and self.now >= self.limit_change[0]:
            self.end, self.limit_change = self.limit_change[1], None
        return None if self.end is None else int(self.end - self.now)

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_the_timer_signals_when_the_time_left_reaches_the_lead(child):
    slurm = FakeSlurm(end=1000)
    assert arm("42", child.pid, 300, poll_s=60, sleep=slurm.sleep, query=slurm.query) == "signalled"
    assert child.wait(10) == -signal.SIGTERM
    assert 700 <= slurm.now < 710 and max(slurm.sleeps) <= 60  # polled at most a minute apart


def test_the_timer_follows_a_limit_changed_while_the_job_runs(child):
    slurm = FakeSlurm(end=1000, limit_change=(120, 5000))  # `scontrol update TimeLimit=` at t=120 s
    assert arm("42", child.pid, 300, poll_s=60, sleep=slurm.sleep, query=slurm.query) == "signalled"
    assert 4700 <= slurm.now < 4710


def test_the_timer_refuses_a_job_shorter_than_the_lead_and_ends_with_its_process(child, capsys):
    slurm = FakeSlurm(end=200)
    assert arm("42", child.pid, 300, sleep=slurm.sleep, query=slurm.query) == "too short"
    assert "not armed" in capsys.readouterr().out and child.poll() is None
    unlimited = FakeSlurm(end=None)

    def ends(s):
        unlimited.sleep(s)
        if unlimited.now > 600:
            child.kill()
            child.wait()

    assert arm("42", child.pid, 300, sleep=ends, query=unlimited.query) == "gone"
