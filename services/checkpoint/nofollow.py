"""Local checkpoint files written without following a symlink inside the root.

Anyone who can write into a checkpoint root could plant a symlink inside a step folder (say
`step_00000010/w -> /etc`) while a save is under way; the service, which writes, lists and
deletes there, would then write or delete outside the root. So every folder below the root is
opened with O_NOFOLLOW relative to its parent's descriptor (nothing can be swapped between a
check and the write), files are created with O_NOFOLLOW, and a step folder holding a symlink
is refused before a commit reads, lists or deletes in it and before the service reads from it.
The root itself may be a symlink: its operator chose it.

    fd = open_beneath("/ckpt", "/ckpt/step_00000010/w/c/0", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid

from meshtrain.services.common.errors import CheckpointError


def _refusal(link: str, base: str, more: int = 0) -> CheckpointError:
    return CheckpointError(
        f"{link} is a symlink inside the checkpoint root {base}"
        + (f" (and {more} more)" if more else "")
        + "; meshtrain never follows one there (it did not make it): remove it"
    )


def _named(e: OSError, path: str) -> OSError:
    """`e` (raised relative to a folder's descriptor, naming only the last component) naming the
    whole path, as storage errors do elsewhere."""
    return type(e)(e.errno, e.strerror, path)


def _parts(base: str, path: str) -> list[str]:
    parts = [p for p in os.path.relpath(path, base).split(os.sep) if p not in ("", ".")]
    if not parts or parts[0] == "..":
        raise CheckpointError(f"{path} is not inside the checkpoint root {base}")
    return parts


def _open_dir(fd: int, name: str, where: str, base: str, create: bool) -> int:
    """The folder `name` in the open folder `fd` (at `where`), never through a symlink."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    except FileNotFoundError as e:
        if not create:
            raise _named(e, where) from None
        with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
            os.mkdir(name, dir_fd=fd)
        return _open_dir(fd, name, where, base, create=False)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
            os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        ):
            raise _refusal(where, base) from None
        raise _named(e, where) from None


def _walk(base: str, parts: list[str], create: bool) -> int:
    """A descriptor of the folder `base/parts...`, each component opened without following."""
    try:  # the root itself is followed: its operator chose it
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(base, exist_ok=True)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, name in enumerate(parts):
            child = _open_dir(fd, name, os.path.join(base, *parts[: i + 1]), base, create)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_beneath(
    base: str, path: str, flags: int, mode: int = 0o644, create_dirs: bool = True
) -> int:
    """Opens the file `path` inside the folder `base` without following a symlink at any
    component below `base` (missing folders on the way are created, unless not `create_dirs`:
    FileNotFoundError then).

    Args:
        base: the checkpoint root's local path.
        path: the file, inside `base`.
        flags: `os.open` flags for the file (O_NOFOLLOW is added).
        mode: permissions of a created file.

    Returns:
        The file's descriptor (the caller closes it).

    Raises:
        CheckpointError: a component below `base` is a symlink, or `path` is not inside `base`.
    """
    parts = _parts(base, path)
    fd = _walk(base, parts[:-1], create=create_dirs)
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refusal(path, base) from None
        raise _named(e, path) from None
    finally:
        os.close(fd)


def create_beneath(base: str, path: str, data: bytes) -> bool:
    """Creates the file `path` inside `base` holding `data`, only if no such file exists, and
    all at once: the bytes go to a temporary name first (fsynced), which is then hard-linked to
    `path` (link fails when the name exists, so two callers can never both create it, and
    readers never see a partial file). No symlink below `base` is followed.

    Returns:
        True when this call created `path`, False when it existed already (left untouched).

    Raises:
        CheckpointError: a component below `base` is a symlink, or `path` is not inside `base`.
    """
    parts = _parts(base, path)
    fd = _walk(base, parts[:-1], create=True)
    tmp = f"{parts[-1]}.tmp-{uuid.uuid4().hex}"
    try:
        with os.fdopen(
            os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd),
            "wb",
        ) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            return False
        os.fsync(fd)  # the new name survives a crash
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd)
        os.close(fd)


def makedirs_beneath(base: str, path: str) -> None:
    """`os.makedirs(path, exist_ok=True)` for a folder inside `base`, refusing (CheckpointError)
    a symlink at any component below `base` instead of following it."""
    os.close(_walk(base, _parts(base, path), create=True))


def refuse_symlinks(base: str, folder: str) -> None:
    """Raises CheckpointError naming a symlink on the way from the root `base` to `folder` or
    anywhere inside `folder` (never descending into a linked folder). A missing folder holds
    none."""
    parts = _parts(base, folder)
    for i in range(len(parts)):
        if os.path.islink(os.path.join(base, *parts[: i + 1])):
            raise _refusal(os.path.join(base, *parts[: i + 1]), base)
    links = []
    for top, dirs, files in os.walk(folder, followlinks=False):
        links += [
            os.path.join(top, n) for n in dirs + files if os.path.islink(os.path.join(top, n))
        ]
    if links:
        raise _refusal(links[0], base, len(links) - 1)
