"""`meshtrain up --rollout-workers N`: rollout workers beside the data workers and the checkpoint
service, started from the checkpoint the trainer starts from, their addresses handed to it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher.up_plan import (
    UpOptions,
    _grpo_rollout_addresses_arg,
    plan,
    start_rollouts_from,
)
from meshtrain.services.rollout.config import ADDRESSES_ENV
from meshtrain.services.trainer.config.load import LAUNCHER_KEYS_ENV, load_config, replace
from tests.services.trainer.conftest import corpus_cache, small_job_args  # noqa: F401  (a fixture, found by name)

ROOT = Path(__file__).parents[3]
TINY = ["--config", "deploy/configs/tiny.toml"]


def test_rollout_workers_are_services_with_the_runs_token_one_thread_and_the_trainers_addresses(
    tmp_path,
):
    run = tmp_path / "run"
    p = plan(
        UpOptions(data_workers=1, rollout_workers=2, rollout_args=["--device", "cpu"]),
        [*TINY, f"--log.run_dir={run}", "--checkpoint.load=/sft"],
    )
    assert [c.name for c in p.services] == ["data-0", "ckpt", "rollout-0", "rollout-1"]
    assert p.rollouts == p.services[2:]
    token_file = os.path.abspath(run / "auth.token")
    for c in p.rollouts:
        assert c.argv[c.argv.index("rollout") :][:4] == ["rollout", "serve", "--port", str(c.port)]
        assert ["--token-file", token_file] == c.argv[c.argv.index("--token-file") :][:2]
        assert c.argv[c.argv.index("--checkpoint-root") + 1] == str(run / "checkpoints")
        assert "--device" in c.argv and c.restart and c.env["OMP_NUM_THREADS"] == "1"
    addresses = ",".join(f"127.0.0.1:{c.port}" for c in p.rollouts)
    for t in p.trainers:
        assert t.env[ADDRESSES_ENV] == addresses
        # not a GRPO run through the service: no grpo.rollout_addresses for the trainer
        assert not any(a.startswith("--grpo.") for a in t.argv)
        assert "grpo" not in t.env[LAUNCHER_KEYS_ENV]
    none = plan(UpOptions(), [*TINY, f"--log.run_dir={tmp_path / 'r2'}"])
    assert none.rollouts == [] and ADDRESSES_ENV not in none.trainers[0].env


def test_rollout_workers_start_from_the_checkpoint_the_trainer_starts_from(tmp_path):
    args = [*TINY, f"--log.run_dir={tmp_path / 'run'}"]
    p = plan(UpOptions(rollout_workers=1), [*args, "--checkpoint.load=/sft"])
    assert start_rollouts_from(p, None) == ("/sft", None)  # a fresh run: the config's load
    assert p.rollouts[0].argv[-4:] == ["--load", "/sft", "--version", "0"]
    p = plan(
        UpOptions(rollout_workers=1),
        [*args, "--checkpoint.load=/sft", "--checkpoint.load_step=4"],
    )
    assert start_rollouts_from(p, None) == ("/sft", 4)
    assert p.rollouts[0].argv[-6:] == ["--load", "/sft", "--step", "4", "--version", "0"]
    p = plan(UpOptions(rollout_workers=1), [*args, "--checkpoint.load=/sft"])
    assert start_rollouts_from(p, 9) == (p.save, 9)  # resuming: the run's own newest step
    assert p.rollouts[0].argv[-4:] == ["--load", p.save, "--step", "9"]
    p = plan(UpOptions(rollout_workers=1), args)
    with pytest.raises(ConfigError, match="needs a policy to start from.*--checkpoint.load"):
        start_rollouts_from(p, None)


@pytest.mark.parametrize(
    ("options", "extra", "named"),
    [
        (UpOptions(rollout_workers=1, resume=False), [], "needs a policy to start from"),
        (UpOptions(rollout_workers=1), ["--grpo.rollout_addresses=a:1"], "rollout workers"),
        (UpOptions(rollout_workers=1, rollout_args=["--port", "1"]), [], "--port is set by"),
        (UpOptions(rollout_workers=1, rollout_args=["--load=x"]), [], "--load is set by"),
        (UpOptions(rollout_workers=1, rollout_args=["--check", "x"]), [], "unrecognized"),
        (UpOptions(rollout_workers=1, rollout_args=["--device", "tpu"]), [], "--rollout-args: "),
    ],
)
def test_bad_rollout_settings_are_refused_before_anything_starts(tmp_path, options, extra, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        plan(options, [*TINY, f"--log.run_dir={tmp_path / 'run'}", *extra])


def test_options_it_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="rollout-workers >= 0"):
        UpOptions(rollout_workers=-1)
    with pytest.raises(ConfigError, match="without --rollout-workers"):
        UpOptions(rollout_args=["--device", "cpu"])


def test_the_addresses_go_to_a_grpo_run_through_the_service_only():
    from meshtrain.services.common.config import parse_value
    from meshtrain.services.trainer.config.sections import JobConfig

    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    job = replace(JobConfig(), train={"objective": "grpo"}, grpo={"rollout": "service"})
    flag = _grpo_rollout_addresses_arg(job, addresses)
    assert flag == '--grpo.rollout_addresses=["127.0.0.1:1", "127.0.0.1:2"]'
    assert parse_value(flag.split("=", 1)[1]) == addresses
    colocated = replace(job, grpo={"rollout": "colocated"})
    assert _grpo_rollout_addresses_arg(colocated, addresses) is None
    assert _grpo_rollout_addresses_arg(JobConfig(), addresses) is None


@pytest.mark.e2e
def test_up_starts_a_rollout_worker_that_samples_from_the_trainers_starting_policy(
    tmp_path,
    corpus_cache,  # noqa: F811
):
    from meshtrain.services.rollout.engine import engine_from_checkpoint
    from meshtrain.services.rollout.rpc.client import RolloutClient
    from meshtrain.services.rollout.types import RolloutRequest, SamplingParams
    from meshtrain.services.trainer.checkpointing import save_checkpoint
    from meshtrain.services.trainer.model import GPT

    run, sft = tmp_path / "run", str(tmp_path / "sft")
    args = small_job_args(
        corpus_cache,
        run,
        **{"train.train_iters": 100_000, "train.eval_interval": 0, "model.vocab_size": 320},
    )
    job = load_config(args)
    torch.manual_seed(0)
    save_checkpoint(sft, 0, GPT(job.model), None, job=job)  # the policy the run starts from
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MESHTRAIN_TOKEN", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "meshtrain.services.cli", "up", "--data-workers", "0"]
        + ["--no-checkpoint-service", "--rollout-workers", "1"]
        + ["--rollout-args", "--device cpu --eod-id 0", *args, f"--checkpoint.load={sft}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        address = None
        for line in up.stdout:
            seen.append(line)
            found = re.match(r"\[up\] rollout workers (\S+) start from (\S+) \(newest step\)", line)
            if found:
                address = found[1]
                assert found[2] == sft
            if line.startswith("[up] trainer started"):  # the rollout worker answered its check
                break
        else:
            pytest.fail(f"up exited ({up.wait()}):\n{''.join(seen)}")
        assert address is not None, "".join(seen)
        token = (run / "auth.token").read_text().split()[1]
        request = RolloutRequest(
            [[1, 2, 3], [4, 5]], group_size=2, sampling=SamplingParams(max_new_tokens=4, seed=1)
        )
        with RolloutClient(address, ClientSecurity(token=token), timeout_s=30) as client:
            got = client.generate(request)
        want = engine_from_checkpoint(sft, device="cpu", eod_id=0).generate(request)
        assert [(c.tokens, c.policy_version) for c in got] == [
            (c.tokens, c.policy_version) for c in want
        ]
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        out, _ = up.communicate(timeout=120)
    log = "".join(seen) + out
    assert up.returncode == 0, log[-4000:]
    assert "[rollout-0] listening on 127.0.0.1:" in log
    assert "[up] stopping rollout-0 (SIGTERM)" in log
    assert "rollout-0 still running" not in log  # it exited on SIGTERM, no SIGKILL
