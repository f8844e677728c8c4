"""Sample indices cached on disk, keyed by a hash of everything they depend on.

Building a GPTDataset's or a blend's indices is deterministic, so a second process (another
rank, another data worker, a restarted job) can load them instead of rebuilding. The key is
a SHA-256 of a JSON description (dataset content fingerprint, documents, seq_length,
num_samples, seed, weights, format version); change any input and the key changes, so a
stale cache is never read. Files are written under a temporary name and renamed into place,
so concurrent builders are safe: the last rename wins with identical content. When the
folder is not writable the indices are simply built in memory.

    arrays = cached_arrays(folder, {"seed": 1, ...}, build)  # build() -> {"doc_idx": ...}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger("meshtrain.data")

FORMAT = 1  # bump when an index recipe changes, so old caches stop matching


def cache_key(desc: dict) -> str:
    """Hex digest naming the cache entry for `desc` (JSON-serializable, order-independent)."""
    blob = json.dumps({**desc, "format": FORMAT}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def array_digest(a: np.ndarray) -> str:
    """SHA-256 of an array's dtype, shape and bytes: a content fingerprint for cache keys."""
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def is_cached(folder: str | os.PathLike | None, desc: dict) -> bool:
    """Whether `cached_arrays(folder, desc, ...)` would load its arrays rather than build them
    (a data worker bounds only the memory of indices it has to build)."""
    return folder is not None and (Path(folder) / f"{cache_key(desc)}.json").is_file()


def cached_arrays(
    folder: str | os.PathLike | None,
    desc: dict,
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """Load the arrays for `desc` from `folder`, or build and store them.

    Args:
        folder: cache folder; None disables caching.
        desc: everything the arrays depend on (hashed into the file names).
        build: makes the arrays when they are not cached; returns name -> array.

    Returns:
        name -> array (memory-mapped read-only when cached, whether loaded or just stored).
    """
    if folder is None:
        return build()
    folder = Path(folder)
    key = cache_key(desc)
    manifest = folder / f"{key}.json"
    if manifest.is_file():
        try:
            names = json.loads(manifest.read_text())["arrays"]
            return {n: np.load(folder / f"{key}-{n}.npy", mmap_mode="r") for n in names}
        except (OSError, ValueError, KeyError) as e:
            log.warning("index cache %s unreadable (%s); rebuilding", manifest, e)
    arrays = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # unique per writer: threads of one process (a data worker's streams) build at once
        tag = f".tmp-{os.getpid()}-{threading.get_ident():x}-{uuid.uuid4().hex[:8]}"
        for name, arr in arrays.items():
            tmp = folder / f"{key}-{name}{tag}.npy"
            np.save(tmp, arr)
            os.replace(tmp, folder / f"{key}-{name}.npy")
        # the manifest is written last: it is what makes the entry visible
        tmp = folder / f"{key}{tag}.json"
        tmp.write_text(json.dumps({"arrays": sorted(arrays), "desc": desc}, sort_keys=True, indent=1))
        os.replace(tmp, manifest)
        # the stored copies, memory-mapped: a data worker keeps several datasets open, and built
        # arrays held each index in its heap for as long as the dataset stayed cached
        return {n: np.load(folder / f"{key}-{n}.npy", mmap_mode="r") for n in arrays}
    except OSError as e:
        log.warning("index cache %s not writable (%s); indices kept in memory only", folder, e)
    return arrays
