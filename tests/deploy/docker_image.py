"""Build the project's image for the image tests, where no registry may be reachable.

The base is made here: a minimal Debian (bookworm) root filesystem from Debian's own packages
(`debootstrap`), imported as an image. Python packages come from a wheelhouse filled on this
machine with `pip download` (torch, the dependencies at constraints.txt's versions) and served on
loopback, so the build (`docker build --network host --build-arg WHEELHOUSE=...`) reaches no
index. Both are cached under $MESHTRAIN_TEST_CACHE (default ~/.cache/meshtrain-test) and the base
image is kept between runs; the project's image is rebuilt each session (only its last layers,
when nothing but the sources changed).
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MESHTRAIN_TEST_CACHE", Path.home() / ".cache" / "meshtrain-test"))
BASE_IMAGE = "meshtrain-test-base:bookworm"
IMAGE = "meshtrain:test-cpu"
TORCH_VERSION = os.environ.get("MESHTRAIN_TEST_TORCH", "2.13.0")


def run(argv: list[str], timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    """Run a command; on failure raise with the end of its output."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if proc.returncode:
        raise RuntimeError(
            f"{' '.join(argv[:6])}... exited {proc.returncode}:\n"
            f"{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc


def missing() -> str | None:
    """Why the image tests cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker client"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode:
        return "no Docker daemon answers (start dockerd)"
    if shutil.which("debootstrap") is None:
        return "no debootstrap (apt-get install debootstrap) to make the base image"
    if os.geteuid() != 0:
        return "debootstrap needs root"
    return None


def base_image() -> str:
    """The Debian base image, made once: debootstrap's minbase with Python, imported."""
    if (
        subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode
        == 0
    ):
        return BASE_IMAGE
    rootfs = CACHE / "bookworm-rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        rootfs.parent.mkdir(parents=True, exist_ok=True)
        run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                str(rootfs),
                "http://deb.debian.org/debian",
            ],
            timeout=3600,
        )
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    run(["docker", "import", "--change", 'CMD ["/bin/bash"]', "-", BASE_IMAGE], stdin=tar.stdout)
    tar.wait()
    return BASE_IMAGE


def wheelhouse() -> Path:
    """Wheels of torch (CPU) and of every dependency of the cpu variant, at the pinned versions."""
    sys.path.insert(0, str(REPO / "deploy" / "docker"))
    from requirements import requirements

    house = CACHE / "wheelhouse"
    house.mkdir(parents=True, exist_ok=True)
    reqs = requirements(str(REPO / "pyproject.toml"), "s3,plot")
    pip = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "-d",
        str(house),
        "--only-binary",
        ":all:",
    ]
    run(pip + [f"torch=={TORCH_VERSION}"])
    run(pip + ["-c", str(REPO / "constraints.txt"), *reqs])
    return house


_served: dict[str, str] = {}


def served(folder: Path) -> str:
    """`folder` over HTTP on loopback, as a pip --find-links URL: one server per folder for the
    whole test process, so every build of a session passes the same WHEELHOUSE (a build
    argument a RUN step reads is part of its cache key: a new port each time rebuilt them all)."""
    key = str(folder)
    if key not in _served:
        handler = functools.partial(_QuietHandler, directory=key)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True, name="wheelhouse").start()
        _served[key] = f"http://127.0.0.1:{server.server_address[1]}/"
    return _served[key]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def build_image(tag: str = IMAGE) -> str:
    """Build deploy/Dockerfile (cpu variant) on the Debian base from the wheelhouse."""
    build(REPO, tag)
    return tag


def build(context: Path, tag: str) -> str:
    """`docker build` of deploy/Dockerfile in `context` (cpu variant, the Debian base, the
    wheelhouse); returns its output."""
    base, url = base_image(), served(wheelhouse())
    return run(
        [
            "docker",
            "build",
            "--network",
            "host",
            "-f",
            "deploy/Dockerfile",
            "--build-arg",
            f"BASE={base}",
            "--build-arg",
            "VARIANT=cpu",
            "--build-arg",
            f"TORCH_VERSION={TORCH_VERSION}",
            "--build-arg",
            f"WHEELHOUSE={url}",
            "-t",
            tag,
            ".",
        ],
        cwd=context,
        timeout=3600,
    ).stdout
