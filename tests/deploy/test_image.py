"""The image is built and run: deploy/Dockerfile on a Debian base made here, `meshtrain up` in a
container, and the compose stack of that image training, checkpointing to its object store and
resuming after a stop.

Needs a Docker daemon, debootstrap and root (the base image is a debootstrap'd Debian imported
into Docker; packages come from a wheelhouse served on loopback: `tests/deploy/docker_image.py`).
Skipped, saying why, without them. Slow: the first build fills the caches (minutes).
"""

import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from meshtrain.services.launcher.topology import free_port
from tests.deploy import docker_image as di

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.timeout(2400),
]  # builds and a stack: minutes
REPO = di.REPO


@pytest.fixture(scope="module")
def image():
    reason = di.missing()
    if reason:
        pytest.skip(f"image tests: {reason}")
    return di.build_image()


def test_the_image_runs_as_its_own_user_with_a_health_check(image):
    config = json.loads(di.run(["docker", "image", "inspect", image]).stdout)[0]["Config"]
    assert config["User"] == "meshtrain"
    assert config["Healthcheck"]["Test"][-2:] == [
        "meshtrain.services.launcher.health",
        "--from-env",
    ]
    out = di.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            image,
            "sh",
            "-c",
            "id -u && python -m meshtrain.services.launcher.health --from-env && "
            "MESHTRAIN_HEALTH=127.0.0.1:1 python -m meshtrain.services.launcher.health "
            "--from-env --timeout 1 || echo unhealthy",
        ]
    ).stdout.split()
    assert out[0] == "1000" and out[-1] == "unhealthy"


def test_meshtrain_up_runs_to_its_end_in_a_container(image):
    """No network but loopback: the data worker, the checkpoint service and the trainer of `up`
    on the embedded corpus, which the container builds itself."""
    script = (
        "meshtrain up --config deploy/configs/tiny.toml --train.train_iters=20 "
        "--train.eval_interval=10 --log.run_dir=/runs/up > /runs/up.log 2>&1; echo exit=$?; "
        "tail -n 3 /runs/up/metrics.jsonl; meshtrain ckpt list /runs/up/checkpoints"
    )
    out = di.run(
        ["docker", "run", "--rm", "--network", "none", image, "sh", "-c", script], timeout=900
    ).stdout
    lines = out.splitlines()
    assert lines[0] == "exit=0", out
    assert json.loads(lines[3])["step"] == 20, out
    assert "20" in lines[4:], out


def test_a_source_edit_rebuilds_only_the_layers_after_the_dependencies(image, tmp_path):
    """The build context of the repository's files with one source file edited: every layer up
    to the dependencies comes from the cache, the sources' do not."""
    context = tmp_path / "context"
    files = di.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO).stdout.splitlines()
    for name in files:
        src = REPO / name
        if src.is_file() or src.is_symlink():
            dst = context / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
    train = context / "services" / "trainer" / "train.py"
    train.write_text(train.read_text() + f"\n# edited {uuid.uuid4().hex}\n")
    tag = f"meshtrain:test-edit-{uuid.uuid4().hex[:8]}"
    try:
        out = di.build(context, tag)
    finally:
        subprocess.run(["docker", "image", "rm", tag], capture_output=True)
    steps = [
        s for s in out.split("\nStep ")[1:] if s.split(" : ", 1)[1].startswith(("RUN", "COPY"))
    ]
    deps = next(i for i, s in enumerate(steps) if "-r /tmp/meshtrain-deps/requirements.txt" in s)
    sources = next(
        i for i, s in enumerate(steps) if s.split(" : ", 1)[1].startswith("COPY services")
    )
    assert deps < sources
    assert all("Using cache" in s for s in steps[: deps + 1]), out[-3000:]
    assert "Using cache" not in steps[sources], out[-3000:]


class Stack:
    """deploy/compose.yaml under a project name of its own, with the built image."""

    def __init__(self, image: str, tmp_path: Path):
        self.project = f"mt{uuid.uuid4().hex[:8]}"
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "MESHTRAIN_IMAGE": image,
            "RUN_NAME": "r1",
            "TRAINER_CONTROL_PORT": str(free_port()),
            "TRAIN_ARGS": "--train.train_iters=30 --checkpoint.save_interval=10 "
            "--train.eval_interval=0 --log.log_interval=1",
        }

    def compose(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess:
        argv = [
            "docker-compose",
            "-p",
            self.project,
            "--env-file",
            str(REPO / "deploy" / "compose.env"),
            "-f",
            str(REPO / "deploy" / "compose.yaml"),
            *args,
        ]
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=REPO
        )
        if check and proc.returncode:
            raise AssertionError(
                f"{' '.join(args)}: {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        return proc

    def trainer_log(self) -> str:
        return self.compose("logs", "--no-color", "trainer", check=False).stdout

    def trainer_state(self) -> dict:
        cid = self.compose("ps", "-q", "trainer").stdout.strip()
        return json.loads(di.run(["docker", "inspect", cid]).stdout)[0]["State"]


def _wait(cond, what, stack, timeout=600.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{stack.trainer_log()[-4000:]}")
        time.sleep(1.0)


def test_the_compose_stack_trains_checkpoints_to_its_store_and_resumes(image, tmp_path):
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose not installed (deploy/install-test-deps.sh)")
    stack = Stack(image, tmp_path)
    try:
        stack.compose("up", "-d", "--no-build")
        _wait(lambda: "step 12/30" in stack.trainer_log(), "step 12", stack)
        stack.compose("stop", "trainer", timeout=300)  # SIGTERM: the ranks checkpoint, then exit
        first = stack.trainer_log()
        assert "checkpoint committed: s3://meshtrain/r1/checkpoints/step_" in first, first[-4000:]
        stopped = int(first.split("stopped at step ")[1].split()[0])
        stack.compose("up", "-d", "--no-build", "trainer")
        _wait(lambda: not stack.trainer_state()["Running"], "the resumed run to end", stack)
        assert stack.trainer_state()["ExitCode"] == 0, stack.trainer_log()[-4000:]
        log = stack.trainer_log()
        assert f"train.sh: resuming from s3://meshtrain/r1/checkpoints step {stopped}" in log, log[
            -4000:
        ]
        listed = stack.compose(
            "run",
            "--rm",
            "--no-deps",
            "--entrypoint",
            "meshtrain",
            "checkpoint",
            "ckpt",
            "list",
            "s3://meshtrain/r1/checkpoints",
        ).stdout.split()
        assert str(stopped) in listed and "30" in listed, listed
    finally:
        stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
