"""Domain errors shared by all services.

Every error a user can cause (bad config, corrupt file, missing path, malformed request)
is raised as a subclass of `MeshtrainError` with a message that names what was wrong. The
gRPC shells map these classes to status codes; the CLI prints the message and exits 2.
"""

import errno
import os


class MeshtrainError(Exception):
    """Base class of every error meshtrain raises on purpose."""


class ConfigError(MeshtrainError, ValueError):
    """A config key, value or flag is unknown, of the wrong type, or not allowed."""


class InvalidRequestError(MeshtrainError, ValueError):
    """A field of a request to a service is malformed or over a bound the service sets (the
    gRPC shells answer INVALID_ARGUMENT, naming the field)."""


class NotBuiltError(ConfigError):
    """A flag names a feature that exists in the design but is not built yet."""


class DataError(MeshtrainError):
    """A dataset, tokenizer or input file is missing, corrupt or inconsistent."""


class DataUnavailableError(DataError):
    """A dataset's storage failed to answer a read (a network or object-store error).

    Not the request's fault, unlike its parent: the same read may succeed when tried again,
    or on another data worker, so the gRPC shells report it as UNAVAILABLE, which clients fail
    over on, where any other DataError is INVALID_ARGUMENT and ends the run.
    """


class DataNotFoundError(DataError):
    """A dataset's file, folder or bucket does not exist. The gRPC shells answer NOT_FOUND: not
    worth a retry (unlike `DataUnavailableError`), and told apart from a malformed request."""


class DataAccessDeniedError(DataError):
    """A request names storage this data worker does not serve (outside its `--allow-root`s).
    The gRPC shells answer PERMISSION_DENIED."""


class StorageUnavailableError(MeshtrainError):
    """A service's storage failed (a disk, network or object-store error) while serving a
    request that was fine: the gRPC shells report it as UNAVAILABLE, which clients retry.

    `lasting`: it fails the same way every time (`is_lasting_storage_error`); the status then
    carries LASTING_METADATA, and clients try it their attempts, not for their retry time."""

    def __init__(self, message: str, lasting: bool = False):
        super().__init__(message)
        self.lasting = lasting


# Trailing metadata a service adds to an UNAVAILABLE whose cause lasts (see above).
LASTING_METADATA = ("meshtrain-lasting", "1")


# Modules of storage backends whose exceptions are not OSErrors (botocore's connection errors,
# aiohttp's disconnects under s3fs); what fsspec, s3fs and zarr's stores raise otherwise is one.
_STORAGE_MODULES = ("botocore", "aiobotocore", "aiohttp")


def is_storage_error(exc: BaseException) -> bool:
    """Whether `exc` is storage failing (an OSError, or a storage backend's own exception)
    rather than a bug or a bad request."""
    return isinstance(exc, OSError) or type(exc).__module__.startswith(_STORAGE_MODULES)


# errno values of storage that is full: no space left (ENOSPC), or the user's quota spent (EDQUOT).
_DISK_FULL_ERRNOS = frozenset(
    e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None
)
# What the OS says for them: an error that crossed a process (a checkpoint service's answer, a
# writer's error in its fragment) keeps only its text.
_DISK_FULL_TEXTS = tuple(os.strerror(e) for e in sorted(_DISK_FULL_ERRNOS))

# errno values of storage failing the same way on every try: a path through a file, a
# directory where a file goes, a denied or read-only location, a name too long, a file larger
# than the filesystem takes; and a full disk, which space may be freed on, but not within the
# seconds of a retry, where each try only writes the same bytes into it again.
_LASTING_ERRNOS = (
    frozenset(
        {
            errno.ENOTDIR,
            errno.EISDIR,
            errno.EACCES,
            errno.EPERM,
            errno.EROFS,
            errno.ENAMETOOLONG,
            errno.ELOOP,
            errno.EFBIG,
        }
    )
    | _DISK_FULL_ERRNOS
)


def is_lasting_storage_error(exc: BaseException) -> bool:
    """Whether `exc` is storage that will fail again however long one waits (see
    `_LASTING_ERRNOS`; s3fs raises PermissionError for a denied bucket or bad credentials),
    rather than an outage a retry may outlast; or an error that says so of its cause (a
    service's answer marked lasting)."""
    if getattr(exc, "lasting", False) is True:
        return True
    if isinstance(exc, (NotADirectoryError, IsADirectoryError, PermissionError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _LASTING_ERRNOS


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is storage being full (ENOSPC, EDQUOT):
    an OSError saying so, a DiskFullError, or an error whose message quotes the OS's words for
    it (all that is left of it once it crossed a process: a checkpoint service's answer, the
    error a writer reported in its fragment)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, DiskFullError) or (
            isinstance(cause, OSError) and cause.errno in _DISK_FULL_ERRNOS
        ):
            return True
        if any(text in str(cause) for text in _DISK_FULL_TEXTS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class CheckpointError(MeshtrainError):
    """A checkpoint is missing, uncommitted, corrupt, or does not match the model."""


class CheckpointStorageError(CheckpointError):
    """A checkpoint save's storage (a folder, an object store, or the checkpoint service in
    front of one) kept failing through every retry: `checkpoint.save_attempts` tries, and
    `checkpoint.save_retry_timeout_s` seconds unless the failure is lasting. Waiting longer
    would not help, so `meshtrain train` ends with STORAGE_EXIT_STATUS, which
    deploy/train.sh, compose and the Slurm job do not restart from scratch on."""


STORAGE_EXIT_STATUS = 74
"""Exit status of `meshtrain train` ended by a CheckpointStorageError (sysexits' EX_IOERR)."""


class DiskFullError(CheckpointStorageError):
    """A save failed because its storage is full (ENOSPC; EDQUOT: a quota spent).

    Lasting (`is_lasting_storage_error`): tried `checkpoint.save_attempts` times, not for the
    retry time. Nothing of the save is committed, and what it had stored is removed; a training
    run says so at every logged step and trains on (the next save tries again), but the failure
    of its final save ends it."""

    lasting = True


class SaveForgottenError(CheckpointError):
    """The checkpoint service does not know a save in progress: it restarted mid-save and
    forgot the save's id. Not retried as it is, but the save can be taken up again there
    (`CheckpointClient.resume_save`) and its boxes sent again, which `AsyncSaver` does."""
