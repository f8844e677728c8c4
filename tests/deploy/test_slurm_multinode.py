"""deploy/slurm/*.sbatch across two nodes: network namespaces with their own addresses and slurmd
(tests/deploy/slurm_nodes.py), on one machine.

Two services jobs run on node2 (data worker and checkpoint service each, one for the run under
test and one for its reference); two training jobs take both nodes, one rank per node (dp=2 over
gloo, torchrun's rendezvous and MASTER_ADDR on node1), reaching the services on node2 by name.
The run under test is preempted as the timer and `--signal=B:TERM` do it (SIGTERM to the batch
script), requeues itself and resumes; its logged losses equal the uninterrupted reference's,
step for step, exactly (fp32 on CPU: resume is bit-exact). Skipped, with the reason, without
root, `ip netns`, Slurm or munge.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from meshtrain.services.checkpoint.reader import list_checkpoints
from meshtrain.services.dataloader.preprocess import prepare_default_dataset
from meshtrain.services.launcher.topology import free_port
from tests.deploy.slurm_nodes import (
    BridgedTrafficDropped,
    SlurmNodes,
    missing_network_requirements,
)
from tests.deploy.test_slurm import excerpt, sourced, wait_for
from tests.services.trainer.conftest import small_job_args

REPO = Path(__file__).resolve().parents[2]
ITERS = 60


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    why = missing_network_requirements()
    if why:
        pytest.skip(why)
    c = SlurmNodes(tmp_path_factory.mktemp("slurm-nodes"), nodes=2)
    try:
        try:
            c.start()
        except BridgedTrafficDropped as e:  # found in seconds, before any daemon starts
            pytest.skip(str(e))
        yield c
    finally:
        c.stop()


def job_processes(job: str, word: str) -> dict[int, dict[str, str]]:
    """{pid: environment} of the live processes of Slurm job `job` whose command line has `word`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(
                v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v
            )
            if env.get("SLURM_JOB_ID") == job and word in (entry / "cmdline").read_text():
                env["netns"] = os.readlink(entry / "ns" / "net")
                found[int(entry.name)] = env
        except OSError:  # gone meanwhile
            continue
    return found


def losses(metrics: Path) -> dict[int, float]:
    """step -> loss of a metrics.jsonl (a step logged by both runs of a requeued job: the last)."""
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.dist
def test_two_node_job_is_preempted_requeued_and_resumes_with_the_uninterrupted_losses(
    nodes, tmp_path
):
    venv_bin = Path(sys.executable).parent
    base = {
        "PATH": f"{venv_bin}:/usr/bin:/bin:/usr/sbin:/sbin",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "DEVICE": "cpu",
        "NPROC_PER_NODE": "1",
        "DATA_WORKERS": "1",
        "RUNS_ROOT": str(tmp_path / "runs"),
    }
    envs = {
        name: {
            **base,
            "SERVICES_FILE": str(tmp_path / f"{name}.env"),
            "SAVE_ROOT": str(tmp_path / f"{name}-ckpt"),
            "DATA_PORT": str(free_port()),
            "CKPT_PORT": str(free_port()),
        }
        for name in ("run", "ref")
    }
    logs = {
        f"{name}-{kind}": tmp_path / f"{name}-{kind}.out"
        for name in envs
        for kind in ("services", "train")
    }
    services, jobs = {}, {}
    try:
        for name, env in envs.items():
            services[name] = nodes.run(
                [
                    "sbatch",
                    "--parsable",
                    "--export=ALL",
                    f"--output={logs[name + '-services']}",
                    "--nodelist=node2",
                    "--cpus-per-task=2",
                    "deploy/slurm/services.sbatch",
                ],
                cwd=REPO,
                env=env,
            ).stdout.strip()
        cache = tmp_path / "corpus"
        prepare_default_dataset(cache, tokenizer="byte", max_bytes=400_000)
        args = [
            a
            for a in small_job_args(
                cache,
                tmp_path / "unused",
                **{
                    "train.train_iters": ITERS,
                    "train.eval_interval": 0,
                    "checkpoint.save_interval": 1000,
                },
            )
            if not a.startswith("--log.run_dir=")
        ]
        for name, env in envs.items():
            wait_for(
                Path(env["SERVICES_FILE"]).exists,
                f"the {name} services' addresses",
                logs=[logs[name + "-services"]],
            )
            published = sourced(Path(env["SERVICES_FILE"]))
            assert (
                published["CKPT_ADDRESS"] == f"node2:{env['CKPT_PORT']}"
            )  # another node than the ranks'
            jobs[name] = nodes.run(
                [
                    "sbatch",
                    "--parsable",
                    "--export=ALL",
                    f"--output={logs[name + '-train']}",
                    "--nodes=2",
                    "--cpus-per-task=2",
                    "deploy/slurm/train.sbatch",
                    *args,
                ],
                cwd=REPO,
                env=env,
            ).stdout.strip()
        run = jobs["run"]
        metrics = {
            name: tmp_path / "runs" / f"slurm-{job}" / "metrics.jsonl" for name, job in jobs.items()
        }
        train_logs = [logs["run-train"], logs["run-services"]]
        wait_for(
            lambda: metrics["run"].exists() and len(metrics["run"].read_text().splitlines()) >= 15,
            "15 logged steps",
            logs=train_logs,
        )

        # One rank in each node's network namespace (neither the machine's), both told by the
        # rendezvous that the master is node1; the services in node2's namespace.
        ranks = {
            pid: env
            for pid, env in job_processes(run, "meshtrain.services.cli").items()
            if "LOCAL_RANK" in env
        }
        assert sorted(env["GROUP_RANK"] for env in ranks.values()) == ["0", "1"], ranks
        spaces = {env["netns"] for env in ranks.values()}
        root_ns = os.readlink("/proc/self/ns/net")
        assert len(spaces) == 2 and root_ns not in spaces, spaces
        assert {env["MASTER_ADDR"] for env in ranks.values()} == {"node1"}
        service_spaces = {env["netns"] for env in job_processes(services["run"], "serve").values()}
        node2 = {env["netns"] for env in ranks.values() if env["SLURMD_NODENAME"] == "node2"}
        assert service_spaces == node2, (service_spaces, node2)

        nodes.run(["scancel", "--batch", "--signal=TERM", run])  # what the preemption timer does
        wait_for(
            lambda: nodes.job_field(run, "Restarts") == "1",
            "the job to requeue itself",
            logs=train_logs,
        )
        for name, job in jobs.items():
            wait_for(
                lambda: nodes.job_field(job, "JobState") == "COMPLETED",
                f"the {name} run to finish",  # noqa: B023
                timeout=300,
                logs=[logs[name + "-train"], logs[name + "-services"]],
            )
        log = logs["run-train"].read_text()
        assert nodes.job_field(run, "ExitCode") == "0:0", excerpt(log)
        assert f"job {run} (restart 1) on node[1-2]" in log, excerpt(log)
        stopped = [line for line in log.splitlines() if "stopped at step" in line]
        assert stopped, excerpt(log)
        step = int(stopped[0].split("stopped at step ")[1].split()[0])
        assert 15 <= step < ITERS, excerpt(log)
        assert f"train.sh: resuming from {envs['run']['SAVE_ROOT']} step {step}" in log, excerpt(
            log
        )
        assert list_checkpoints(envs["run"]["SAVE_ROOT"]) == [step, ITERS]
        got, want = losses(metrics["run"]), losses(metrics["ref"])
        assert sorted(want) == list(range(1, ITERS + 1)) and sorted(got) == sorted(want)
        assert got == want, [(s, got[s], want[s]) for s in want if got[s] != want[s]][:5]
    finally:
        for job in jobs.values():
            nodes.run(["scancel", job], check=False)
        for job in services.values():
            nodes.run(["scancel", "--signal=TERM", "--full", job], check=False)
    for name, job in services.items():
        wait_for(
            lambda: nodes.job_field(job, "JobState") in (None, "COMPLETED", "CANCELLED"),  # noqa: B023
            f"the {name} services job to stop",
            logs=[logs[name + "-services"]],
        )
