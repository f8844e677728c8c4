"""small_disk: a real filesystem of a few MB that fills up, for tests of what a full disk does.

A tmpfs mounted on a folder of the test's own: writes past its size fail with ENOSPC from the
kernel, as on a full disk, with no mock in the way. Mounting needs root (CI runs tests as root
on a fresh VM); elsewhere the test is skipped, saying why. `fill` leaves a chosen number of bytes
free with one filler file, which the test deletes to free the space again.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int, read_only: bool = False) -> Iterator[Path]:
    """Mounts a tmpfs of `size_mb` MB on `path` (created) for the block, read-only (EROFS on
    every write, even for root) with `read_only`; skips the test if it cannot (not root, or
    mounting not permitted here)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full disk is tested on a small tmpfs, and mounting one needs root")
    mounted = subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"{'ro,' if read_only else ''}size={size_mb}m",
            "tmpfs",
            str(path),
        ],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs to fill up here: {mounted.stderr.strip() or mounted.returncode}"
        )
    try:
        yield path
    finally:
        for _ in range(10):  # a server stopped just now may still close its files
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.3)
        else:
            detached = subprocess.run(["umount", "-l", str(path)], capture_output=True, text=True)
            assert detached.returncode == 0, (
                f"cannot unmount the tmpfs on {path}: {detached.stderr.strip()}"
            )


def free_bytes(path: Path) -> int:
    """Bytes free on the filesystem of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int) -> Path:
    """Allocates a filler file in folder `path` that leaves about `leave` bytes free; returns it."""
    filler = path / "filler"
    size = free_bytes(path) - leave
    assert size > 0, (
        f"{path} has only {free_bytes(path)} bytes free, less than the {leave} to leave"
    )
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return filler
