"""A checkpoint carries its tokenizer's files: stored as arrays, unpacked by digest, checked."""

import json

import pytest

from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.checkpoint.tokenizer_store import (
    METADATA_KEY,
    carried_spec,
    tokenizer_boxes,
    tokenizer_spec,
)
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer, train_bpe


@pytest.fixture
def hf_tokenizer(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    return train_bpe(
        [str(text)], vocab_size=300, output_path=str(tmp_path / "tok" / "tokenizer.json")
    )


def _save_with(root, spec, extra_meta=None):
    boxes, record = tokenizer_boxes(spec)
    tensors = {box.array: tensor for box, tensor in boxes}
    save_checkpoint(
        root, 1, tensors, {"tokenizer": spec, METADATA_KEY: record, **(extra_meta or {})}
    )
    return record


def test_the_carried_files_outlive_the_originals(tmp_path, hf_tokenizer, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    root = str(tmp_path / "ckpt")
    spec = hf_tokenizer.spec
    original = build_tokenizer(spec).encode("the lazy fox")
    record = _save_with(root, spec)
    assert [f["name"] for f in record["files"]] == ["tokenizer.json"]
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps({"edited": "after the run"}))
    meta = read_manifest(root, 1)["metadata"]
    carried = tokenizer_spec(root, 1, meta)
    assert carried != spec and carried.startswith(str(tmp_path / "cache"))
    assert build_tokenizer(carried).encode("the lazy fox") == original
    assert carried_spec(root, 1, meta) == carried  # unpacked once: the same folder again


def test_byte_and_old_checkpoints_fall_back_to_the_recorded_spec(tmp_path):
    root = str(tmp_path / "ckpt")
    assert tokenizer_boxes("byte") == ([], None)
    save_checkpoint(
        root, 1, {"w": __import__("torch").zeros(2)}, {"tokenizer": "/old/place/tokenizer.json"}
    )
    assert (
        tokenizer_spec(root, 1, read_manifest(root, 1)["metadata"]) == "/old/place/tokenizer.json"
    )


def test_a_carried_file_that_does_not_match_its_record_is_refused(
    tmp_path, hf_tokenizer, monkeypatch
):
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    root = str(tmp_path / "ckpt")
    _save_with(root, hf_tokenizer.spec)
    meta = read_manifest(root, 1)["metadata"]
    meta[METADATA_KEY]["files"][0]["sha256"] = "0" * 64
    with pytest.raises(
        CheckpointError, match="carried tokenizer file 'tokenizer.json' does not match"
    ):
        carried_spec(root, 1, meta, folder=tmp_path / "unpack")


def test_a_tokenizer_that_is_gone_at_save_time_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="cannot carry the run's tokenizer.*gone.json"):
        tokenizer_boxes(str(tmp_path / "gone.json"))
