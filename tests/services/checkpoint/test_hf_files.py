"""Hugging Face folders on disk: exports in safetensors shards with their index, and imports from
the Hugging Face hub cache (a repo id resolved offline, a branch, a commit).

The sharded export is loaded by transformers' own `from_pretrained` and compared on logits
(1e-4, as in test_hf.py); the cache is laid out as the hub library lays it out (blobs, snapshot
links, refs), which `huggingface_hub` itself is asked to read back first, so the import is
tested against the real layout and not one of its own invention.
"""

import argparse
import hashlib
import json
import os

import pytest
import torch

from meshtrain.services.checkpoint.convert_cli import register_subcommands
from meshtrain.services.checkpoint.hf.convert import export_hf, import_hf
from meshtrain.services.checkpoint.hf.write import parse_size
from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.common.errors import CheckpointError
from tests.services.checkpoint.test_hf import (
    LLAMA,
    hf_llama,
    meshtrain_logits,
    random_model,
    save_training_checkpoint,
)
from tests.services.checkpoint.test_hf_models import QWEN3, TOKENS, hf_logits, restored

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    register_subcommands(parser.add_subparsers(dest="ckpt_cmd", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_parse_size_reads_transformers_units():
    assert parse_size("5GB") == 5 * 10**9 == parse_size(" 5 gb ")
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5KB") == 1500 and parse_size(123) == 123 and parse_size("77") == 77
    for bad in ("5 GBs", "-1", "GB", 0, True, "0MB"):
        with pytest.raises(CheckpointError, match="max shard size"):
            parse_size(bad)


@pytest.mark.parametrize("settings", [LLAMA, QWEN3], ids=["llama", "qwen3"])
def test_sharded_export_loads_in_transformers_and_imports_back(tmp_path, settings):
    """A 40 KB limit cuts this ~330 KB fp32 model into many shards, a few of which hold one tensor
    over the limit (the 77 KB embedding and output layer), as transformers itself shards."""
    model = random_model(settings)
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model)
    dst = tmp_path / "hf"
    assert cli("export", "--format", "hf", root, str(dst), "--max-shard-size", "40KB") == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in dst.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 3 and not (dst / "model.safetensors").exists()
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    stored = {}
    for name in shards:
        tensors = safetensors_torch.load_file(str(dst / name))
        assert all(index["weight_map"][t] == name for t in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 40_000 or len(tensors) == 1, (name, size)
        stored.update(tensors)
    assert sorted(stored) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in stored.values()
    )

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(
            hf.eval()(TOKENS).logits, meshtrain_logits(model, TOKENS), atol=1e-4, rtol=1e-4
        )

    back = str(tmp_path / "back")
    import_hf(str(dst), back)  # the sharded folder, through its index
    again = restored(back)
    for name, p in model.named_parameters():
        q = dict(again.named_parameters())[name]
        assert torch.equal(q[: model.vocab_size], p[: model.vocab_size]), name


def test_sharded_export_to_object_storage(tmp_path, s3_root):
    import fsspec

    model = random_model(LLAMA)
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model)
    dst = f"{s3_root.rsplit('/', 1)[0]}/hf-sharded"
    export_hf(root, dst, max_shard_size=100_000)
    fs, path = fsspec.core.url_to_fs(dst)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(path, detail=False))
    assert "model.safetensors.index.json" in names and "config.json" in names
    assert ".meshtrain-export-incomplete" not in names
    fs.get(path + "/", str(tmp_path / "fetched"), recursive=True)
    torch.testing.assert_close(
        hf_logits(tmp_path / "fetched"), meshtrain_logits(model, TOKENS), atol=1e-4, rtol=1e-4
    )


def lay_out_cache(cache, repo_id: str, folder, commit: str, branch: str | None = "main") -> None:
    """Puts `folder`'s files into a hub cache as the hub library does: content in blobs/ named by
    hash, snapshots/<commit>/<file> relative links to them, refs/<branch> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    if branch is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit)


def test_import_resolves_a_repo_id_in_the_hub_cache_offline(tmp_path, monkeypatch):
    from meshtrain.services.dataloader.tokenizers.base import train_bpe

    hub = pytest.importorskip("huggingface_hub")
    main_src = hf_llama(tmp_path / "a", torch.float32)
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 100)
    train_bpe([text], vocab_size=300, output_path=main_src / "tokenizer.json")
    dev_src = hf_llama(tmp_path / "b", torch.float32)  # the same shapes; other weights below
    weights = safetensors_torch.load_file(str(dev_src / "model.safetensors"))
    safetensors_torch.save_file(
        {n: t.flip(-1).contiguous() for n, t in weights.items()},
        str(dev_src / "model.safetensors"),
        metadata={"format": "pt"},
    )
    assert (hf_logits(dev_src) - hf_logits(main_src)).abs().max() > 0.1
    cache = tmp_path / "hub"
    main_commit, dev_commit = "a" * 40, "b" * 40
    lay_out_cache(cache, "org/tiny", main_src, main_commit)
    lay_out_cache(cache, "org/tiny", dev_src, dev_commit, branch="dev")
    snapshot = cache / "models--org--tiny" / "snapshots" / main_commit
    # the hub library reads this layout back as its own
    assert hub.try_to_load_from_cache("org/tiny", "config.json", cache_dir=str(cache)) == str(
        snapshot / "config.json"
    )
    assert hub.snapshot_download("org/tiny", cache_dir=str(cache), local_files_only=True) == str(
        snapshot
    )

    root = str(tmp_path / "ckpt")
    import_hf("org/tiny", root, cache_dir=str(cache))
    meta = read_manifest(root, 0)["metadata"]
    assert meta["imported_from"]["url"] == str(snapshot.resolve())
    assert meta["tokenizer"] == str(
        snapshot.resolve() / "tokenizer.json"
    )  # not the blob it links to
    torch.testing.assert_close(
        meshtrain_logits(restored(root), TOKENS), hf_logits(main_src), atol=1e-4, rtol=1e-4
    )

    # the cache found through the environment, as the hub library finds it
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import_hf("org/tiny", str(tmp_path / "env"), revision="dev")
    torch.testing.assert_close(
        meshtrain_logits(restored(str(tmp_path / "env")), TOKENS),
        hf_logits(dev_src),
        atol=1e-4,
        rtol=1e-4,
    )
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # its hub/ is the cache
    assert (
        cli(
            "import", "--format", "hf", "org/tiny", str(tmp_path / "home"), "--revision", dev_commit
        )
        == 0
    )
    assert read_manifest(str(tmp_path / "home"), 0)["metadata"]["imported_from"]["url"].endswith(
        dev_commit
    )
    # a cache folder and a snapshot folder are folders to import too
    import_hf(str(cache / "models--org--tiny"), str(tmp_path / "repo-folder"))
    import_hf(str(snapshot), str(tmp_path / "snapshot-folder"))
    for name in ("repo-folder", "snapshot-folder"):
        url = read_manifest(str(tmp_path / name), 0)["metadata"]["imported_from"]["url"]
        assert url == str(snapshot.resolve())

    with pytest.raises(
        CheckpointError, match=r"holds no models--org--absent .*hf download org/absent"
    ):
        import_hf("org/absent", str(tmp_path / "x"))
    with pytest.raises(
        CheckpointError, match=r"no ref 'nope' in the cache \(refs there: \['dev', 'main'\]\)"
    ):
        import_hf("org/tiny", str(tmp_path / "x"), revision="nope")
    with pytest.raises(CheckpointError, match="a revision .* not of a plain folder"):
        import_hf(str(main_src), str(tmp_path / "x"), revision="dev")
    (snapshot / "config.json").unlink()  # an interrupted download
    with pytest.raises(CheckpointError, match="holds no config.json: a partial download"):
        import_hf("org/tiny", str(tmp_path / "x"))
