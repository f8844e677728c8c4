"""Domain errors shared by all services.

Every error a user can cause (bad config, corrupt file, missing path, malformed request)
is raised as a subclass of `MeshtrainError` with a message that names what was wrong. The
gRPC shells map these classes to status codes; the CLI prints the message and exits 2.
"""

import errno


class MeshtrainError(Exception):
    """Base class of every error meshtrain raises on purpose."""


class ConfigError(MeshtrainError, ValueError):
    """A config key, value or flag is unknown, of the wrong type, or not allowed."""


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


# errno values of storage failing the same way on every try: a path through a file, a
# directory where a file goes, a denied or read-only location, a name too long.
_LASTING_ERRNOS = frozenset({errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                             errno.ENAMETOOLONG, errno.ELOOP})


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


class CheckpointError(MeshtrainError):
    """A checkpoint is missing, uncommitted, corrupt, or does not match the model."""


class SaveForgottenError(CheckpointError):
    """The checkpoint service does not know a save in progress: it restarted mid-save and
    forgot the save's id. Not retried as it is, but the save can be taken up again there
    (`CheckpointClient.resume_save`) and its boxes sent again, which `AsyncSaver` does."""
