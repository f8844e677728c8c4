"""Megatron's tokenizer flags on `meshtrain train`: --tokenizer-type and its file flags set the
data section's tokenizer keys, and --vocab-size is the tokenizer's where the type reads it."""

import pytest

from meshtrain.services.common import config as cfg
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.flags import parse_overrides
from meshtrain.services.trainer.config.load import load_config


@pytest.fixture
def gpt2_files(tmp_path):
    """A hand-written GPT-2 style pair: the 256 byte symbols, one merge, <|endoftext|>."""
    import json

    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["ab"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


def test_gpt2bpe_flags_set_the_data_keys(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    args = [
        "--data-path",
        "corpus",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
    ]
    _, table = parse_overrides(args)
    assert table["data"] == {
        "data_path": ["corpus"],
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": vocab,
        "merge_file": merges,
    }
    job = load_config(args)
    assert job.data.tokenizer == f"gpt2bpe:{vocab},{merges}"
    # the resolved config, as a run's config.toml holds it, loads back to the same job
    path = tmp_path / "run.toml"
    path.write_text(cfg.dumps_toml(job))
    assert load_config(["--config", str(path)]) == job


def test_vocab_size_is_the_null_tokenizers():
    job = load_config(
        ["--data-path", "corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]
    )
    assert job.data.tokenizer == "null:50" and job.data.vocab_size == 50
    assert job.model.vocab_size is None  # taken from the tokenizer (51 ids: EOD is 50)
    # with any other tokenizer --vocab-size stays the model's
    assert load_config(["--vocab-size", "512"]).model.vocab_size == 512


def test_tokenizer_flag_errors_name_the_key(gpt2_files):
    vocab, _ = gpt2_files
    with pytest.raises(
        ConfigError, match="data.tokenizer_type=GPT2BPETokenizer needs data.merge_file"
    ):
        load_config(
            ["--data-path", "c", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab]
        )
    with pytest.raises(ConfigError, match="both name the tokenizer"):
        load_config(
            [
                "--data-path",
                "c",
                "--tokenizer",
                "byte",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "9",
            ]
        )
    with pytest.raises(ConfigError, match="data.vocab_file is given without data.tokenizer_type"):
        load_config(["--data-path", "c", "--tokenizer", "byte", "--vocab-file", vocab])
