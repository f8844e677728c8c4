"""Every flag line `ckpt export --format megatron` prints is accepted by `meshtrain train` and by
`ckpt import --format megatron`, and both read it as the model that was exported: GPT-2 style
(learned positions, LayerNorm, GELU, biases) and Llama style with every optional flag
(grouped-query attention, an explicit head width, RoPE scaling, q/k norms, a qkv bias, untied
embeddings). Needs no megatron-core: the checkpoints are meshtrain's, the export torch's."""

from __future__ import annotations

import argparse

import pytest

from meshtrain.services.checkpoint.convert_cli import register_subcommands
from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.trainer.config.load import load_config
from tests.services.checkpoint.test_hf import random_model, save_training_checkpoint

GPT = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "vocab_size": 300,
    "seq_length": 16,
}
LLAMA = {
    **GPT,
    "num_query_groups": 2,
    "kv_channels": 16,
    "ffn_hidden_size": 48,
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "position_embedding_type": "rope",
    "rotary_base": 500000.0,
    "rope_scaling_factor": 8.0,
    "add_bias_linear": False,
    "qkv_bias": True,
    "qk_norm": True,
    "untie_embeddings_and_output_weights": True,
}


@pytest.mark.parametrize("settings", [GPT, LLAMA], ids=["gpt", "llama"])
def test_the_exported_flag_line_is_read_by_train_and_import(tmp_path, capsys, settings):
    parser = argparse.ArgumentParser()
    register_subcommands(parser.add_subparsers(dest="ckpt_cmd", required=True))

    def run(*argv: str) -> str:
        args = parser.parse_args(list(argv))
        assert args.func(args) == 0
        return capsys.readouterr().out

    model = random_model(settings).config
    save_training_checkpoint(str(tmp_path / "ckpt"), random_model(settings), step=3)
    out = run("export", "--format", "megatron", str(tmp_path / "ckpt"), str(tmp_path / "mc"))
    line = out.splitlines()[-1].split()
    assert line[0] == "--num-layers"
    if settings is LLAMA:
        assert {"--group-query-attention", "--use-rope-scaling", "--qk-layernorm"} <= set(line)
    else:
        assert "--openai-gelu" in line

    # `meshtrain train` builds the same architecture from it (the vocabulary is the tokenizer's)
    trained = load_config([*line, "--vocab-size", str(model.vocab_size)]).model
    for key in settings:
        assert getattr(trained, key) == getattr(model, key), key

    # `ckpt import --format megatron` takes it whole and imports the exported model back
    run(
        "import",
        "--format",
        "megatron",
        str(tmp_path / "mc"),
        str(tmp_path / "back"),
        *line,
        "--vocab-size",
        str(model.vocab_size),
    )
    imported = read_manifest(str(tmp_path / "back"), 0)["metadata"]["config"]["model"]
    for key in settings:
        assert imported[key] == getattr(model, key), key
