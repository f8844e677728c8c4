"""Save -> load round trips on local paths, file:// and memory://, plus commit semantics."""

import fsspec
import pytest
import torch
import zarr

from meshtrain.services.checkpoint.reader import (
    latest_step,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    read_tensor,
)
from meshtrain.services.checkpoint.store import open_root, zarr_store
from meshtrain.services.checkpoint.writer import SaveResult, save_checkpoint
from meshtrain.services.common.errors import CheckpointError

from .conftest import NUM_LAYERS, assert_same, toy_model_state

METADATA = {"iteration": 12, "consumed_samples": 384, "config": {"model": {"num_layers": 4}}}


def test_round_trip_is_exact(root):
    state = toy_model_state()
    result = save_checkpoint(root, 12, state, METADATA)
    assert isinstance(result, SaveResult)
    assert result.url == root.rstrip("/") + "/step_00000012"
    assert result.bytes_written > sum(t.numel() * t.element_size() for t in state.values())
    assert result.seconds > 0

    loaded, metadata = load_checkpoint(root, 12)
    assert_same(loaded, state)
    assert metadata == METADATA
    assert all(t.device.type == "cpu" for t in loaded.values())


def test_per_layer_tensors_are_stacked(root):
    state = toy_model_state()
    result = save_checkpoint(root, 1, state, {})
    arrays = read_manifest(root, 1)["arrays"]
    per_layer = {n for n in state if "layers." in n}
    unstacked = set(state) - per_layer
    # every per-layer family of 4 tensors is ONE array with a leading layer axis
    assert len(arrays) == len(unstacked) + len(per_layer) // NUM_LAYERS == result.num_arrays
    qkv = arrays["layers.attention.qkv.weight"]
    assert qkv["shape"] == [NUM_LAYERS, 24, 8] and qkv["layer_count"] == NUM_LAYERS
    assert qkv["dtype"] == "bfloat16" and qkv["stored_dtype"] == "uint16"
    assert qkv["tensors"] == [f"layers.{i}.attention.qkv.weight" for i in range(NUM_LAYERS)]
    # one shard object per layer plus the array's zarr.json
    assert sorted(qkv["objects"]) == [f"c/{i}/0/0" for i in range(NUM_LAYERS)] + ["zarr.json"]
    assert "optim.exp_avg.layers.attention.qkv.weight" in arrays
    assert arrays["layers.scale"]["shape"] == [NUM_LAYERS]  # per-layer scalars stack too
    # the stored zarr attributes carry the logical dtype as well
    r = open_root(root)
    z = zarr.open_array(
        zarr_store(r, r.step_path(1), read_only=True), path="layers.attention.qkv.weight"
    )
    assert z.attrs["logical_dtype"] == "bfloat16"


def test_load_subset_and_read_tensor_slice(root):
    state = toy_model_state()
    save_checkpoint(root, 3, state, {})
    names = ["layers.2.attention.qkv.weight", "optim.step", "layers.0.scale"]
    subset, _ = load_checkpoint(root, 3, names=names)
    assert list(subset) == names
    assert_same(subset, {n: state[n] for n in names})

    w = state["layers.1.attention.qkv.weight"]
    got = read_tensor(root, 3, "layers.1.attention.qkv.weight", (slice(4, 20, 3), 5))
    assert torch.equal(got.view(torch.int16), w[4:20:3, 5].view(torch.int16))
    got = read_tensor(root, 3, "embedding.word_embeddings.weight", (..., slice(-3, None)))
    assert torch.equal(
        got.view(torch.int16), state["embedding.word_embeddings.weight"][:, -3:].view(torch.int16)
    )
    assert read_tensor(root, 3, "optim.step").item() == 12
    assert torch.equal(read_tensor(root, 3, "final_norm.weight"), state["final_norm.weight"])
    with pytest.raises(CheckpointError, match="out of range"):
        read_tensor(root, 3, "final_norm.weight", 8)
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        read_tensor(root, 3, "nope")
    with pytest.raises(CheckpointError, match=r"\['nope'\]"):
        load_checkpoint(root, 3, names=["nope", "optim.step"])


def test_odd_shapes_round_trip(root):
    state = {
        "empty": torch.zeros(0, 3),
        "layers.0.empty": torch.zeros(2, 0, dtype=torch.bfloat16),
        "layers.1.empty": torch.zeros(2, 0, dtype=torch.bfloat16),
        "zeros": torch.zeros(4, dtype=torch.int32),  # all fill value: still stored
        "scalar_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
    }
    save_checkpoint(root, 0, state, {})
    loaded, _ = load_checkpoint(root, 0)
    assert_same(loaded, state)
    assert read_manifest(root, 0)["arrays"]["zeros"]["objects"].keys() == {"c/0", "zarr.json"}


def test_list_and_latest_ignore_uncommitted_folders(root):
    assert list_checkpoints(root) == [] and latest_step(root) is None
    with pytest.raises(CheckpointError, match="no committed checkpoint under"):
        load_checkpoint(root)
    state = {"w": torch.arange(4.0)}
    for step in (10, 2, 30):
        save_checkpoint(root, step, {"w": state["w"] + step}, {"iteration": step})
    r = open_root(root)
    # step 40: arrays written, crash before the manifest
    save_checkpoint(root, 40, state, {})
    r.fs.rm(r.step_path(40) + "/manifest.json")
    # step 50: a torn (truncated) manifest
    save_checkpoint(root, 50, state, {})
    path = r.step_path(50) + "/manifest.json"
    r.fs.pipe_file(path, r.fs.cat_file(path)[:100])
    r.fs.mkdir(r.path + "/not_a_step")

    assert list_checkpoints(root) == [2, 10, 30]
    assert latest_step(root) == 30
    # the newest folder holds a manifest no reader takes: damage, named rather than passed over
    with pytest.raises(CheckpointError, match=r"step 50 .*incomplete or not JSON.*step=30"):
        load_checkpoint(root)
    loaded, metadata = load_checkpoint(root, 30)
    assert metadata == {"iteration": 30} and torch.equal(loaded["w"], state["w"] + 30)
    with pytest.raises(CheckpointError, match="step 40 .*not a committed checkpoint"):
        read_manifest(root, 40)
    with pytest.raises(CheckpointError, match="step 50 .*incomplete or not JSON"):
        load_checkpoint(root, 50)


def test_overwrite_refused_unless_asked(root):
    save_checkpoint(root, 5, {"w": torch.ones(3)}, {"v": 1})
    with pytest.raises(CheckpointError, match="step 5 already exists"):
        save_checkpoint(root, 5, {"w": torch.zeros(3)}, {"v": 2})
    assert load_checkpoint(root, 5)[1] == {"v": 1}  # untouched by the refusal
    save_checkpoint(root, 5, {"other": torch.zeros(2)}, {"v": 3}, overwrite=True)
    loaded, metadata = load_checkpoint(root, 5)
    assert metadata == {"v": 3} and list(loaded) == ["other"]  # old arrays are gone


def test_leftovers_of_uncommitted_attempt_are_cleared(root):
    save_checkpoint(root, 7, {"stale": torch.ones(3), "w": torch.ones(2)}, {})
    r = open_root(root)
    r.fs.rm(r.step_path(7) + "/manifest.json")  # the attempt "crashed" before committing
    save_checkpoint(root, 7, {"w": torch.full((2,), 2.0)}, {})  # no overwrite needed
    manifest = read_manifest(root, 7)
    assert list(manifest["arrays"]) == ["w"]
    assert not r.fs.exists(r.step_path(7) + "/stale")


def test_bad_inputs_fail_before_writing(root):
    with pytest.raises(CheckpointError, match="not JSON"):
        save_checkpoint(root, 1, {"w": torch.ones(1)}, {"bad": object()})
    with pytest.raises(CheckpointError, match="float64"):
        save_checkpoint(root, 1, {"w": torch.ones(1, dtype=torch.float64)}, {})
    with pytest.raises(CheckpointError, match="'w' is a list"):
        save_checkpoint(root, 1, {"w": [1.0]}, {})
    assert not fsspec.core.url_to_fs(root)[0].exists(open_root(root).step_path(1))
