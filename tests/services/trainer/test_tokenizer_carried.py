"""A run's checkpoints carry its tokenizer files: with the original tokenizer.json edited
after the run, `ckpt export --format hf` still ships the one the model was trained with, and
`meshtrain generate` reads the checkpoint with it."""

import json
import shutil

import pytest

from meshtrain.services.checkpoint.hf.convert import export_hf
from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.checkpoint.tokenizer_store import METADATA_KEY
from meshtrain.services.dataloader.preprocess import prepare_default_dataset
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.services.trainer.conftest import small_job_args

pytestmark = pytest.mark.e2e


def test_export_and_generate_use_the_carried_tokenizer_after_the_original_changed(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(
        "MESHTRAIN_CACHE", str(tmp_path / "meshtrain-cache")
    )  # where carried files unpack
    cache = tmp_path / "corpus"
    default = prepare_default_dataset(cache, tokenizer="bpe", vocab_size=400, max_bytes=200_000)
    original = (
        default.tokenizer_spec
        if default.tokenizer_spec.endswith(".json")
        else f"{default.tokenizer_spec}/tokenizer.json"
    )
    original_text = open(original).read()
    root = str(tmp_path / "ckpt")
    args = small_job_args(
        cache,
        tmp_path / "run",
        **{
            "data.tokenizer": "bpe",
            "data.default_vocab_size": 400,
            "data.default_corpus_bytes": 200_000,
            "train.train_iters": 2,
            "train.eval_interval": 0,
            "checkpoint.save": root,
            "checkpoint.save_interval": 2,
        },
    )
    train(load_config(args))
    meta = read_manifest(root, 2)["metadata"]
    assert [f["name"] for f in meta[METADATA_KEY]["files"]] == ["tokenizer.json"]

    with open(original, "w") as f:  # the tokenizer changed after the run
        json.dump({"version": "edited"}, f)
    out = tmp_path / "hf"
    export_hf(root, str(out))
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads(original_text)

    shutil.rmtree(cache)  # and then it is gone
    from meshtrain.services.cli import main

    assert (
        main(
            [
                "generate",
                "--load",
                root,
                "--prompt",
                "def ",
                "--max-new-tokens",
                "4",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
