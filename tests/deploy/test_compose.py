"""deploy/compose.yaml and deploy/Dockerfile, checked without a Docker daemon.

`docker-compose config` (Debian's `docker-compose`, no daemon needed) validates the file
against the Compose schema and resolves variables; the structural checks below parse the YAML
themselves: every long-running service has a health check, one-shot jobs are awaited with
`service_completed_successfully`, ports and volumes are consistent, and every `meshtrain`
command line parses with the real argparse parser and config loader.
"""

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from meshtrain.services.cli import build_parser
from meshtrain.services.launcher.objectstore import VOLUME_FLAGS, AccessKeys, ObjectStore
from meshtrain.services.trainer.config.load import load_config
from tests.services.checkpoint.conftest import s3_server  # noqa: F401  (a fixture, found by name)

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose.yaml"
GPU = REPO / "deploy" / "compose.gpu.yaml"
ENV_FILE = REPO / "deploy" / "compose.env"
VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def env_file() -> dict[str, str]:
    """deploy/compose.env's settings (KEY=VALUE lines; # comments)."""
    pairs = (
        line.split("=", 1)
        for line in ENV_FILE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    return {k.strip(): v.strip() for k, v in pairs}


def interpolate(value, env):
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}` with `env`
    (`$$` is a literal `$`)."""
    if isinstance(value, str):

        def sub(m):
            if env.get(m.group(1)):
                return env[m.group(1)]
            if m.group(2) == "?":
                raise AssertionError(f"{m.group(1)} is required: {m.group(3)}")
            return m.group(3) or ""

        return VARIABLE.sub(sub, value).replace("$$", "$")
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose():
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env_file())


def test_the_file_holds_no_credential_and_names_the_missing_ones():
    text = COMPOSE.read_text()
    for key in ("S3_ACCESS_KEY", "S3_SECRET_KEY"):
        assert re.search(rf"\$\{{{key}:\?[^}}]*compose.env", text), key
    with pytest.raises(AssertionError, match="S3_ACCESS_KEY is required"):
        interpolate(yaml.safe_load(text), {})
    assert {"S3_ACCESS_KEY", "S3_SECRET_KEY", "CONFIG", "DATA_DIR", "TRAIN_ARGS"} <= set(env_file())


def train_args(command: list[str]) -> list[str]:
    """The `meshtrain train` arguments of the trainer's command (deploy/train.sh passes them on)."""
    assert command[0] == "deploy/train.sh", command
    assert os.access(REPO / command[0], os.X_OK)
    return command[1:]


@pytest.mark.e2e
def test_docker_compose_config_accepts_the_file(tmp_path):
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip(
            "docker-compose not installed "
            "(Debian package docker-compose; deploy/install-test-deps.sh)"
        )
    env_args = ["--env-file", str(ENV_FILE)]
    result = subprocess.run(
        [binary, *env_args, "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved["services"]) == {
        "auth-init",
        "s3",
        "s3-init",
        "dataloader",
        "checkpoint",
        "trainer",
        "prometheus",
        "rollout",
    }
    assert resolved["services"]["prometheus"]["profiles"] == ["monitoring"]
    assert resolved["services"]["rollout"]["profiles"] == ["rollout"]
    assert "devices" not in str(
        resolved["services"]["trainer"].get("deploy")
    )  # starts on a host without GPUs
    scaled = subprocess.run(
        [binary, *env_args, "-f", str(COMPOSE), "config", "--services"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert "dataloader" in scaled.stdout.split()
    gpu = subprocess.run(
        [binary, *env_args, "-f", str(COMPOSE), "-f", str(GPU), "config"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert gpu.returncode == 0, gpu.stderr
    trainer = yaml.safe_load(gpu.stdout)["services"]["trainer"]
    assert trainer["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "--train.device=cuda" in trainer["command"]
    missing = subprocess.run(
        [binary, "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
        env={"PATH": os.environ["PATH"]},
    )
    assert missing.returncode != 0 and "S3_ACCESS_KEY" in missing.stderr


def test_every_long_running_service_is_health_checked(compose):
    for name, svc in compose["services"].items():
        if svc.get("restart") == "no":  # a one-shot job: others wait for its success instead
            waiting = [
                s
                for s in compose["services"].values()
                if svc_dep(s, name) == "service_completed_successfully"
            ]
            assert waiting, f"nobody waits for one-shot {name}"
            continue
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] == "CMD", f"{name} has no exec-form health check"
        if test[1:4] == ["python", "-m", "meshtrain.services.launcher.health"]:
            probe = next(a for a in test[4:] if not a.startswith("--"))
            port = probe.rsplit(":", 1)[1].strip("/")
            assert port in svc.get("expose", []) or any(
                p.endswith(f":{port}") for p in svc.get("ports", [])
            ), f"{name} probes port {port} it does not expose"


def svc_dep(svc, name):
    deps = svc.get("depends_on", {})
    return deps.get(name, {}).get("condition") if isinstance(deps, dict) else None


def test_start_order_is_gated_on_health(compose):
    s = compose["services"]
    assert svc_dep(s["s3-init"], "s3") == "service_healthy"
    assert svc_dep(s["checkpoint"], "s3-init") == "service_completed_successfully"
    assert svc_dep(s["trainer"], "dataloader") == "service_healthy"
    assert svc_dep(s["trainer"], "checkpoint") == "service_healthy"


def test_dataloader_scales(compose):
    """`--scale dataloader=4` needs no fixed host port and no container name."""
    d = compose["services"]["dataloader"]
    assert "ports" not in d and "container_name" not in d
    assert "dns:///dataloader:7001" in compose["services"]["trainer"]["command"]


def test_volumes_are_declared_and_shared(compose):
    declared = set(compose["volumes"])
    used = set()
    for name, svc in compose["services"].items():
        for v in svc.get("volumes", []):
            if not v.startswith((".", "/")):  # a bind mount of a file beside compose.yaml
                used.add(v.split(":")[0])
    assert used == declared
    # the trainer builds datasets under /data; the workers must see them at the same path
    for name in ("dataloader", "trainer"):
        assert "data:/data" in compose["services"][name]["volumes"]


def test_trainer_gets_gpus_from_the_override_time_to_checkpoint_and_a_restart(compose):
    t = compose["services"]["trainer"]
    assert "deploy" not in t  # the base file runs on any host; compose.gpu.yaml reserves GPUs
    gpu = interpolate(yaml.safe_load(GPU.read_text()), env_file())["services"]["trainer"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert gpu["build"]["args"]["VARIANT"] == "gpu"
    assert t["restart"].startswith("on-failure")
    assert t["stop_signal"] == "SIGTERM"
    assert int(t["stop_grace_period"].rstrip("s")) >= 60
    assert t["environment"]["SAVE_ROOT"].startswith("s3://")


def test_commands_parse_with_the_real_cli(compose):
    parser = build_parser()
    for name in ("dataloader", "checkpoint"):
        cmd = compose["services"][name]["command"]
        assert cmd[0] == "meshtrain"
        args, rest = parser.parse_known_args(cmd[1:])
        assert rest == [] and args.port in (7001, 7002) and args.host == "0.0.0.0"
        assert args.metrics_port == 9100
    command = train_args(compose["services"]["trainer"]["command"])
    assert parser.parse_known_args(["train", *command])[0].cmd == "train"
    config = REPO / command[command.index("--config") + 1]
    assert config.exists()
    job = load_config(
        [a.replace("deploy/configs/", f"{REPO}/deploy/configs/") for a in command]
        + ["--save", compose["services"]["trainer"]["environment"]["SAVE_ROOT"]]
    )
    assert job.checkpoint.service_address == "checkpoint:7002"
    assert job.train.control_port == 7003


def test_services_require_the_token_auth_init_writes_and_the_trainer_sends_it(compose):
    services = compose["services"]
    assert "umask 077" in services["auth-init"]["command"][-1]
    for name in ("dataloader", "checkpoint"):
        command = services[name]["command"]
        assert command[command.index("--token-file") + 1] == "/secrets/token"
        assert "secrets:/secrets:ro" in services[name]["volumes"]
        assert services[name]["depends_on"]["auth-init"] == {
            "condition": "service_completed_successfully"
        }
    assert "--auth.token_file=/secrets/token" in services["trainer"]["command"]
    assert "secrets:/secrets:ro" in services["trainer"]["volumes"]


def test_dockerfile_installs_what_the_commands_use():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    for copied in ("meshtrain", "services", "protos", "kernels", "deploy/configs"):
        assert re.search(rf"^COPY {copied} ", text, re.MULTILINE), copied
    assert "extras=s3,plot" in text and "COPY deploy/train.sh" in text
    # dependencies (pinned by constraints.txt) before the sources; a user of its own; a health check
    assert text.index("-c /tmp/meshtrain-deps/constraints.txt") < text.index("COPY services")
    assert re.search(r"^USER meshtrain$", text, re.MULTILINE) and "HEALTHCHECK" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".cache", "runs"} <= set(ignored)


@pytest.mark.e2e
def test_s3_init_makes_the_bucket_and_succeeds_again_on_the_old_data(compose, s3_server):  # noqa: F811
    """s3-init's own command against a real SeaweedFS: it makes the bucket, and run again (the
    stack brought up a second time on its s3 volume, to resume) it succeeds on the bucket that
    is there; `weed shell`'s s3.bucket.create, used before, exited 1 on "already exists", which
    kept the checkpoint service and the trainer from ever starting. Refused credentials end in
    an error naming the bucket, not in a success or a hang."""
    command = compose["services"]["s3-init"]["command"]
    assert command[:4] == [
        "python",
        "-m",
        "meshtrain.services.launcher.objectstore",
        "make-bucket",
    ], command
    bucket = f"compose-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, *command[1:4], bucket, *command[5:]]
    env = {**os.environ, **s3_server.env()}

    def s3_init(environment, *extra):
        return subprocess.run(
            argv + list(extra),
            env=environment,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    first = s3_init(env)
    assert first.returncode == 0, first.stderr
    import s3fs

    fs = s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        skip_instance_cache=True,
        client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"], "region_name": "us-east-1"},
    )
    assert fs.exists(bucket)
    again = s3_init(env)
    assert again.returncode == 0, again.stderr
    refused = s3_init({**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "--timeout", "2")
    assert refused.returncode == 2 and "could not create bucket" in refused.stderr, refused.stderr
    unset = s3_init({k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"})
    assert unset.returncode == 2 and "AWS_ENDPOINT_URL" in unset.stderr, unset.stderr


def test_the_store_sizes_its_volumes_as_meshtrain_up_does(compose, tmp_path):
    """The s3 service's own shell command, run with `weed` stubbed to print its arguments: it
    starts SeaweedFS with the launcher's volume flags (as `meshtrain up --s3` does). With weed's
    default 30 GB volumes a host with 54 GB free had no writable volume, and every save failed
    ("No writable volumes"). services.sbatch takes the flags from the same place."""
    command = compose["services"]["s3"]["command"]
    assert command[:2] == ["sh", "-c"], command
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "weed").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = command[2].replace("/tmp/s3.json", str(tmp_path / "s3.json"))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
    }
    run = subprocess.run(
        ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    argv = run.stdout.split()
    assert argv[0] == "server" and set(VOLUME_FLAGS) <= set(argv), argv
    launcher = ObjectStore("weed", tmp_path / "store", AccessKeys("k", "s")).argv()
    assert set(VOLUME_FLAGS) <= set(launcher)
    volume_args = {a.split("=")[0] for a in VOLUME_FLAGS}
    assert sorted(a for a in argv if a.split("=")[0] in volume_args) == sorted(
        a for a in launcher if a.split("=")[0] in volume_args
    )
    sbatch = (REPO / "deploy" / "slurm" / "services.sbatch").read_text()
    assert "launcher.objectstore volume-flags" in sbatch and "-volume.max" not in sbatch


def test_system_deps_install_what_the_deploy_tests_look_for():
    """`make system-deps` installs every tool the slow deploy tests skip without (debootstrap
    was missing, so the image tests could never run after it)."""
    text = (REPO / "deploy" / "install-test-deps.sh").read_text()
    packages = set(re.search(r'^packages="([^"]*)"', text, re.MULTILINE).group(1).split())
    # tool the tests look for -> the Debian package that has it
    needed = {
        "docker-compose": "docker-compose",
        "debootstrap": "debootstrap",
        "slurmctld": "slurm-wlm",
        "munged": "munge",
        "ip": "iproute2",
        "nsenter": "util-linux",
    }
    assert set(needed.values()) <= packages, set(needed.values()) - packages
    assert 'command -v docker >/dev/null 2>&1 || packages="$packages docker.io"' in text
