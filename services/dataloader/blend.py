"""Blending several datasets by weight into one sample stream.

`blending_indices(weights, n)` decides, for each position of the blended stream, which
dataset it draws from and which of that dataset's samples it takes. The order is Tijdeman's
chairman-assignment sequence (see `_blend.c`): each position goes to a dataset that is behind
its target share, the one whose next sample falls due first, so every prefix of length n
holds `w_d * n` samples of dataset d to within one sample, for any number of datasets and
weights as small as 1e-4. Megatron's plain "furthest behind" greedy can drift past one
sample with several small weights, which is why this variant is used. The loop is a few lines
of C compiled once per machine with the system compiler and called through ctypes; 10 M
positions take well under a second.

    ds_index, ds_sample = blending_indices([0.7, 0.3], 1000)  # (1000,) int16, (1000,) int64
    blended = BlendedDataset([a, b], [0.7, 0.3], num_samples=1000)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.index_cache import cache_key, cached_arrays

_SOURCE = Path(__file__).with_name("_blend.c")
_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
MAX_DATASETS = 2**15 - 1  # dataset ids are int16, as in Megatron's blending index


def _library_dir() -> Path:
    root = os.environ.get("MESHTRAIN_BUILD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshtrain"
    )
    return Path(root)


def _load_library() -> ctypes.CDLL:
    """Compile `_blend.c` (once per source version and machine) and load it."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        source = _SOURCE.read_bytes()
        tag = hashlib.sha256(source + sysconfig.get_platform().encode()).hexdigest()[:16]
        out = _library_dir() / f"blend-{tag}.so"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            cc = os.environ.get("CC", "cc")
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
            try:
                subprocess.run(
                    [cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(_SOURCE)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
            except (OSError, subprocess.CalledProcessError) as e:
                os.unlink(tmp)
                detail = getattr(e, "stderr", "") or str(e)
                raise DataError(
                    f"building the blending helper {_SOURCE} with C compiler {cc!r} failed: "
                    f"{detail}"
                ) from e
            os.replace(tmp, out)  # atomic: concurrent builders each produce the same library
        lib = ctypes.CDLL(str(out))
        lib.meshtrain_blend.restype = ctypes.c_int
        lib.meshtrain_blend.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        _lib = lib
        return lib


def normalize_weights(weights, names: list[str] | None = None) -> np.ndarray:
    """Check blending weights and scale them to sum to 1.

    Args:
        weights: one non-negative finite weight per dataset, not all zero.
        names: dataset names for error messages.

    Returns:
        (K,) float64 weights summing to 1.
    """
    w = np.asarray(weights, dtype=np.float64)
    label = f" for {names}" if names else ""
    if w.ndim != 1 or w.size == 0:
        raise DataError(f"blending weights{label} must be a non-empty list, got {weights!r}")
    if w.size > MAX_DATASETS:
        raise DataError(f"{w.size} datasets exceed the blending limit of {MAX_DATASETS}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise DataError(f"blending weights{label} must be finite and >= 0, got {w.tolist()}")
    if w.sum() <= 0:
        raise DataError(f"blending weights{label} are all zero")
    return w / w.sum()


def blending_indices(weights, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset, and which of its samples, each blended position takes.

    Args:
        weights: non-negative weights, one per dataset (normalized here).
        num_samples: length of the blended stream.

    Returns:
        dataset_index (num_samples,) int16 and dataset_sample_index (num_samples,) int64:
        position i is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`, and
        each dataset's samples are taken in order 0, 1, 2, ...
    """
    w = np.ascontiguousarray(normalize_weights(weights), dtype=np.float64)
    if num_samples < 0:
        raise DataError(f"num_samples={num_samples} is negative")
    ds_index = np.empty(num_samples, dtype=np.int16)
    ds_sample = np.empty(num_samples, dtype=np.int64)
    rc = _load_library().meshtrain_blend(
        w.ctypes.data, w.size, num_samples, ds_index.ctypes.data, ds_sample.ctypes.data
    )
    if rc != 0:
        raise DataError(f"blending {w.size} datasets failed (code {rc}); weights {w.tolist()}")
    return ds_index, ds_sample


def samples_needed(weights, num_samples: int) -> list[int]:
    """Samples each dataset must provide for a blend of `num_samples` (share + 1, rounded up)."""
    w = normalize_weights(weights)
    return [int(np.ceil(x * num_samples)) + 1 if x > 0 else 0 for x in w]


def blend_index_desc(weights: np.ndarray, num_samples: int) -> dict:
    """What a blend's index depends on (normalized weights): its cache entry's description."""
    return {
        "kind": "blend",
        "weights": np.asarray(weights).tolist(),
        "num_samples": int(num_samples),
    }


class BlendedDataset:
    """Several sample datasets interleaved by weight; indexable like a GPTDataset."""

    def __init__(
        self,
        datasets: list,
        weights,
        num_samples: int,
        name: str = "train",
        cache_dir: str | os.PathLike | None = None,
    ):
        """Args:
        datasets: GPTDataset-like objects (`__getitem__`, `__len__`, `seq_length`); a dataset
            with weight 0 may be None.
        weights: one weight per dataset.
        num_samples: samples in the blend.
        name: split name for error messages.
        cache_dir: where to cache the blending index (a folder or an `index_cache.IndexCache`);
            None: no cache.
        """
        self.weights = normalize_weights(weights)
        if len(datasets) != self.weights.size:
            raise DataError(f"{len(datasets)} datasets but {self.weights.size} weights")
        self.datasets = datasets
        self.name = name
        self.num_samples = int(num_samples)
        live = [d for d in datasets if d is not None]
        self.seq_length = live[0].seq_length
        if any(d.seq_length != self.seq_length for d in live):
            raise DataError(f"blended datasets [{name}] have different seq_length")
        # SFT parts (packed, with loss masks) blend only with SFT parts
        self.carries_mask = bool(getattr(live[0], "carries_mask", False))
        if any(bool(getattr(d, "carries_mask", False)) != self.carries_mask for d in live):
            raise DataError(f"blended datasets [{name}] mix SFT and pretraining datasets")
        desc = blend_index_desc(self.weights, self.num_samples)
        self.index_key = cache_key(desc)  # its entry in an index cache
        arrays = cached_arrays(
            cache_dir,
            desc,
            lambda: dict(
                zip(
                    ("dataset_index", "dataset_sample_index"),
                    blending_indices(self.weights, self.num_samples),
                )
            ),
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, need in enumerate(samples_needed(self.weights, self.num_samples)):
            if need and len(datasets[d]) < need - 1:
                raise DataError(
                    f"blended dataset {d} [{name}] has {len(datasets[d])} samples; its weight "
                    f"{self.weights[d]:.6g} of {self.num_samples} needs {need - 1}"
                )

    def __len__(self) -> int:
        return self.num_samples

    @property
    def token_dtype(self) -> np.dtype:
        """A dtype that holds every part's tokens."""
        return np.result_type(*[d.token_dtype for d in self.datasets if d is not None])

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample i of the blend: (seq_length + 1,) int64 token ids."""
        if not 0 <= i < self.num_samples:
            raise IndexError(
                f"blend [{self.name}]: sample {i} out of range [0, {self.num_samples})"
            )
        d = int(self.dataset_index[i])
        return self.datasets[d][int(self.dataset_sample_index[i])]

    def read_into(self, i: int, out: np.ndarray, **extra) -> None:
        """Write sample i of the blend into `out` ((seq_length + 1,) buffer); `extra` (an SFT
        part's `mask_out`, `docs_out`) goes to the part's `read_into`."""
        if not 0 <= i < self.num_samples:
            raise IndexError(
                f"blend [{self.name}]: sample {i} out of range [0, {self.num_samples})"
            )
        d = int(self.dataset_index[i])
        self.datasets[d].read_into(int(self.dataset_sample_index[i]), out, **extra)
