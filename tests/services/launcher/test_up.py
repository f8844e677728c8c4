"""`meshtrain up`'s plan: option checks, resume and overwrite decisions (no processes started)."""

import os
import re
import signal
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.config import dumps_toml
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher.up import _resume_from
from meshtrain.services.launcher.up_plan import Plan, UpOptions, plan
from meshtrain.services.trainer.config.load import LAUNCHER_KEYS_ENV, load_config
from meshtrain.services.trainer.run_dir import run_dir_toml
from tests.services.trainer.conftest import corpus_cache, small_job_args  # noqa: F401  (a fixture, found by name)

ROOT = Path(__file__).parents[3]


def test_options_it_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="nproc-per-node >= 1"):
        UpOptions(nproc_per_node=0)
    with pytest.raises(ConfigError, match="data-workers >= 0"):
        UpOptions(data_workers=-1)


def test_the_runs_own_checkpoints_win_over_a_checkpoint_to_start_from(tmp_path):
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 7, {"w": torch.zeros(2)})
    fresh = Plan([], [], tmp_path, root, None, None, loads=True)  # e.g. --checkpoint.load IMPORTED
    assert _resume_from(fresh, UpOptions()) == 7  # the rerun continues the run
    assert (
        _resume_from(
            Plan([], [], tmp_path, root, None, None, loads=True, load_step=True), UpOptions()
        )
        is None
    )
    assert _resume_from(fresh, UpOptions(resume=False)) is None


def test_no_resume_lets_the_trainer_replace_the_roots_steps(tmp_path):
    args = ["--config", "deploy/configs/tiny.toml", f"--log.run_dir={tmp_path / 'run'}"]
    assert all(
        "--checkpoint.overwrite=true" in c.argv
        for c in plan(UpOptions(resume=False), args).trainers
    )
    assert not any(
        "--checkpoint.overwrite=true" in c.argv for c in plan(UpOptions(), args).trainers
    )


def test_the_stores_identity_file_is_private_from_the_start(tmp_path):
    from meshtrain.services.launcher.objectstore import AccessKeys, ObjectStore

    store = ObjectStore("weed", tmp_path, AccessKeys.load_or_create(tmp_path))
    store.argv()
    store.argv()  # a relaunch rewrites it
    assert (tmp_path / "s3.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--train.control_port=7003", "--train.control_port"),
        ("--data-service-addresses", "--data-service-addresses"),
        ("--checkpoint.service_address=10.0.0.1:7002", "--checkpoint.service_address"),
        # the config loader reads dashes in a dotted key as underscores: the same keys,
        # so refused too
        ("--train.control-port=7003", "--train.control_port"),
        ("--checkpoint.service-address=10.0.0.1:7002", "--checkpoint.service_address"),
        ("--data.service-addresses=10.0.0.1:7001", "--data.service_addresses"),
    ],
)
def test_flags_up_sets_itself_are_refused_not_silently_overridden(tmp_path, flag, named):
    args = ["--config", "deploy/configs/tiny.toml", f"--log.run_dir={tmp_path / 'run'}", flag]
    if flag == "--data-service-addresses":
        args.append("10.0.0.1:7001")
    with pytest.raises(ConfigError, match=f"{named} is set by up itself"):
        plan(UpOptions(), args)


def test_the_trainers_metrics_port_can_be_set_beside_the_control_endpoint_up_serves(tmp_path):
    # train.metrics_port needs train.control_port, which up sets itself and refuses from the
    # user: the config was checked without it, so every way to ask for the trainer's metrics
    # was refused, each message pointing at the other
    args = [
        "--config",
        "deploy/configs/tiny.toml",
        f"--log.run_dir={tmp_path / 'run'}",
        "--train.metrics_port=0",
    ]
    assert all(
        "--train.metrics_port=0" in c.argv and "--train.control_port=0" in c.argv
        for c in plan(UpOptions(), args).trainers
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[train]\ncontrol_port = 7003\n", "train.control_port"),
        ('[data]\nservice_addresses = ["10.0.0.1:7001"]\n', "data.service_addresses"),
        ('[checkpoint]\nservice_address = "10.0.0.1:7002"\n', "checkpoint.service_address"),
    ],
)
def test_keys_up_sets_itself_are_refused_from_the_config_file_too(tmp_path, text, named):
    # refused only as flags, so the same settings in --config FILE were replaced without a word
    path = tmp_path / "job.toml"
    path.write_text(text)
    args = ["--config", str(path), f"--log.run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=re.escape(f"{named} in {path} is set by up itself")):
        plan(UpOptions(), args)


@pytest.mark.parametrize(
    ("options", "keys"),
    [
        (UpOptions(data_workers=2), "data.service_addresses checkpoint.service_address"),
        (UpOptions(data_workers=0), "checkpoint.service_address"),
        (UpOptions(data_workers=0, checkpoint_service=False), ""),
    ],
)
def test_up_names_the_keys_it_points_at_its_own_services_so_the_run_dir_config_leaves_them_out(
    tmp_path, options, keys
):
    trainers = plan(
        options, ["--config", "deploy/configs/tiny.toml", f"--log.run_dir={tmp_path / 'run'}"]
    ).trainers
    assert all(child.env[LAUNCHER_KEYS_ENV] == keys for child in trainers)
    job = load_config(
        [
            "--config",
            "deploy/configs/tiny.toml",
            "--data-service-addresses",
            "127.0.0.1:1",
            "--checkpoint.service_address=127.0.0.1:2",
        ]
    )
    written = tomllib.loads(run_dir_toml(job, keys.split()))
    assert ("service_addresses" in written["data"]) == ("data.service_addresses" not in keys)
    assert ("service_address" in written["checkpoint"]) == (
        "checkpoint.service_address" not in keys
    )


def test_a_runs_own_resolved_config_reruns_under_up(tmp_path):
    # RUN/config.toml of a run under up, as written before up's service addresses were left out
    # of it, holds that run's ports (control_port = 0, the addresses of its data workers and
    # checkpoint service): `up --config RUN/config.toml` gives it new ones
    run = tmp_path / "run"
    first = plan(
        UpOptions(data_workers=2), ["--config", "deploy/configs/tiny.toml", f"--log.run_dir={run}"]
    )
    argv = first.trainers[0].argv
    run.mkdir()
    (run / "config.toml").write_text(
        dumps_toml(load_config(argv[argv.index("train") + 1 :]))
    )  # as train.py wrote it then
    again = plan(UpOptions(data_workers=2), ["--config", str(run / "config.toml")]).trainers[0].argv
    ports = [c.port for c in first.services]
    assert again[again.index("--data-service-addresses") + 1].startswith("127.0.0.1:")
    assert not any(
        f":{port}" in arg
        for arg in again[again.index("--data-service-addresses") :]
        for port in ports
    )
    copied = tmp_path / "copy.toml"  # elsewhere it is a file like any other
    copied.write_text((run / "config.toml").read_text())
    with pytest.raises(ConfigError, match="is set by up itself"):
        plan(UpOptions(data_workers=2), ["--config", str(copied)])


def test_up_without_a_run_dir_picks_one_no_other_up_has(tmp_path, monkeypatch):
    # the default was runs/<second>-up: two `up`s started in the same second shared it (config,
    # metrics.jsonl interleaved, one's control.addr deleted under the other)
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "deploy/configs/tiny.toml")]
    first, second = plan(UpOptions(), args).run_dir, plan(UpOptions(), args).run_dir
    assert first != second
    assert first.is_dir() and second.is_dir()


def test_up_gives_its_services_and_trainer_the_runs_token_file_written_only_once_the_run_is_its_own(
    tmp_path,
):
    run = tmp_path / "run"
    p = plan(
        UpOptions(data_workers=2), ["--config", "deploy/configs/tiny.toml", f"--log.run_dir={run}"]
    )
    token_file = os.path.abspath(run / "auth.token")
    assert len(p.services) == 3 and all(
        c.argv[-2:] == ["--token-file", token_file] for c in p.services
    )
    assert all(f"--auth.token_file={token_file}" in c.argv for c in p.trainers)
    assert not os.path.exists(
        token_file
    )  # a second up on the run directory must not replace the first's


@pytest.mark.e2e
def test_up_trains_with_a_token_that_no_log_or_file_of_the_run_shows(tmp_path, corpus_cache):  # noqa: F811
    run, env = tmp_path / "run", {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MESHTRAIN_TOKEN", None)
    args = small_job_args(
        corpus_cache,
        run,
        **{"train.train_iters": 6, "train.eval_interval": 0, "checkpoint.save_interval": 3},
    )
    out = subprocess.run(
        _up_argv("--data-workers", "1", "--metrics", *args),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    token_file = run / "auth.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    scope, token = token_file.read_text().split()
    assert scope == "admin" and len(token) >= 32
    assert tomllib.loads((run / "config.toml").read_text())["auth"][
        "token_file"
    ] == os.path.abspath(token_file)
    assert token not in out.stdout + out.stderr
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p != token_file]
    assert [str(p) for p in files if token.encode() in p.read_bytes()] == []
    assert subprocess.run(
        [sys.executable, "-m", "meshtrain.services.cli", "ckpt", "list", str(run / "checkpoints")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split() == ["3", "6"]


def _up_argv(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshtrain.services.cli",
        "up",
        "--config",
        "deploy/configs/tiny.toml",
        *args,
    ]


@pytest.mark.e2e
def test_a_second_up_on_a_run_dir_in_use_is_refused_before_it_starts_anything(tmp_path):
    # Reproduced: two `up --log.run_dir=R` both trained, appending to one metrics.jsonl; the first
    # to end deleted R/control.addr, so `meshtrain status R` lost the other, and whichever saved
    # second failed at its first checkpoint ("step 5 already exists").
    run, env = tmp_path / "run", {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(
        _up_argv(f"--log.run_dir={run}"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        line = first.stdout.readline()  # printed once the run directory is its own
        assert line.startswith(f"[up] run directory {run}"), line
        second = subprocess.run(
            _up_argv(f"--log.run_dir={run}"),
            cwd=ROOT,
            env=env,
            capture_output=True,
            check=False,
            text=True,
            timeout=60,
        )
    finally:
        os.killpg(first.pid, signal.SIGTERM)  # a stop while its services start: exit 0
        out, _ = first.communicate(timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"{run} is in use by another meshtrain up (pid {first.pid})" in second.stderr, (
        second.stderr
    )
    assert "started" not in second.stdout  # it started no process
    assert first.returncode == 0, out


@pytest.mark.e2e
def test_ups_own_trainer_writes_its_run_dir_and_a_train_beside_it_is_refused(
    tmp_path, corpus_cache
):  # noqa: F811
    # Reproduced: `meshtrain train --log.run_dir R` beside an `up` on R trained too, into the same
    # metrics.jsonl and config.toml. Up's lock on R must not refuse up's own trainer.
    run, env = tmp_path / "run", {**os.environ, "PYTHONPATH": str(ROOT)}
    args = small_job_args(
        corpus_cache, run, **{"train.train_iters": 100_000, "train.eval_interval": 0}
    )
    up = subprocess.Popen(
        [sys.executable, "-m", "meshtrain.services.cli", "up", "--data-workers", "0", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        for line in up.stdout:
            if line.startswith("[trainer") and "loss" in line:  # training, past the claim
                break
        else:
            pytest.fail(f"up exited ({up.wait()}) before its trainer trained")
        beside = subprocess.run(
            [
                sys.executable,
                "-m",
                "meshtrain.services.cli",
                "train",
                *small_job_args(corpus_cache, run, **{"train.train_iters": 3}),
                f"--checkpoint.save={tmp_path / 'beside'}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        out, _ = up.communicate(timeout=120)
    assert beside.returncode == 2, beside.stderr[-3000:]
    assert re.search(
        rf"run directory {re.escape(str(run))} is in use by another trainer \(pid \d+\); "
        rf"stop it first \(`meshtrain stop {re.escape(str(run))}`\)",
        beside.stderr,
    ), beside.stderr[-3000:]
    assert not (tmp_path / "beside").exists()
    assert up.returncode == 0, out[-3000:]


def test_up_s_data_workers_serve_the_run_s_data_and_cache_and_nothing_else(tmp_path):
    """A data worker serves only its --allow-root folders; `up` names the folders of the run's
    dataset files (resolved: a linked dataset's target) and its data cache, where the default
    corpus is built."""
    data, store = tmp_path / "data", tmp_path / "store"
    data.mkdir()
    store.mkdir()
    for ext in (".idx", ".bin"):
        (store / f"ds{ext}").write_bytes(b"")
        (data / f"ds{ext}").symlink_to(store / f"ds{ext}")
    p = plan(
        UpOptions(data_workers=1, checkpoint_service=False),
        [
            f"--log.run_dir={tmp_path / 'run'}",
            f"--data.data_path={data / 'ds'}",
            "--data.tokenizer=byte",
            f"--data.cache_dir={tmp_path / 'cache'}",
        ],
    )
    argv = p.services[0].argv
    roots = [argv[i + 1] for i, a in enumerate(argv) if a == "--allow-root"]
    assert roots == [str(tmp_path / "cache"), str(store)]
