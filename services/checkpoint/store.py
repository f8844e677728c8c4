"""Filesystem plumbing for checkpoints: root URLs, paths, atomic small files, zarr stores.

Everything the writer and reader do to storage goes through an fsspec filesystem opened from
the root URL (plain local path, `file://`, `memory://`; `s3://` needs only s3fs installed), so
object stores need no special code. Small files (the manifest) are written atomically: to a
temporary name and renamed on a local disk, a single PUT elsewhere (object-store PUTs are
atomic; a rename there would be a copy plus delete). Zarr sees the same storage through a
`LocalStore` on local disk and an `FsspecStore` otherwise. The manifest, which is the commit,
is created only if absent (`write_bytes_exclusive`): a hard link of a finished temporary file on
a local disk, a conditional PUT (`If-None-Match: *`) on S3, a lock-guarded check on memory://,
so two committers of one step can never both commit it. An S3 store that ignores the condition
is found by a probe before its first such write and refused with an error naming it.
"""

from __future__ import annotations

import os
import posixpath
import re
import threading
import time
import uuid
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

from meshtrain.services.checkpoint.nofollow import create_beneath, makedirs_beneath, open_beneath
from meshtrain.services.common.errors import CheckpointError

MANIFEST_NAME = "manifest.json"
_STEP_RE = re.compile(r"step_(\d{8,})")  # fullmatch: "$" let a final newline in


@dataclass(frozen=True)
class Root:
    """A checkpoint root: the URL the user gave and the filesystem + path it resolves to."""

    url: str
    fs: fsspec.AbstractFileSystem
    path: str

    @property
    def is_local(self) -> bool:
        """True when the root is on a local disk (rename is atomic there)."""
        return isinstance(self.fs, LocalFileSystem)

    def step_path(self, step: int) -> str:
        """Filesystem path of the folder of `step`."""
        return join(self.path, step_dirname(step))

    def step_url(self, step: int) -> str:
        """URL of the folder of `step`, in the same form as the root URL."""
        return self.url.rstrip("/") + "/" + step_dirname(step)


def open_root(url: str) -> Root:
    """Opens the filesystem of a checkpoint root URL.

    Args:
        url: a local path or fsspec URL (`file://`, `memory://`, `s3://...`).

    Returns:
        The Root.

    Raises:
        CheckpointError: the URL is empty or its protocol is unknown / not installed.
    """
    if not isinstance(url, str) or not url:
        raise CheckpointError(f"checkpoint root must be a non-empty path or URL, got {url!r}")
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    # Other processes write under the root (ranks, the service, the committer polling for
    # fragments): a cached directory listing would go stale, so object stores list afresh.
    options: dict = {} if protocol in ("file", "local", "memory") else {"use_listings_cache": False}
    if protocol in ("s3", "s3a"):
        # fsspec caches filesystem instances by their arguments; with the endpoint and keys only
        # in the environment, a later root on another endpoint would reuse the first one's
        # client. Passing them makes them part of the key (they are never written anywhere).
        for option, names in (
            ("endpoint_url", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")),
            ("key", ("AWS_ACCESS_KEY_ID",)),
            ("secret", ("AWS_SECRET_ACCESS_KEY",)),
        ):
            value = next((os.environ[n] for n in names if os.environ.get(n)), None)
            if value:
                options[option] = value
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ValueError, ImportError) as e:
        raise CheckpointError(f"cannot open checkpoint root {url!r}: {e}") from e
    return Root(url=url, fs=fs, path=path.rstrip("/") or "/")


def same_root(a: str, b: str) -> bool:
    """Whether two root URLs name the same place (`/x/ckpt`, `file:///x/ckpt/`, a relative
    path to it, `/y/../x/ckpt` and a symlink to it do), so a run can tell that it resumed
    from the root it saves into, and a conversion that it would write over its source."""
    ra, rb = open_root(a), open_root(b)
    if ra.is_local and rb.is_local:  # `x/../x` and a symlink to the folder are the folder
        return os.path.realpath(ra.path) == os.path.realpath(rb.path)
    return type(ra.fs) is type(rb.fs) and ra.path == rb.path


def join(*parts: str) -> str:
    """Joins path components with "/" (fsspec paths are POSIX-style on every filesystem).

    Args:
        parts: path components; empty ones are skipped.

    Returns:
        The joined path.
    """
    return posixpath.join(*[p for p in parts if p])


def step_dirname(step: int) -> str:
    """Returns the folder name of a step, e.g. `step_00000050`.

    Args:
        step: a non-negative training step.

    Returns:
        The folder name.

    Raises:
        CheckpointError: the step is not a non-negative int.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
    return f"step_{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    """Returns the step of a folder name like `step_00000050`, or None if it is not one."""
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def write_bytes_atomic(root: Root, path: str, data: bytes) -> None:
    """Writes a small file so readers see either nothing or all of it.

    Args:
        root: the root whose filesystem holds `path`.
        path: destination path.
        data: file contents.
    """
    if not root.is_local:
        root.fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    # no symlink below the root is followed (one planted in a step folder led outside it)
    makedirs_beneath(root.path, os.path.dirname(path))
    try:
        with os.fdopen(
            open_beneath(root.path, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb"
        ) as f:
            f.write(data)
            f.flush()
            # fsync before rename: otherwise a crash can leave the new name with empty contents.
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.path.dirname(path))  # the rename itself survives a crash
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


CONFLICT_RETRIES = 5  # conditional PUTs answered 409 (a racing write) asked again
_MEMORY_CREATE = threading.Lock()  # memory:// has no atomic create: check and write under one lock
_CONDITIONAL: dict[tuple[str, str], bool] = {}  # (filesystem, bucket) -> honors If-None-Match
_PROBE_LOCK = threading.Lock()


def write_bytes_exclusive(root: Root, path: str, data: bytes) -> bool:
    """Writes a small file only if no file of that name exists, atomically: of several callers
    racing on one path (other threads, processes or machines), exactly one creates it.

    Args:
        root: the root whose filesystem holds `path`.
        path: destination path.
        data: file contents.

    Returns:
        True when this call created the file, False when one existed (it is left as it was).

    Raises:
        CheckpointError: the store cannot create a file only if absent (an S3 server ignoring
            `If-None-Match: *`, a filesystem without a known way), so a race could not be ruled out.
    """
    if root.is_local:
        return create_beneath(root.path, path, data)
    if isinstance(root.fs, MemoryFileSystem):
        with _MEMORY_CREATE:
            if root.fs.exists(path):
                return False
            root.fs.pipe_file(path, data)
            return True
    if not _is_s3(root):
        raise CheckpointError(
            f"checkpoint root {root.url!r}: its filesystem ({type(root.fs).__name__}) offers no "
            "atomic create-if-absent, so a commit could race another; use a local folder, s3:// "
            "or memory://"
        )
    _require_conditional_writes(root, path)
    for attempt in range(CONFLICT_RETRIES + 1):
        try:
            root.fs.pipe_file(path, data, mode="create")
            return True
        except OSError as e:
            if _precondition_failed(e):
                return False
            if not _conflict(e) or attempt == CONFLICT_RETRIES:
                raise
        # S3 answers 409 to a conditional PUT racing another write of the key: asked again,
        # it answers 412 (the other write landed) or creates the object
        time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def _is_s3(root: Root) -> bool:
    return "s3" in (
        root.fs.protocol if isinstance(root.fs.protocol, tuple) else (root.fs.protocol,)
    )


def _precondition_failed(e: OSError) -> bool:
    """Whether a conditional PUT was refused because the object exists: s3fs raises
    FileExistsError when the server names the condition, else an OSError caused by botocore's
    ClientError with code PreconditionFailed (HTTP 412), as SeaweedFS answers."""
    if isinstance(e, FileExistsError):
        return True
    response = getattr(e.__cause__, "response", None) or {}
    error = response.get("Error", {})
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return error.get("Code") in ("PreconditionFailed", "412") or status == 412


def _conflict(e: OSError) -> bool:
    """Whether a conditional PUT was refused for racing another write of the key (HTTP 409
    ConditionalRequestConflict): worth asking again."""
    response = getattr(e.__cause__, "response", None) or {}
    code = response.get("Error", {}).get("Code")
    return (
        code == "ConditionalRequestConflict"
        or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 409
    )


def _require_conditional_writes(root: Root, path: str) -> None:
    """Probes, once per bucket, that the S3 server refuses a second `If-None-Match: *` PUT of
    an object; raises CheckpointError naming the store when it does not."""
    bucket = path.split("/", 1)[0]
    key = (repr(root.fs.storage_options.get("endpoint_url")) + type(root.fs).__name__, bucket)
    with _PROBE_LOCK:
        known = _CONDITIONAL.get(key)
        if known is None:
            probe = join(root.path, f".conditional-write-probe-{uuid.uuid4().hex}")
            root.fs.pipe_file(probe, b"1", mode="create")
            try:
                root.fs.pipe_file(probe, b"2", mode="create")
                known = False
            except OSError as e:
                if not _precondition_failed(e):
                    raise
                known = True
            finally:
                root.fs.rm(probe)
            _CONDITIONAL[key] = known
    if not known:
        raise CheckpointError(
            f"the object store of {root.url!r} ignored a conditional PUT (If-None-Match: *): it "
            "cannot create the manifest only if absent, so two committers could both commit a "
            "step; use a store that supports conditional writes (AWS S3, SeaweedFS, MinIO, Ceph "
            "RGW of recent versions)"
        )


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_bytes(root: Root, path: str) -> bytes:
    """Reads a whole file; FileNotFoundError when it does not exist."""
    return root.fs.cat_file(path)


def remove_tree(root: Root, path: str) -> None:
    """Removes a folder / prefix and everything under it; a missing one is not an error."""
    if root.fs.exists(path):
        root.fs.rm(path, recursive=True)


def list_objects(root: Root, path: str) -> list[str]:
    """Lists every file / object under a folder, as paths relative to it, sorted.

    Args:
        root: the root whose filesystem holds `path`.
        path: the folder.

    Returns:
        Relative POSIX paths, e.g. ["layers.mlp.fc1.weight/c/0/0", ...].
    """
    prefix = path.rstrip("/") + "/"
    found = root.fs.find(path)
    return sorted(p[len(prefix) :] for p in found if p.startswith(prefix))


def zarr_store(root: Root, path: str, read_only: bool = False) -> Store:
    """Builds a zarr store over a folder of the root's filesystem.

    Args:
        root: the root.
        path: the folder (usually a step folder).
        read_only: open the store read-only.

    Returns:
        A LocalStore on local disk, an FsspecStore otherwise.
    """
    if root.is_local:
        return LocalStore(path, read_only=read_only)
    fs = root.fs
    # FsspecStore needs an asynchronous filesystem instance; sync-only ones are wrapped.
    if not fs.async_impl:
        from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

        fs = AsyncFileSystemWrapper(fs, asynchronous=True)
    elif not fs.asynchronous:
        fs = type(fs)(**fs.storage_options, asynchronous=True)
    return FsspecStore(fs, path=path, read_only=read_only)
