"""Blending: the ±1-sample share property, tiny weights, speed, bad weights, index caching."""

import time

import numpy as np
import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.blend import BlendedDataset, blending_indices
from meshtrain.services.dataloader.indexed import IndexedDataset, IndexedDatasetWriter
from meshtrain.services.dataloader.samples import GPTDataset
from meshtrain.services.dataloader.spec import DatasetSpec, open_dataset, parse_data_path


def _max_share_error(weights, ds_index):
    w = np.asarray(weights, float) / np.sum(weights)
    n = np.arange(1, ds_index.size + 1)
    return max(np.abs(np.cumsum(ds_index == d) - w[d] * n).max() for d in range(w.size))


@pytest.mark.parametrize("trial", range(12))
def test_every_prefix_within_one_sample(trial):
    """Random weights over 2-10 datasets, some as small as 1e-4 of the total."""
    rng = np.random.default_rng(trial)
    k = int(rng.integers(2, 11))
    w = rng.random(k) ** 3
    if trial % 2:
        w[int(rng.integers(k))] = 1e-4 * w.sum()
    ds_index, ds_sample = blending_indices(w, 30_000)
    assert _max_share_error(w, ds_index) < 1.0
    for d in range(k):  # each dataset's samples are taken in order 0, 1, 2, ...
        taken = ds_sample[ds_index == d]
        assert np.array_equal(taken, np.arange(taken.size))


def test_plain_greedy_counterexample_stays_within_one():
    """Many small weights: where a plain furthest-behind greedy can drift past one sample."""
    w = [0.5, 0.2, 0.1, 0.1, 0.05, 0.03, 0.01, 0.005, 0.004, 0.001]
    ds_index, _ = blending_indices(w, 200_000)
    assert _max_share_error(w, ds_index) < 1.0


def test_tiny_weight_gets_its_share():
    ds_index, _ = blending_indices([1.0, 1e-4], 100_000)
    assert np.sum(ds_index == 1) in (9, 10, 11)


def test_ten_million_over_ten_datasets_is_fast():
    t = time.perf_counter()
    ds_index, _ = blending_indices(np.arange(1, 11), 10_000_000)
    assert time.perf_counter() - t < 10.0
    assert ds_index.size == 10_000_000


@pytest.mark.parametrize("weights", [[-1.0, 2.0], [0.0, 0.0], [float("nan"), 1.0], []])
def test_bad_weights(weights):
    with pytest.raises(DataError, match="weights"):
        blending_indices(weights, 10)


def test_parse_data_path(tmp_path):
    assert parse_data_path(["a"]) == (["a"], [1.0])
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(DataError, match="twice"):
        parse_data_path(["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "x" / ".." / "a")])
    with pytest.raises(DataError, match="WEIGHT PREFIX"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(DataError, match="all zero"):
        parse_data_path(["0", "a", "0", "b"])


def _write(path, seed, n_docs=40):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(path, np.uint16) as w:
        for n in rng.integers(1, 60, size=n_docs):
            w.add_document(rng.integers(0, 60000, size=n))
    return str(path)


def test_blended_samples_come_from_their_datasets(tmp_path):
    a, b = _write(tmp_path / "a", 1), _write(tmp_path / "b", 2)
    spec = DatasetSpec((a, b), (0.25, 0.75), seq_length=16, num_samples=200, seed=3, split="1")
    blend = open_dataset(spec, cache=False)
    assert isinstance(blend, BlendedDataset)
    parts = [
        GPTDataset(IndexedDataset(p), np.arange(40), 16, len(blend.datasets[i]), 3)
        for i, p in enumerate((a, b))
    ]
    for i in range(len(blend)):
        d, j = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        assert np.array_equal(blend[i], parts[d][j])


def test_indices_cached_by_hash_of_inputs(tmp_path):
    """A second open loads the cached arrays; any changed input gets a new entry."""
    a, b = _write(tmp_path / "a", 1), _write(tmp_path / "b", 2)
    spec = DatasetSpec((a, b), (1.0, 2.0), seq_length=8, num_samples=300, seed=3)
    first = open_dataset(spec)
    cache = tmp_path / ".meshtrain-index"
    entries = sorted(p.name for p in cache.glob("*.json"))
    assert len(entries) == 3  # two GPTDatasets and the blend
    again = open_dataset(spec)
    assert isinstance(again.dataset_index, np.memmap)  # loaded, not rebuilt
    assert all(np.array_equal(first[i], again[i]) for i in range(0, 300, 7))
    open_dataset(DatasetSpec((a, b), (1.0, 2.0), seq_length=8, num_samples=300, seed=4))
    assert len(list(cache.glob("*.json"))) == 5  # new seed: new GPTDataset entries, same blend


def test_seq_length_longer_than_data(tmp_path):
    a = _write(tmp_path / "a", 1, n_docs=3)
    with pytest.raises(DataError, match="longer than"):
        open_dataset(
            DatasetSpec((a,), (1.0,), seq_length=100_000, num_samples=4, seed=1, split="1")
        )


def test_unknown_dataset_path(tmp_path):
    with pytest.raises(DataError, match="missing"):
        open_dataset(DatasetSpec((str(tmp_path / "nope"),), (1.0,), 8, 4, 1))
