"""Corruption is caught on read: flipped bytes, missing objects, bad manifests.

Each test damages one stored object through the filesystem, the way bit rot or a torn
upload would, and checks that reading fails with an error naming the array and object.
"""

import json

import pytest
import torch

from meshtrain.services.checkpoint.reader import load_checkpoint, read_manifest, read_tensor
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


def test_manifest_that_disagrees_with_zarr_metadata_is_caught(root_fs):
    # A manifest edited (or from another writer) to claim a different shape must not load
    # data under the wrong shape silently.
    url, fs, step = _save(root_fs)
    manifest = read_manifest(url, 9)
    manifest["arrays"]["final_norm.weight"]["shape"] = [9]
    fs.pipe_file(f"{step}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="'final_norm.weight' .*shape"):
        load_checkpoint(url, 9, names=["final_norm.weight"])


def test_manifest_of_wrong_format_version_is_rejected(root_fs):
    url, fs, step = _save(root_fs)
    manifest = read_manifest(url, 9)
    manifest["format_version"] = 99
    fs.pipe_file(f"{step}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="format_version 99"):
        read_manifest(url, 9)
