"""Which samples a job trains on, as one value: `DatasetSpec`, and `open_dataset` to build them.

A spec names the dataset prefixes and their blending weights, the train/valid/test split, which
split, `seq_length`, `num_samples`, the seed, the recipe of the sample order (`sample_order`:
meshtrain's, or Megatron's GPTDataset bit for bit) and the `format`: pretraining samples, or
SFT conversations packed whole with their loss masks (`packing.py`). It is all a data worker
needs to reproduce a stream bit for bit, so the trainer sends it over the wire and the
in-process path uses it too.
`parse_data_path` reads Megatron's `--data-path` convention: either one or more prefixes (equal
weights), or alternating `WEIGHT PREFIX` pairs.

    spec = DatasetSpec.from_data_path(["0.7", "a/ds", "0.3", "b/ds"], seq_length=1024,
                                      num_samples=10_000, seed=1234)
    ds = open_dataset(spec)   # GPTDataset (one prefix) or BlendedDataset
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.blend import (
    BlendedDataset,
    blend_index_desc,
    normalize_weights,
    samples_needed,
)
from meshtrain.services.dataloader.index_cache import IndexCache, is_cached
from meshtrain.services.dataloader.indexed import IndexedDataset, is_remote, local_path
from meshtrain.services.dataloader.packing import SFTDataset
from meshtrain.services.dataloader.samples import (
    GPTDataset,
    check_sample_order,
    epochs_needed,
    gpt_index_desc,
    index_build_bytes,
    megatron_total_samples,
    split_ranges,
)
from meshtrain.services.dataloader.sft_data import open_sft_parts

SPLITS = ("train", "valid", "test")
FORMATS = ("gpt", "sft")
INDEX_CACHE_DIR = ".meshtrain-index"


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float]]:
    """Split Megatron-style `data_path` entries into prefixes and weights.

    Args:
        data_path: `[PREFIX, ...]` (equal weights) or `[W1, PREFIX1, W2, PREFIX2, ...]`.

    Returns:
        (prefixes, weights); weights are validated but not normalized.
    """
    items = [str(x) for x in data_path]
    if not items:
        raise DataError("data_path is empty: give at least one dataset prefix")

    def number(x: str) -> float | None:
        try:
            return float(x)
        except ValueError:
            return None

    if number(items[0]) is None:
        prefixes, weights = items, [1.0] * len(items)
    else:
        if len(items) % 2:
            raise DataError(
                f"data_path {items} mixes weights and prefixes: give WEIGHT PREFIX pairs"
            )
        weights, prefixes = [], []
        for w, p in zip(items[::2], items[1::2]):
            if number(w) is None or number(p) is not None:
                raise DataError(f"data_path pair ({w!r}, {p!r}) is not WEIGHT PREFIX")
            weights.append(float(w))
            prefixes.append(p)
    _refuse_repeated_prefixes(prefixes, "data_path")
    normalize_weights(weights, prefixes)
    return prefixes, weights


def _refuse_repeated_prefixes(prefixes: list[str] | tuple[str, ...], source: str) -> None:
    seen: dict[str, str] = {}
    for p in prefixes:
        key = p.rstrip("/") if is_remote(p) else os.path.realpath(local_path(p))
        if key in seen:
            # listing one dataset twice silently doubles its share; say so instead
            raise DataError(
                f"{source} lists dataset {p!r} twice (also as {seen[key]!r}); merge the weights"
            )
        seen[key] = p


# 6.9e10 samples (1.4e14 tokens at seq 2048) is past any real run; a larger request is a typo
# that would have a worker try to allocate its sample index.
MAX_SAMPLES = 2**36


@dataclass(frozen=True)
class DatasetSpec:
    """Everything that determines a sample stream (not the batching)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...]
    seq_length: int
    num_samples: int
    seed: int
    split: str = "969,30,1"
    split_name: str = "train"
    sample_order: str = "meshtrain"
    """"meshtrain" or "megatron" (megatron-core GPTDataset's indices, bit for bit; see
    `samples.GPTDataset`)."""
    format: str = "gpt"
    """"gpt": pretraining samples that cross documents (`samples.GPTDataset`); "sft": whole
    conversations packed with their loss masks (`packing.SFTDataset`; SFT datasets only)."""

    @classmethod
    def from_data_path(cls, data_path: list[str], **kw) -> "DatasetSpec":
        """Build a spec from Megatron-style `data_path` entries (see `parse_data_path`)."""
        prefixes, weights = parse_data_path(data_path)
        return cls(tuple(prefixes), tuple(weights), **kw)

    def validate(self) -> None:
        """Check the fields that need no file opened; raises DataError naming the field."""
        if len(self.prefixes) != len(self.weights) or not self.prefixes:
            raise DataError(
                f"spec has {len(self.prefixes)} prefixes and {len(self.weights)} weights"
            )
        _refuse_repeated_prefixes(self.prefixes, "spec")
        normalize_weights(self.weights, list(self.prefixes))
        if self.seq_length < 1:
            raise DataError(f"seq_length={self.seq_length} must be >= 1")
        if not 1 <= self.num_samples <= MAX_SAMPLES:
            raise DataError(f"num_samples={self.num_samples} must be in [1, 2^36]")
        if not 0 <= self.seed < 2**32:
            raise DataError(f"seed={self.seed} must be in [0, 2^32) (it seeds numpy's shuffles)")
        if self.split_name not in SPLITS:
            raise DataError(f"split_name {self.split_name!r} is not one of {SPLITS}")
        split_ranges(1_000_000, self.split)  # validates the split string's syntax
        check_sample_order(self.sample_order)
        if self.format not in FORMATS:
            raise DataError(f"format={self.format!r} is not one of {FORMATS}")
        if self.format == "sft" and self.sample_order != "meshtrain":
            raise DataError(
                f"sample_order={self.sample_order!r} is a pretraining order; SFT packing has its "
                "own (give sample_order 'meshtrain' with format 'sft')"
            )


def index_cache_dir(prefix: str) -> str:
    """Where indices over `prefix` are cached: a folder beside the dataset files.

    For datasets on object storage the cache is local (`$MESHTRAIN_INDEX_CACHE`, default
    `~/.cache/meshtrain/index`): entries are keyed by content hash, so sharing one folder
    between datasets is safe, and writing next to the data would cost requests on every open.
    """
    if is_remote(prefix):
        return os.environ.get("MESHTRAIN_INDEX_CACHE") or os.path.expanduser(
            "~/.cache/meshtrain/index"
        )
    return str(Path(local_path(prefix)).parent / INDEX_CACHE_DIR)


class MemoryBudget:
    """Bytes that index builds in progress may hold together; `hold(n)` waits until n fit.

    A data worker builds the indices of several specs at once (one per distinct request);
    each is bounded on its own, and this bounds their sum, so concurrent large requests queue
    instead of together taking the worker's memory.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.used = 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int):
        nbytes = min(int(nbytes), self.limit)  # a build larger than the whole budget runs alone
        with self._cond:
            self._cond.wait_for(lambda: self.used + nbytes <= self.limit)
            self.used += nbytes
        try:
            yield
        finally:
            with self._cond:
                self.used -= nbytes
                self._cond.notify_all()


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def open_dataset(
    spec: DatasetSpec,
    cache: bool = True,
    max_index_bytes: int | None = None,
    budget: MemoryBudget | None = None,
    index_cache: IndexCache | None = None,
) -> GPTDataset | SFTDataset | BlendedDataset:
    """Open the datasets a spec names and build (or load cached) sample indices.

    Args:
        spec: the stream to build.
        cache: cache indices: in `index_cache` if given, else beside each dataset
            (`index_cache_dir`).
        max_index_bytes: refuse (DataError naming the numbers) a spec whose indices would take
            more memory than this to build (`index_build_bytes`; indices found in the cache are
            loaded, not built, and count for nothing), checked once the datasets' headers are
            read and before any index array is allocated; None: no limit.
        budget: held for the estimated bytes while the indices are built.
        index_cache: the one folder (with a quota) where every index is cached, instead of
            beside the datasets (a data worker's: clients choose what it builds).

    Returns:
        A GPTDataset for one prefix (an SFTDataset with format "sft"), else a BlendedDataset of
        one per prefix. With
        `sample_order` "megatron" each GPTDataset is Megatron's for the samples asked of it (the
        split counts sequences, Megatron's unit); a blend still interleaves them in meshtrain's
        order.
    """
    spec.validate()
    if spec.format == "sft":
        return _open_sft(spec, cache, max_index_bytes, budget, index_cache)

    def cache_for(prefix: str) -> IndexCache | str | None:
        if not cache:
            return None
        return index_cache if index_cache is not None else index_cache_dir(prefix)

    split = SPLITS.index(spec.split_name)
    megatron = spec.sample_order == "megatron"
    weights = normalize_weights(spec.weights)
    if len(spec.prefixes) == 1:
        needs = [spec.num_samples]
    else:
        needs = samples_needed(weights, spec.num_samples)
    # first every dataset's header and split size (memory maps), so that the whole spec's index
    # memory is known before any of it is built
    opened: list[tuple[IndexedDataset, int, int] | None] = []
    # Indices already in the cache are memory-mapped, not built: they take no build memory.
    need_bytes = 0
    if len(spec.prefixes) > 1 and not is_cached(
        cache_for(spec.prefixes[0]), blend_index_desc(normalize_weights(weights), spec.num_samples)
    ):
        need_bytes = 10 * spec.num_samples  # the blend's index: int16 + int64 a sample
    sizes = []
    for prefix, need in zip(spec.prefixes, needs):
        if need == 0:
            opened.append(None)  # weight 0: never drawn, so never opened
            continue
        indexed = IndexedDataset(prefix)
        units = len(indexed) if megatron else indexed.num_documents  # Megatron splits sequences
        begin, end = split_ranges(units, spec.split)[split]
        if end <= begin:
            # The default 969,30,1 gives a small dataset's valid/test splits no whole document:
            # name a split that does, rather than leave the user to work out the arithmetic.
            fix = {"valid": "90,10,0", "test": "90,5,5"}.get(spec.split_name, "100,0,0")
            raise DataError(
                f"{prefix}: split {spec.split!r} leaves the {spec.split_name} split of its "
                f"{units} {'sequences' if megatron else 'documents'} empty; pass e.g. --split {fix}"
            )
        opened.append((indexed, begin, end))
        di = np.arange(units + 1) if megatron else indexed.document_indices
        tokens = int(indexed.sequence_lengths[di[begin] : di[end]].sum(dtype=np.int64))
        desc = gpt_index_desc(
            indexed,
            np.arange(begin, end, dtype=np.int64),
            spec.seq_length,
            need,
            spec.seed,
            spec.sample_order,
        )
        if tokens > spec.seq_length and not is_cached(cache_for(prefix), desc):
            # (a split too short for one sample: GPTDataset says so)
            epochs = epochs_needed(tokens, spec.seq_length, need)
            # Megatron's sample index covers every whole sample of the epochs, not only `need`
            indexed_samples = (
                megatron_total_samples(tokens, spec.seq_length, epochs) + 1 if megatron else need
            )
            need_bytes += index_build_bytes(epochs, end - begin, indexed_samples)
            sizes.append(
                f"{prefix}: {need} samples = {epochs} epochs of {end - begin} documents "
                f"({tokens} tokens)"
            )
    if max_index_bytes is not None and need_bytes > max_index_bytes:
        raise DataError(
            f"num_samples={spec.num_samples} at seq_length={spec.seq_length} needs a sample index "
            f"of {_gib(need_bytes)} ({need_bytes} bytes) to build, over this data worker's limit "
            f"of {_gib(max_index_bytes)} ({max_index_bytes} bytes; `data serve --max-index-gib`): "
            + "; ".join(sizes)
            + ". Ask for fewer samples (or a longer seq_length)"
        )
    with budget.hold(need_bytes) if budget is not None else nullcontext():
        parts: list[GPTDataset | None] = []
        for prefix, need, part in zip(spec.prefixes, needs, opened):
            if part is None:
                parts.append(None)
                continue
            indexed, begin, end = part
            parts.append(
                GPTDataset(
                    indexed,
                    np.arange(begin, end, dtype=np.int64),
                    spec.seq_length,
                    need,
                    spec.seed,
                    name=spec.split_name,
                    cache_dir=cache_for(prefix),
                    sample_order=spec.sample_order,
                )
            )
        if len(parts) == 1:
            assert parts[0] is not None  # a lone dataset's weight is positive: it is opened
            return parts[0]
        return BlendedDataset(
            parts,
            weights,
            spec.num_samples,
            name=spec.split_name,
            cache_dir=cache_for(spec.prefixes[0]),
        )


def _open_sft(
    spec: DatasetSpec,
    cache: bool,
    max_index_bytes: int | None,
    budget: MemoryBudget | None,
    index_cache: IndexCache | None,
) -> SFTDataset | BlendedDataset:
    """`open_dataset` for format "sft": an SFTDataset per prefix, blended when several."""

    def cache_for(prefix: str) -> IndexCache | str | None:
        if not cache:
            return None
        return index_cache if index_cache is not None else index_cache_dir(prefix)

    split = SPLITS.index(spec.split_name)
    weights = normalize_weights(spec.weights)
    needs = (
        [spec.num_samples] if len(spec.prefixes) == 1 else samples_needed(weights, spec.num_samples)
    )
    opened: list[tuple[IndexedDataset, IndexedDataset, dict, int, int] | None] = []
    need_bytes = 0
    for prefix, need in zip(spec.prefixes, needs):
        if need == 0:
            opened.append(None)
            continue
        tokens, mask, meta = open_sft_parts(prefix)
        begin, end = split_ranges(tokens.num_documents, spec.split)[split]
        if end <= begin:
            raise DataError(
                f"{prefix}: split {spec.split!r} leaves the {spec.split_name} split of its "
                f"{tokens.num_documents} conversations empty"
            )
        opened.append((tokens, mask, meta, begin, end))
        # a conversation id (8 bytes) per epoch slot, the pointers and the shuffle per sample
        tokens_in = int(tokens.sequence_lengths[begin:end].sum(dtype=np.int64))
        epochs = 1 + need * (spec.seq_length + 1) // max(tokens_in, 1)
        need_bytes += 24 * epochs * (end - begin) + 24 * need
    if max_index_bytes is not None and need_bytes > max_index_bytes:
        raise DataError(
            f"num_samples={spec.num_samples} of packed SFT sequences needs about "
            f"{_gib(need_bytes)} of index to build, over the limit of {_gib(max_index_bytes)}"
        )
    with budget.hold(need_bytes) if budget is not None else nullcontext():
        parts: list[SFTDataset | None] = []
        for prefix, need, part in zip(spec.prefixes, needs, opened):
            if part is None:
                parts.append(None)
                continue
            tokens, mask, meta, begin, end = part
            parts.append(
                SFTDataset(
                    tokens,
                    mask,
                    np.arange(begin, end, dtype=np.int64),
                    spec.seq_length,
                    need,
                    spec.seed,
                    pad_id=int(meta["eod_id"]),
                    name=spec.split_name,
                    cache_dir=cache_for(prefix),
                )
            )
        if len(parts) == 1:
            assert parts[0] is not None
            return parts[0]
        return BlendedDataset(
            parts,
            weights,
            spec.num_samples,
            name=spec.split_name,
            cache_dir=cache_for(spec.prefixes[0]),
        )
