"""Corruption is caught on read: flipped bytes, missing objects, bad manifests.

Each test damages one stored object through the filesystem, the way bit rot or a torn
upload would, and checks that reading fails with an error naming the array and object.
"""

import json

import pytest
import torch

from meshtrain.services.checkpoint.maintenance import verify_checkpoint
from meshtrain.services.checkpoint.multiwriter import MANIFEST_DIGEST, manifest_digest
from meshtrain.services.checkpoint.reader import (
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    read_tensor,
    unreadable_manifests,
)
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.errors import CheckpointError

from .conftest import toy_model_state

QKV = "layers.attention.qkv.weight"


def _save(root_fs):
    url, fs, path = root_fs
    save_checkpoint(url, 9, toy_model_state(), {"iteration": 9})
    return url, fs, f"{path}/step_00000009"


def _flip(fs, path, offset):
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0x01
    fs.pipe_file(path, bytes(data))


@pytest.mark.parametrize("offset", [0, 40, -1])  # data, inside, and the shard index at the end
def test_flipped_byte_in_a_shard_is_caught(root_fs, offset):
    url, fs, step = _save(root_fs)
    _flip(fs, f"{step}/{QKV}/c/2/0/0", offset)
    pattern = rf"array '{QKV}' object 'c/2/0/0' .*corrupt"
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(url, 9)
    with pytest.raises(CheckpointError, match=pattern):
        read_tensor(url, 9, "layers.2.attention.qkv.weight")
    # reading other layers touches only their shards, so they still load
    ok = read_tensor(url, 9, "layers.1.attention.qkv.weight")
    assert torch.equal(
        ok.view(torch.int16), toy_model_state()["layers.1.attention.qkv.weight"].view(torch.int16)
    )


def test_flipped_byte_in_array_metadata_is_caught(root_fs):
    url, fs, step = _save(root_fs)
    _flip(fs, f"{step}/final_norm.weight/zarr.json", 10)
    with pytest.raises(
        CheckpointError, match="array 'final_norm.weight' object 'zarr.json' .*corrupt"
    ):
        load_checkpoint(url, 9, names=["final_norm.weight"])


def test_deleted_object_is_named(root_fs):
    url, fs, step = _save(root_fs)
    fs.rm(f"{step}/{QKV}/c/3/0/0")
    with pytest.raises(CheckpointError, match=rf"array '{QKV}' object 'c/3/0/0' .*is missing"):
        load_checkpoint(url, 9)


def test_deleted_array_is_named(root_fs):
    url, fs, step = _save(root_fs)
    fs.rm(f"{step}/optim.step", recursive=True)
    with pytest.raises(CheckpointError, match="array 'optim.step' object 'zarr.json' .*is missing"):
        load_checkpoint(url, 9)


def _rewrite(fs, step, manifest, digest=True):
    """Stores an edited manifest; with `digest`, one whose digest was recomputed to match (a
    consistent manifest from a faulty writer), which only the checks against the arrays catch."""
    if digest:
        manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    fs.pipe_file(f"{step}/manifest.json", json.dumps(manifest).encode())


def test_manifest_that_disagrees_with_zarr_metadata_is_caught(root_fs):
    # A manifest edited (or from another writer) to claim a different shape must not load
    # data under the wrong shape silently.
    url, fs, step = _save(root_fs)
    manifest = read_manifest(url, 9)
    manifest["arrays"]["final_norm.weight"]["shape"] = [9]
    _rewrite(fs, step, manifest)
    with pytest.raises(CheckpointError, match="'final_norm.weight' .*shape"):
        load_checkpoint(url, 9, names=["final_norm.weight"])


def test_manifest_whose_logical_dtype_disagrees_with_the_array_is_caught(root_fs):
    # Same stored bits, another meaning: bfloat16 read as float16 would load garbage quietly.
    url, fs, step = _save(root_fs)
    manifest = read_manifest(url, 9)
    entry = manifest["arrays"]["final_norm.weight"]
    assert entry["dtype"] == "float32"
    entry["dtype"] = "int32"
    _rewrite(fs, step, manifest)
    with pytest.raises(CheckpointError, match="'final_norm.weight' .*float32 values.*int32"):
        load_checkpoint(url, 9, names=["final_norm.weight"])


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda m: m["metadata"].update(iteration=3), id="iteration"),
        pytest.param(lambda m: m["metadata"].update(consumed_samples=0), id="consumed_samples"),
        pytest.param(lambda m: m["arrays"]["final_norm.weight"].update(dtype="int32"), id="dtype"),
        pytest.param(lambda m: m.pop(MANIFEST_DIGEST), id="digest removed"),
    ],
)
def test_an_edited_manifest_is_refused_by_every_reader(root_fs, edit):
    """The fields a resume trusts (iteration, consumed_samples, dtypes) are covered by the
    manifest's own sha256: an edit is refused by read_manifest, load_checkpoint and verify,
    and a load of the latest step names it instead of falling back to an older step."""
    url, fs, step = _save(root_fs)
    save_checkpoint(url, 4, toy_model_state(), {"iteration": 4, "consumed_samples": 8})
    manifest = read_manifest(url, 9)
    manifest["metadata"]["consumed_samples"] = 18
    _rewrite(fs, step, manifest)  # a valid step 9 with consumed_samples set, digest matching
    manifest = read_manifest(url, 9)
    edit(manifest)
    _rewrite(fs, step, manifest, digest=False)
    refused = "step 9 under .*manifest.json does not match its manifest_sha256"
    with pytest.raises(CheckpointError, match=refused):
        read_manifest(url, 9)
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint(url, 9)
    with pytest.raises(CheckpointError, match=refused + r".*\(pass step=4"):
        load_checkpoint(url)  # never step 4 in silence
    with pytest.raises(CheckpointError, match=refused):
        verify_checkpoint(url, 9)
    assert list(unreadable_manifests(url)) == [9]
    assert list_checkpoints(url) == [4]  # what no reader takes is not listed ...
    assert load_checkpoint(url, 4)[1]["iteration"] == 4  # ... and an explicit older step loads


def test_manifests_of_earlier_formats_load_without_a_digest(root_fs):
    url, fs, step = _save(root_fs)
    manifest = read_manifest(url, 9)
    manifest["format_version"] = 2
    manifest.pop(MANIFEST_DIGEST)
    _rewrite(fs, step, manifest, digest=False)
    tensors, meta = load_checkpoint(url)
    assert meta["iteration"] == 9 and set(tensors) == set(toy_model_state())


def test_manifest_of_wrong_format_version_is_rejected(root_fs):
    url, fs, step = _save(root_fs)
    manifest = read_manifest(url, 9)
    manifest["format_version"] = 99
    fs.pipe_file(f"{step}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="format_version 99"):
        read_manifest(url, 9)
