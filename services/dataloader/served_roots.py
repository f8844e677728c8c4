"""Which storage a data worker reads for its clients: the roots it was started with.

A request's dataset spec names the prefixes to open, and the worker opens them with its own
file permissions and object-store credentials; so a worker serves only the folders and URL
prefixes its operator allowed (`data serve --allow-root`, repeatable; `ServeConfig.allow_root`),
and refuses every other prefix with `DataAccessDeniedError` (PERMISSION_DENIED) before anything
is opened. Without `--allow-root` a worker serves its current directory and the user's meshtrain
cache (where trainers build the embedded default corpus), never object storage.

Local prefixes are compared by what they resolve to: the `.idx` and `.bin` files' real paths
(symlinks and `..` followed, relative paths taken from the worker's directory, as the files are
opened) must lie inside a root's real path, or be the files of a root that names a dataset
prefix itself. URLs match by scheme, bucket and key prefix on whole path segments
(`s3://b/data` serves `s3://b/data/x` but not `s3://b/data2/x`), and a URL with an empty, `.`
or `..` segment is refused outright, since a store or proxy may fold those.

    roots = ServedRoots(["/data", "s3://bucket/corpora"])
    roots.check("/data/web/ds")       # fine
    roots.check("/etc/ds")            # DataAccessDeniedError
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from meshtrain.services.common.errors import ConfigError, DataAccessDeniedError

# One store, several spellings: fsspec opens each pair with the same file system.
SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "abfss": "abfs", "az": "abfs"}


def default_roots() -> list[str]:
    """What a worker serves unless told: its current directory (relative data paths, and a worker
    started beside its data) and the user's meshtrain cache (the embedded default corpus)."""
    from meshtrain.services.dataloader.config import user_cache_dir

    return [os.getcwd(), user_cache_dir()]


def _url_parts(url: str) -> tuple[str, list[str]] | None:
    """(canonical scheme, path segments) of a URL; None for a local path (`file://` too)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() == "file":
        return None
    scheme = scheme.lower()
    return SCHEME_ALIASES.get(scheme, scheme), rest.split("/")


def _shown(prefix: str, limit: int = 200) -> str:
    return repr(prefix[:limit]) + ("..." if len(prefix) > limit else "")


def _real(path: str) -> str:
    return os.path.realpath(path.removeprefix("file://").removeprefix("FILE://"))


class ServedRoots:
    """The folders and URL prefixes a data worker reads datasets from (see the module)."""

    def __init__(self, roots: Iterable[str]):
        """Args:
        roots: local folders (or dataset prefixes) and URL prefixes (`s3://bucket/prefix`).

        Raises:
            ConfigError: an empty root, or a URL root with no bucket or a `.`/`..` segment.
        """
        self.roots = [str(r) for r in roots]
        self._local: list[str] = []
        self._remote: list[tuple[str, list[str]]] = []
        for root in self.roots:
            if not root.strip():
                raise ConfigError("--allow-root is empty: give a folder or a URL prefix")
            parts = _url_parts(root)
            if parts is None:
                self._local.append(_real(os.path.expanduser(root)))
                continue
            scheme, segments = parts
            while segments and segments[-1] == "":  # s3://bucket/data/ is s3://bucket/data
                segments.pop()
            if not segments or any(s in ("", ".", "..") for s in segments):
                raise ConfigError(
                    f"--allow-root {root!r}: give scheme://bucket[/prefix] without empty, "
                    "'.' or '..' segments"
                )
            self._remote.append((scheme, segments))

    def __repr__(self) -> str:
        return f"ServedRoots({self.roots!r})"

    def check(self, prefix: str) -> None:
        """Raise DataAccessDeniedError unless this worker serves dataset `prefix`.

        The message names the rule and this worker's flag, not the roots (a caller learns
        nothing of the worker's storage), and the prefix cut short.
        """
        parts = _url_parts(prefix)
        if parts is None:
            files = [_real(prefix + ext) for ext in (".idx", ".bin")]
            if all(any(self._inside(f, root) for root in self._local) for f in files):
                return
            rule = "its files (links and '..' resolved) lie outside every root"
        else:
            scheme, segments = parts
            if any(s in ("", ".", "..") for s in segments[:-1]) or segments[-1] in (".", ".."):
                rule = "a URL path with an empty, '.' or '..' segment is never served"
            elif any(scheme == s and segments[: len(r)] == r for s, r in self._remote):
                return
            else:
                rule = "it is under no served URL prefix (scheme, bucket, key prefix)"
        raise DataAccessDeniedError(
            f"dataset prefix {_shown(prefix)} is not served by this data worker: {rule} "
            "(the worker's --allow-root)"
        )

    @staticmethod
    def _inside(path: str, root: str) -> bool:
        if path in (root + ".idx", root + ".bin"):  # a root naming a dataset prefix itself
            return True
        return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
