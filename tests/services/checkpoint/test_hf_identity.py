"""A Hugging Face model imported, trained on and exported comes back as the same model.

The import records the source's architecture and the config fields meshtrain does not compute
with (special-token ids, Mistral's sliding window, the weights' dtype) as `model.hf_*`
settings; they flow through the printed settings, the run's config and every save, so the
export, given no --architecture, writes the source's `architectures`, `model_type` and token
ids, and transformers computes meshtrain's logits from it.
"""

import argparse
import json
import tomllib

import numpy as np
import pytest
import torch

from meshtrain.services.checkpoint.convert_cli import register_subcommands
from meshtrain.services.checkpoint.hf.convert import export_hf, import_hf
from meshtrain.services.checkpoint.reader import latest_step, read_manifest
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer import checkpoint_restore
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from tests.services.checkpoint.test_hf import meshtrain_logits, save_random_hf

transformers = pytest.importorskip("transformers")

COMMON = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "rope_theta": 5000.0,
    "rms_norm_eps": 1e-6,
}
# Special-token ids unlike the end of document a run's tokenizer would give (and a list of eos).
FAMILIES = {
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 32, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False},
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
        },
    ),
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"bos_token_id": 3, "eos_token_id": [4, 5], "pad_token_id": 6},
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"bos_token_id": 7, "eos_token_id": 8, "tie_word_embeddings": True},
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        {"head_dim": 24, "bos_token_id": 7, "eos_token_id": 9, "tie_word_embeddings": False},
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "bos_token_id": 7,
            "eos_token_id": 8,
            "tie_word_embeddings": False,
        },
    ),
}
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")
TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A BPE tokenizer.json of fewer than 300 tokens, shipped with every source model."""
    from meshtrain.services.dataloader.tokenizers.base import train_bpe

    folder = tmp_path_factory.mktemp("tokenizer")
    text = folder / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    train_bpe([text], vocab_size=300, output_path=folder / "tokenizer.json")
    return (folder / "tokenizer.json").read_bytes()


def source(tmp_path, family: str, tokenizer_json: bytes):
    config_cls, model_cls, extra = FAMILIES[family]
    folder, _ = save_random_hf(model_cls, config_cls(**{**COMMON, **extra}), tmp_path)
    (folder / "tokenizer.json").write_bytes(tokenizer_json)
    return folder


def cli_import(src, root, capsys) -> dict:
    """`meshtrain ckpt import` of `src` into `root`: the settings it prints to train on with."""
    parser = argparse.ArgumentParser()
    register_subcommands(parser.add_subparsers(dest="ckpt_cmd", required=True))
    args = parser.parse_args(["import", str(src), str(root)])
    assert args.func(args) == 0
    return tomllib.loads(capsys.readouterr().out.split("\n\n", 1)[1])


def train_on(settings: dict, load, save, tmp_path, steps: int = 2) -> None:
    """`meshtrain train --load` of `settings` (the printed [model] and [data]) for a few steps
    on random tokens, saving into `save`."""
    import tomli_w

    from meshtrain.services.dataloader.indexed import IndexedDatasetWriter
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import train

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "data") as w:
        for _ in range(64):
            w.add_document(rng.integers(0, 250, 40, dtype=np.int64))
    (tmp_path / "continue.toml").write_text(tomli_w.dumps(settings))
    args = [
        "--config",
        str(tmp_path / "continue.toml"),
        f"--data.data_path=['{tmp_path / 'data'}']",
        "--data.split=90,10,0",
        "--train.micro_batch_size=2",
        "--train.global_batch_size=2",
        f"--train.train_iters={steps}",
        "--train.eval_interval=0",
        "--train.device=cpu",
        "--optim.lr=1e-2",
        f"--log.run_dir={tmp_path / 'run'}",
        "--log.plot=false",
        f"--checkpoint.load={load}",
        f"--checkpoint.save={save}",
    ]
    result = train(load_config(args))
    assert sorted(result.losses) == list(range(1, steps + 1))


def restored(root: str) -> GPT:
    step = latest_step(root)
    model = GPT(ModelConfig(**read_manifest(root, step)["metadata"]["config"]["model"]))
    checkpoint_restore.restore(root, model, None, Parallel(Mesh.single()), step)
    return model


def assert_same_identity(src, back) -> None:
    original = json.loads((src / "config.json").read_text())
    exported = json.loads((back / "config.json").read_text())
    for key in ("architectures", "model_type", *SPECIAL):
        assert exported.get(key) == original.get(key), key
    if original["model_type"] == "mistral":
        assert exported["sliding_window"] == original["sliding_window"]
    generation = json.loads((back / "generation_config.json").read_text())
    assert {k: generation.get(k) for k in SPECIAL} == {k: original.get(k) for k in SPECIAL}


@pytest.mark.parametrize(
    "family, printed_hf_keys",
    [("mistral", True), ("mixtral", False)],
    ids=["mistral-printed-settings", "mixtral-settings-without-hf-keys"],
)
def test_a_trained_import_exports_as_its_source(
    tmp_path, capsys, tokenizer_json, family, printed_hf_keys
):
    """Import -> `train --load` -> export without --architecture. Without the model.hf_* keys
    in the run's settings, the resume takes them from the checkpoint."""
    src = source(tmp_path, family, tokenizer_json)
    settings = cli_import(src, tmp_path / "imported", capsys)
    if not printed_hf_keys:
        settings["model"] = {k: v for k, v in settings["model"].items() if not k.startswith("hf_")}
    trained = tmp_path / "trained"
    train_on(settings, tmp_path / "imported", trained, tmp_path)
    export_hf(str(trained), str(tmp_path / "back"))
    assert_same_identity(src, tmp_path / "back")
    saved = read_manifest(str(trained), latest_step(str(trained)))["metadata"]["config"]["model"]
    assert saved["hf_model_type"] == family  # carried by the run's saves

    model = restored(str(trained))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "back"), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    torch.testing.assert_close(meshtrain_logits(model, TOKENS), theirs, atol=1e-4, rtol=1e-4)
    original = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        assert (original.eval()(TOKENS).logits - theirs).abs().max() > 1e-3, "not trained"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2_moe"])
def test_an_import_exports_as_its_source(tmp_path, tokenizer_json, family):
    src = source(tmp_path, family, tokenizer_json)
    import_hf(str(src), str(tmp_path / "imported"))
    export_hf(str(tmp_path / "imported"), str(tmp_path / "back"))
    assert_same_identity(src, tmp_path / "back")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "back"), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    torch.testing.assert_close(
        meshtrain_logits(restored(str(tmp_path / "imported")), TOKENS),
        theirs,
        atol=1e-4,
        rtol=1e-4,
    )


def test_an_explicit_architecture_wins(tmp_path, tokenizer_json):
    src = source(tmp_path, "mistral", tokenizer_json)
    import_hf(str(src), str(tmp_path / "imported"))
    export_hf(str(tmp_path / "imported"), str(tmp_path / "back"), arch="llama")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llama"


def test_another_tokenizer_gets_its_own_end_of_document(tmp_path, tokenizer_json):
    """The imported ids belong to the imported tokenizer: an export shipping another writes its
    end of document as bos and eos, as for any run."""
    from meshtrain.services.dataloader.tokenizers.base import train_bpe

    src = source(tmp_path, "mistral", tokenizer_json)
    import_hf(str(src), str(tmp_path / "imported"))
    text = tmp_path / "other.txt"
    text.write_text("pack my box with five dozen liquor jugs. " * 200)
    other = train_bpe([text], vocab_size=280, output_path=tmp_path / "other" / "tokenizer.json")
    eod = other.eod_id
    export_hf(
        str(tmp_path / "imported"),
        str(tmp_path / "back"),
        tokenizer=str(tmp_path / "other" / "tokenizer.json"),
    )
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["bos_token_id"], config["eos_token_id"]) == (
        "mistral",
        eod,
        eod,
    )
