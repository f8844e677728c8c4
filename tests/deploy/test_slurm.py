"""deploy/slurm/*.sbatch on a real single-node Slurm cluster (tests/deploy/slurm_cluster.py).

The services job starts 2 data workers and the checkpoint service and publishes their
addresses; the training job (srun + torchrun's c10d rendezvous, 2 ranks) reads them, trains,
and is preempted the way `--signal=B:TERM@120` does it (SIGTERM to the batch shell only):
the ranks commit a checkpoint and exit, the job requeues itself, and the requeued run resumes
from that checkpoint and finishes. Skipped, with the reason, where slurm-wlm and munge are not
installed or not running as root.
"""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.services.checkpoint.reader import list_checkpoints
from meshtrain.services.dataloader.preprocess import prepare_default_dataset
from meshtrain.services.dataloader.rpc.discovery import announced, resolve_workers
from meshtrain.services.launcher.topology import free_port
from tests.deploy.slurm_cluster import SlurmCluster, missing_requirements
from tests.services.trainer.conftest import small_job_args

REPO = Path(__file__).resolve().parents[2]


def sourced(services_file: Path) -> dict[str, str]:
    """The variables of SERVICES_FILE as train.sbatch gets them: sourced by bash."""
    names = ("DATA_ADDRESSES", "CKPT_ADDRESS", "SAVE_ROOT", "TOKEN_FILE")
    out = subprocess.run(
        [
            "bash",
            "-c",
            'set -euo pipefail; source "$1"; shift; for n; do printf "%s\\0" "${!n}"; done',
            "_",
            str(services_file),
            *names,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return dict(zip(names, out.stdout.split("\0"), strict=False))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing_requirements()
    if why:
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def excerpt(log: str) -> str:
    """The end of a job's log, after any stack dump a rank wrote on a stop that hung (the
    trainer's faulthandler dump, 90 s after the signal): where a stuck rank was."""
    dumps = [part[:4000] for part in log.split("Timeout (")[1:]]
    return (
        "".join(f"--- stack dump\nTimeout ({d}\n" for d in dumps) + "--- log tail\n" + log[-3000:]
    )


def wait_for(predicate, what, timeout=180, logs=()):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{excerpt(p.read_text())}" for p in logs if p.exists())
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.3)


@pytest.mark.e2e
@pytest.mark.dist
def test_services_job_and_preempted_training_job_requeue_and_resume(cluster, tmp_path):
    venv_bin = Path(sys.executable).parent
    env = {
        "PATH": f"{venv_bin}:/usr/bin:/bin:/usr/sbin:/sbin",
        "SERVICES_FILE": str(tmp_path / "services.env"),
        "SAVE_ROOT": str(tmp_path / "ckpt"),
        "DATA_ROOTS": str(tmp_path),  # the corpus below is outside the workers' default roots
        "DATA_WORKERS": "2",
        "DATA_PORT": str(free_port()),
        "CKPT_PORT": str(free_port()),
        "BIND": "127.0.0.1",
        "NPROC_PER_NODE": "2",
        "RDZV_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "DEVICE": "cpu",
        "RUNS_ROOT": str(tmp_path / "runs"),
    }
    services_log, train_log, more_log = (
        tmp_path / "services.out",
        tmp_path / "train.out",
        tmp_path / "more.out",
    )
    more = None
    services = cluster.run(
        [
            "sbatch",
            "--parsable",
            "--export=ALL",
            f"--output={services_log}",
            "--cpus-per-task=2",
            "deploy/slurm/services.sbatch",
        ],
        cwd=REPO,
        env=env,
    ).stdout.strip()
    try:
        wait_for((tmp_path / "services.env").exists, "the services' addresses", logs=[services_log])
        published = sourced(tmp_path / "services.env")
        host = published["CKPT_ADDRESS"].rsplit(":", 1)[0]
        workers_dir = tmp_path / "services.env.workers"
        assert published["DATA_ADDRESSES"] == f"dir:{workers_dir}"
        assert resolve_workers(published["DATA_ADDRESSES"]) == sorted(
            f"{host}:{int(env['DATA_PORT']) + i}" for i in range(2)
        )
        assert published["CKPT_ADDRESS"] == f"{host}:{env['CKPT_PORT']}"
        # a worker added by a job of its own announces itself beside the services job's two
        more = cluster.run(
            [
                "sbatch",
                "--parsable",
                "--export=ALL",
                f"--output={more_log}",
                "--cpus-per-task=1",
                "deploy/slurm/data-workers.sbatch",
            ],
            cwd=REPO,
            env={**env, "DATA_WORKERS": "1", "DATA_PORT": str(free_port())},
        ).stdout.strip()
        wait_for(
            lambda: len(announced(workers_dir)) == 3,
            "the added worker's announcement",
            logs=[more_log],
        )

        cache = tmp_path / "corpus"
        prepare_default_dataset(cache, tokenizer="byte", max_bytes=400_000)
        # no --log.run_dir: the job's own, runs/slurm-JOBID, the same folder after the requeue
        args = [
            a
            for a in small_job_args(
                cache,
                tmp_path / "unused",
                **{
                    "train.train_iters": 120,
                    "train.eval_interval": 0,
                    "checkpoint.save_interval": 1000,
                },
            )
            if not a.startswith("--log.run_dir=")
        ]
        job = cluster.run(
            [
                "sbatch",
                "--parsable",
                "--export=ALL",
                f"--output={train_log}",
                "--cpus-per-task=2",
                "deploy/slurm/train.sbatch",
                *args,
            ],
            cwd=REPO,
            env=env,
        ).stdout.strip()
        metrics = tmp_path / "runs" / f"slurm-{job}" / "metrics.jsonl"
        wait_for(
            lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 15,
            "15 logged steps",
            logs=[train_log, services_log],
        )
        # what --signal=B:TERM@120 does before the time limit
        cluster.run(["scancel", "--batch", "--signal=TERM", job])
        wait_for(
            lambda: cluster.job_field(job, "Restarts") == "1",
            "the job to requeue itself",
            logs=[train_log],
        )
        wait_for(
            lambda: cluster.job_field(job, "JobState") == "COMPLETED",
            "the requeued run to finish",
            timeout=240,
            logs=[train_log, services_log],
        )
        log = train_log.read_text()
        assert cluster.job_field(job, "ExitCode") == "0:0", excerpt(log)
        assert "train: SIGTERM: ranks checkpoint and exit" in log, excerpt(log)
        stopped = [line for line in log.splitlines() if "stopped at step" in line]
        assert stopped, excerpt(log)
        step = int(stopped[0].split("stopped at step ")[1].split()[0])
        assert 15 <= step < 120, excerpt(log)
        assert f"train.sh: resuming from {tmp_path / 'ckpt'}" in log, excerpt(log)
        assert list_checkpoints(str(tmp_path / "ckpt")) == [step, 120], excerpt(log)
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert steps[-1] == 120 and step + 1 in steps, steps  # both runs of the job wrote here
    finally:
        for extra in (more, services):
            if extra is not None:
                cluster.run(["scancel", "--signal=TERM", "--full", extra], check=False)
    for extra, log_file in ((more, more_log), (services, services_log)):
        if extra is not None:
            wait_for(
                lambda: cluster.job_field(extra, "JobState") in (None, "COMPLETED", "CANCELLED"),  # noqa: B023
                "the services jobs to stop",
                logs=[log_file],
            )
    assert not (tmp_path / "services.env").exists()  # a stopped service job withdraws its addresses
    assert announced(tmp_path / "services.env.workers") == []  # and every worker its announcement


@pytest.mark.e2e
def test_a_training_job_without_gpus_stops_at_once_unless_cpu_is_meant(cluster, tmp_path):
    services_file = tmp_path / "services.env"
    services_file.write_text(
        "DATA_ADDRESSES=127.0.0.1:1\nCKPT_ADDRESS=127.0.0.1:2\nSAVE_ROOT=/nowhere\n"
    )
    log = tmp_path / "train.out"
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin:/usr/sbin:/sbin",
        "SERVICES_FILE": str(services_file),
    }
    job = cluster.run(
        [
            "sbatch",
            "--parsable",
            "--export=ALL",
            f"--output={log}",
            "--no-requeue",
            "deploy/slurm/train.sbatch",
            "--config",
            "deploy/configs/tiny.toml",
        ],
        cwd=REPO,
        env=env,
    ).stdout.strip()
    wait_for(
        lambda: cluster.job_field(job, "JobState") in ("FAILED", "COMPLETED"),
        "the job to end",
        logs=[log],
    )
    assert cluster.job_field(job, "JobState") == "FAILED"
    assert "no GPU is allocated to job" in log.read_text() and "DEVICE=cpu" in log.read_text()


def test_the_services_file_keeps_a_save_root_with_a_space_whole(tmp_path):
    """services.sbatch run as plain bash, its services stubbed (a sleeping `meshtrain`, a health
    probe that succeeds): the file it publishes, sourced as train.sbatch does, gives back the
    exact values. An unquoted `SAVE_ROOT=/shared/my run/ckpt` ran `run/ckpt` as a command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "meshtrain").write_text("#!/bin/sh\nexec sleep 300\n")
    (bin_dir / "probe").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    services_file, save_root = tmp_path / "services.env", str(tmp_path / "my run" / "ckpt$1")
    env = {
        **os.environ,
        "SERVICES_FILE": str(services_file),
        "SAVE_ROOT": save_root,
        "DATA_WORKERS": "2",
        "MESHTRAIN": str(bin_dir / "meshtrain"),
        "PYTHON": str(bin_dir / "probe"),
        "STOP_GRACE_S": "5",
    }
    job = subprocess.Popen(
        ["bash", str(REPO / "deploy/slurm/services.sbatch")],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not services_file.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert services_file.exists(), "services.sbatch published no services file"
        published = sourced(services_file)
        assert published["SAVE_ROOT"] == save_root
        assert (
            published["DATA_ADDRESSES"] == f"dir:{services_file}.workers"
        )  # where the workers announce
        token_file = Path(published["TOKEN_FILE"])  # a fresh token for the job, private to its user
        assert (
            token_file == Path(f"{services_file}.token")
            and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        )
        scope, token = token_file.read_text().split()
        assert scope == "admin" and len(token) == 64
    finally:
        job.send_signal(signal.SIGTERM)
        out, _ = job.communicate(timeout=60)
    assert job.returncode == 0, out
    assert not token_file.exists() and token not in out


def job_time(cluster, job: str, field: str) -> float:
    """A time field of `scontrol show job` (StartTime, EndTime: local time, to the second)
    as epoch seconds."""
    return time.mktime(time.strptime(cluster.job_field(job, field), "%Y-%m-%dT%H:%M:%S"))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.dist
def test_the_preemption_timer_checkpoints_before_the_time_limit(cluster, tmp_path):
    """A 2-minute job whose lead, computed from its model and a write bandwidth set low
    (0.06 MB/s: the small model's 1.4 MB checkpoint then needs ~24 s, counted twice with
    periodic asynchronous saves), is longer than the fallback `--signal` (5 s here): the job's
    log shows the lead, the timer's SIGTERM comes that long before the limit, and the
    checkpoint commits before it; the job requeues itself rather than being ended by the limit."""
    from meshtrain.services.launcher.slurm_preempt import compute_lead

    venv_bin = Path(sys.executable).parent
    env = {
        "PATH": f"{venv_bin}:/usr/bin:/bin:/usr/sbin:/sbin",
        "SERVICES_FILE": str(tmp_path / "services.env"),
        "SAVE_ROOT": str(tmp_path / "ckpt"),
        "DATA_ROOTS": str(tmp_path),  # the corpus below is outside the workers' default roots
        "DATA_WORKERS": "1",
        "DATA_PORT": str(free_port()),
        "CKPT_PORT": str(free_port()),
        "BIND": "127.0.0.1",
        "NPROC_PER_NODE": "1",
        "RDZV_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "DEVICE": "cpu",
        "RUNS_ROOT": str(tmp_path / "runs"),
        "CKPT_WRITE_MB_S": "0.06",
        "PREEMPT_MARGIN_S": "10",
    }
    services_log, train_log = tmp_path / "services.out", tmp_path / "train.out"
    services = cluster.run(
        [
            "sbatch",
            "--parsable",
            "--export=ALL",
            f"--output={services_log}",
            "--cpus-per-task=2",
            "deploy/slurm/services.sbatch",
        ],
        cwd=REPO,
        env=env,
    ).stdout.strip()
    job = None
    try:
        wait_for((tmp_path / "services.env").exists, "the services' addresses", logs=[services_log])
        cache = tmp_path / "corpus"
        prepare_default_dataset(cache, tokenizer="byte", max_bytes=400_000)
        args = [
            a
            for a in small_job_args(
                cache,
                tmp_path / "unused",
                **{
                    "train.train_iters": 100_000,
                    "train.eval_interval": 0,
                    "checkpoint.save_interval": 100_000,
                },
            )
            if not a.startswith("--log.run_dir=")
        ]
        lead = compute_lead(args, write_mb_s=0.06, margin_s=10).seconds  # no run yet: no step time
        assert 40 < lead < 90, lead
        job = cluster.run(
            [
                "sbatch",
                "--parsable",
                "--export=ALL",
                f"--output={train_log}",
                "--time=2",
                "--signal=B:TERM@5",
                "--cpus-per-task=2",
                "deploy/slurm/train.sbatch",
                *args,
            ],
            cwd=REPO,
            env=env,
        ).stdout.strip()
        wait_for(
            lambda: cluster.job_field(job, "JobState") == "RUNNING",
            "the job to start",
            logs=[train_log],
        )
        end = job_time(cluster, job, "EndTime")
        assert end - job_time(cluster, job, "StartTime") == 120
        wait_for(
            lambda: cluster.job_field(job, "Restarts") == "1",
            "the job to requeue itself",
            timeout=240,
            logs=[train_log, services_log],
        )
        log = train_log.read_text()
        assert f"lead {lead} s" in log and f"SIGTERM {lead} s before the time limit" in log, (
            excerpt(log)
        )
        fired = [line for line in log.splitlines() if "the checkpoint needs" in line]
        assert fired and int(fired[0].split("preemption timer: ")[1].split()[0]) <= lead, excerpt(
            log
        )
        stopped = [line for line in log.splitlines() if "stopped at step" in line]
        assert stopped, excerpt(log)
        step = int(stopped[0].split("stopped at step ")[1].split()[0])
        assert list_checkpoints(str(tmp_path / "ckpt")) == [step], excerpt(log)
        committed = (tmp_path / "ckpt").glob(f"step_{step:08d}/manifest.json")
        commit_time = max(p.stat().st_mtime for p in committed)
        # committed before the limit, and not long after the timer's SIGTERM (the write is fast
        # here: the lead's bandwidth is set low on purpose)
        assert end - lead - 5 <= commit_time < end, (end, lead, commit_time)
        assert "TIMEOUT" not in (cluster.job_field(job, "JobState") or "")
    finally:
        if job is not None:  # requeued, pending: a signal cannot reach it, a cancel does
            cluster.run(["scancel", job], check=False)
        cluster.run(["scancel", "--signal=TERM", "--full", services], check=False)
    for extra in (job, services):
        wait_for(
            lambda: cluster.job_field(extra, "JobState") in (None, "COMPLETED", "CANCELLED"),  # noqa: B023
            "the jobs to stop",
            logs=[train_log, services_log],
        )
