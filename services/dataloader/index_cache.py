"""Sample indices cached on disk, keyed by a hash of everything they depend on.

Building a GPTDataset's or a blend's indices is deterministic, so a second process (another
rank, another data worker, a restarted job) can load them instead of rebuilding. The key is
a SHA-256 of a JSON description (dataset content fingerprint, documents, seq_length,
num_samples, seed, weights, format version); change any input and the key changes, so a
stale cache is never read. Files are written under a temporary name and renamed into place,
so concurrent builders are safe: the last rename wins with identical content. When the
folder is not writable the indices are simply built in memory.

A plain folder grows without bound; an `IndexCache` is a folder with a size quota, whose least
recently used entries are evicted to make room (a data worker's: every (seed, num_samples) a
client names is one more entry).

    arrays = cached_arrays(folder, {"seed": 1, ...}, build)  # build() -> {"doc_idx": ...}
    arrays = cached_arrays(IndexCache(folder, 8 << 30), {"seed": 1, ...}, build)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger("meshtrain.data")

FORMAT = 1  # bump when an index recipe changes, so old caches stop matching
_TMP = ".tmp-"  # in the names of files being written


def cache_key(desc: dict) -> str:
    """Hex digest naming the cache entry for `desc` (JSON-serializable, order-independent)."""
    blob = json.dumps({**desc, "format": FORMAT}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def array_digest(a: np.ndarray) -> str:
    """SHA-256 of an array's dtype, shape and bytes: a content fingerprint for cache keys."""
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).data.cast("B"))
    return h.hexdigest()


class IndexCache:
    """A cache folder with a size quota: the least recently used entries that no live stream
    uses are evicted to make room for a new one, and an entry larger than the whole quota (or
    than the room the entries in use leave) is not stored, only kept in memory.

    The manifest's modification time records an entry's last use, so the order survives a
    restart. An evicted entry asked for again is rebuilt, bit-identical (builds are
    deterministic). Evicting an entry that a dataset still has memory-mapped is harmless (the
    mapping stays valid) but frees its disk only when the dataset is dropped, which is why the
    entries of datasets that live streams read are pinned (`pinned`).

    Args:
        folder: the cache folder (created when first written).
        quota_bytes: the most bytes the entries may take together.
    """

    def __init__(self, folder: str | os.PathLike, quota_bytes: int):
        self.folder = Path(folder)
        self.quota_bytes = int(quota_bytes)
        self._pins: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.evicted = 0  # entries removed (for tests and logs)

    def __fspath__(self) -> str:
        return str(self.folder)

    def entries(self) -> dict[str, tuple[int, float]]:
        """key -> (bytes on disk, last use) of every complete entry."""
        try:
            listing = list(os.scandir(self.folder))
        except FileNotFoundError:
            return {}
        sizes: Counter[str] = Counter()
        manifests = {}
        for e in listing:
            if _TMP in e.name:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:  # evicted or replaced meanwhile
                continue
            if e.name.endswith(".json"):
                manifests[e.name[: -len(".json")]] = st
            elif e.name.endswith(".npy") and "-" in e.name:
                sizes[e.name.split("-", 1)[0]] += st.st_size
        return {key: (sizes[key] + st.st_size, st.st_mtime) for key, st in manifests.items()}

    def used_bytes(self) -> int:
        """Bytes the complete entries take."""
        return sum(size for size, _ in self.entries().values())

    def touch(self, key: str) -> None:
        """Marks the entry `key` as just used."""
        try:
            os.utime(self.folder / f"{key}.json")
        except OSError:
            pass

    @contextmanager
    def pinned(self, keys: Iterable[str]):
        """Keeps the entries `keys` from eviction for the `with` body (a use: they become the
        most recently used)."""
        keys = list(keys)
        with self._lock:
            self._pins.update(keys)
        for key in keys:
            self.touch(key)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(keys)
                self._pins = +self._pins  # drops the keys at zero

    def make_room(self, nbytes: int) -> bool:
        """Evicts least recently used entries that are not pinned until `nbytes` more fit the
        quota; False (nothing evicted) when they cannot."""
        if nbytes > self.quota_bytes:
            return False
        with self._lock:
            entries = self.entries()
            used = sum(size for size, _ in entries.values())
            victims = sorted((k for k in entries if not self._pins[k]), key=lambda k: entries[k][1])
            if used + nbytes - sum(entries[k][0] for k in victims) > self.quota_bytes:
                return False
            for key in victims:
                if used + nbytes <= self.quota_bytes:
                    break
                self._evict(key)
                used -= entries[key][0]
        return True

    def _evict(self, key: str) -> None:
        # the manifest first: from then on nobody loads the entry while its arrays go
        (self.folder / f"{key}.json").unlink(missing_ok=True)
        for path in self.folder.glob(f"{key}-*.npy"):
            if _TMP not in path.name:  # another thread's build of the entry, renamed soon
                path.unlink(missing_ok=True)
        self.evicted += 1
        log.info(
            "index cache %s: evicted entry %s to stay within its quota of %d bytes",
            self.folder,
            key,
            self.quota_bytes,
        )


def is_cached(folder: str | os.PathLike | IndexCache | None, desc: dict) -> bool:
    """Whether `cached_arrays(folder, desc, ...)` would load its arrays rather than build them
    (a data worker bounds only the memory of indices it has to build)."""
    return folder is not None and (Path(folder) / f"{cache_key(desc)}.json").is_file()


def cached_arrays(
    folder: str | os.PathLike | IndexCache | None,
    desc: dict,
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """Load the arrays for `desc` from `folder`, or build and store them.

    Args:
        folder: cache folder, or an `IndexCache` (a folder with a quota); None disables caching.
        desc: everything the arrays depend on (hashed into the file names).
        build: makes the arrays when they are not cached; returns name -> array.

    Returns:
        name -> array (memory-mapped read-only when cached, whether loaded or just stored;
        in memory when not stored: no cache, a folder that is not writable, or an entry that
        the cache's quota has no room for).
    """
    if folder is None:
        return build()
    quota = folder if isinstance(folder, IndexCache) else None
    folder = Path(folder)
    key = cache_key(desc)
    manifest = folder / f"{key}.json"
    if manifest.is_file():
        try:
            names = json.loads(manifest.read_text())["arrays"]
            arrays = {n: np.load(folder / f"{key}-{n}.npy", mmap_mode="r") for n in names}
            if quota is not None:
                quota.touch(key)
            return arrays
        except (OSError, ValueError, KeyError) as e:
            log.warning("index cache %s unreadable (%s); rebuilding", manifest, e)
    arrays = build()
    if quota is not None:
        nbytes = sum(a.nbytes for a in arrays.values())
        if not quota.make_room(nbytes):
            log.warning(
                "index cache %s: no room for a %d-byte entry within its quota of %d bytes beside "
                "the entries in use; indices kept in memory only",
                folder,
                nbytes,
                quota.quota_bytes,
            )
            return arrays
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # unique per writer: threads of one process (a data worker's streams) build at once
        tag = f"{_TMP}{os.getpid()}-{threading.get_ident():x}-{uuid.uuid4().hex[:8]}"
        for name, arr in arrays.items():
            tmp = folder / f"{key}-{name}{tag}.npy"
            np.save(tmp, arr)
            os.replace(tmp, folder / f"{key}-{name}.npy")
        # the manifest is written last: it is what makes the entry visible
        tmp = folder / f"{key}{tag}.json"
        tmp.write_text(
            json.dumps({"arrays": sorted(arrays), "desc": desc}, sort_keys=True, indent=1)
        )
        os.replace(tmp, manifest)
        # the stored copies, memory-mapped: a data worker keeps several datasets open, and built
        # arrays held each index in its heap for as long as the dataset stayed cached
        return {n: np.load(folder / f"{key}-{n}.npy", mmap_mode="r") for n in arrays}
    except OSError as e:
        log.warning("index cache %s not writable (%s); indices kept in memory only", folder, e)
    return arrays
