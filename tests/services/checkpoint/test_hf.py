"""Hugging Face export/import, verified against `transformers` itself on CPU.

Small random models of both architectures (GQA with fewer groups than heads, tied and untied,
with and without biases) are saved through the checkpoint library, exported, loaded as
`LlamaForCausalLM` / `GPT2LMHeadModel`, and their logits compared with meshtrain's `GPT` on
the same tokens. Round trips HF -> meshtrain -> HF must give bit-identical safetensors.
"""

import dataclasses
import json

import pytest
import tomli_w
import torch

from meshtrain.services.checkpoint.hf.convert import export_hf, import_hf
from meshtrain.services.checkpoint.reader import list_checkpoints, read_manifest
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.config import to_dict
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer import checkpoint_restore
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.optim.optimizer import build_optimizer
from meshtrain.services.trainer.parallel.mesh import Mesh

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 96,
    "seq_length": 32,
    "vocab_size": 300,
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "position_embedding_type": "rope",
    "rotary_base": 5000.0,
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "norm_epsilon": 1e-6,
}
GPT2 = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "max_position_embeddings": 40,
    "vocab_size": 300,
    "normalization": "layernorm",
    "activation": "gelu",
    "position_embedding_type": "learned",
    "add_bias_linear": True,
}
# Tensors whose padded vocabulary rows the trainer cuts off before saving.
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def random_model(settings: dict, seed: int = 0) -> GPT:
    """A GPT with every parameter random (norm weights and biases too, so each one matters)."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**settings))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def save_training_checkpoint(
    root: str,
    model: GPT,
    step: int = 7,
    tokenizer: str = "byte",
    drop: tuple[str, ...] = (),
    extra: dict | None = None,
) -> None:
    """Saves `model` the way the trainer does (unpadded vocab rows, optimizer moments, rng)."""
    v = model.vocab_size
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach()[:v] if name in VOCAB_ROWS else p.detach()
        tensors[name] = t.clone()
        tensors[f"optim.exp_avg.{name}"] = torch.zeros_like(t)
    tensors["rng.torch_cpu"] = torch.get_rng_state()
    tensors.update(extra or {})
    for name in drop:
        del tensors[name]
    metadata = {
        "format": "meshtrain-train/1",
        "iteration": step,
        "optimizer_step": step,
        "config": to_dict(JobConfig(model=model.config)),
        "tokenizer": tokenizer,
    }
    save_checkpoint(root, step, tensors, metadata)


def meshtrain_logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize(
    "name, settings, cls",
    [
        ("llama-gqa-untied", LLAMA, "LlamaForCausalLM"),
        (
            "llama-tied-bias",
            {
                **LLAMA,
                "untie_embeddings_and_output_weights": False,
                "add_bias_linear": True,
                "num_query_groups": 1,
            },
            "LlamaForCausalLM",
        ),
        ("gpt2-tied", GPT2, "GPT2LMHeadModel"),
        ("gpt2-untied", {**GPT2, "untie_embeddings_and_output_weights": True}, "GPT2LMHeadModel"),
    ],
)
def test_export_loads_in_transformers_with_same_logits(tmp_path, name, settings, cls):
    """fp32 throughout; 1e-4 absolute covers summation-order differences between the two
    attention implementations on logits of size ~10 (a wrong head order or transpose is O(1))."""
    model = random_model(settings)
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model)
    dst = tmp_path / "hf"
    assert export_hf(root, str(dst)) == str(dst)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32)
    assert type(hf).__name__ == cls
    tokens = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    hf.eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = meshtrain_logits(model, tokens)
    assert theirs.shape == ours.shape == (2, 32, model.vocab_size)
    assert ours.abs().max() > 1.0  # the comparison is not between near-zero outputs
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_export_to_object_storage_loads_with_the_same_logits(tmp_path, s3_root):
    """Export straight to a real S3-compatible store (no rename there: the files are written in
    place, config.json last); the folder, fetched, loads in transformers with meshtrain's logits,
    and no temporary prefix is left beside it. A failed export leaves nothing at the destination."""
    import fsspec

    model = random_model(LLAMA)
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model)
    dst = f"{s3_root.rsplit('/', 1)[0]}/hf"
    assert export_hf(root, dst) == dst
    fs, path = fsspec.core.url_to_fs(dst)
    parent = path.rsplit("/", 1)[0]
    assert [p.rsplit("/", 1)[1] for p in fs.ls(parent, detail=False)] == ["hf"]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(path, detail=False)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    fs.get(path + "/", str(tmp_path / "fetched"), recursive=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "fetched"), dtype=torch.float32
    )
    tokens = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    hf.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            hf(tokens).logits, meshtrain_logits(model, tokens), atol=1e-4, rtol=1e-4
        )

    # the last tensor written (the output layer) corrupt:
    # the export fails midway through the weights
    broken = tmp_path / "broken"
    save_training_checkpoint(str(broken), model)
    chunk = broken / "step_00000007" / "output_layer.weight" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="output_layer.weight.*corrupt"):
        export_hf(str(broken), f"{s3_root.rsplit('/', 1)[0]}/hf-broken")
    assert not fs.exists(f"{parent}/hf-broken")


KILLED_AFTER_WEIGHTS = """
import os, signal, sys
from meshtrain.services.checkpoint.hf import convert as hf
def die(*args):  # called once model.safetensors is closed (uploaded), before config.json
    os.kill(os.getpid(), signal.SIGKILL)
hf.hf_config = die
hf.export_hf(sys.argv[1], sys.argv[2])
"""


@pytest.mark.e2e
def test_export_to_object_storage_killed_midway_is_replaced_by_the_next_export(tmp_path, s3_root):
    """An object store has no rename, so an export writes in place, config.json last. One
    SIGKILLed after the weights left model.safetensors at the destination, and every later
    export refused it ("already exists") although nothing had ever loaded from it: re-running
    has to work. A prefix an export did not leave (no marker) is still refused."""
    import subprocess
    import sys

    import fsspec

    model = random_model(LLAMA)
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model)
    dst = f"{s3_root.rsplit('/', 1)[0]}/hf"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_WEIGHTS, root, dst], timeout=120, check=False
    )
    assert killed.returncode == -9
    fs, path = fsspec.core.url_to_fs(dst)
    fs.invalidate_cache()
    left = sorted(p.rsplit("/", 1)[1] for p in fs.find(path))
    assert "model.safetensors" in left and "config.json" not in left, left
    assert export_hf(root, dst) == dst
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(path)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    fs.get(path + "/", str(tmp_path / "fetched"), recursive=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "fetched"), dtype=torch.float32
    )
    tokens = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            hf.eval()(tokens).logits, meshtrain_logits(model, tokens), atol=1e-4, rtol=1e-4
        )

    other = f"{s3_root.rsplit('/', 1)[0]}/someone-elses"
    fs.pipe_file(fsspec.core.url_to_fs(other)[1] + "/model.safetensors", b"not ours")
    with pytest.raises(CheckpointError, match="already exists"):
        export_hf(root, other)
    assert fs.cat_file(fsspec.core.url_to_fs(other)[1] + "/model.safetensors") == b"not ours"


@pytest.mark.e2e
def test_local_export_killed_midway_leaves_nothing_behind_once_exported_again(tmp_path):
    """On disk an export is built in a folder beside the destination and renamed into place;
    killed (SIGKILL, out of memory) it left that folder, as large as the model, hidden beside
    the destination for good: the next export built its own and never looked. The next export
    now removes it, but only a dead process's on this host: a live export's stays."""
    import os
    import socket
    import subprocess
    import sys

    model = random_model(LLAMA)
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model)
    dst = tmp_path / "hf"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_WEIGHTS, root, str(dst)], timeout=120, check=False
    )
    assert killed.returncode == -9
    left = list(tmp_path.glob("hf.tmp-*"))
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file() and not dst.exists()
    live = (
        tmp_path / f"hf.tmp-{socket.gethostname()}-{os.getpid()}-{'0' * 32}"
    )  # this process: alive
    elsewhere = tmp_path / f"hf.tmp-another-host-4242-{'1' * 32}"  # a shared disk
    live.mkdir()
    elsewhere.mkdir()
    export_hf(root, str(dst))
    assert sorted(tmp_path.glob("hf*")) == sorted([dst, live, elsewhere])
    assert (dst / "config.json").is_file()


def test_export_ships_the_runs_tokenizer(tmp_path):
    from meshtrain.services.dataloader.tokenizers.base import train_bpe

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    tok = train_bpe([text], vocab_size=300, output_path=tmp_path / "tok" / "tokenizer.json")
    model = random_model({**GPT2, "vocab_size": tok.vocab_size})
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model, tokenizer=str(tok.path))
    export_hf(root, str(tmp_path / "hf"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sample = "the lazy fox jumps"
    assert auto(sample)["input_ids"] == tok.encode(sample)
    assert auto.eos_token == "<|endoftext|>"


def test_export_refuses_a_tokenizer_larger_than_the_models_vocabulary(tmp_path):
    """Only the end-of-document id was checked against the vocabulary, and a trained BPE puts
    it at id 0: a larger tokenizer (another run's) was shipped, and transformers then failed
    with IndexError in the embedding on its first id past the model's rows."""
    from meshtrain.services.dataloader.tokenizers.base import train_bpe

    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(f"word{i} token{i * 7} piece{i % 13}" for i in range(3000)))
    big = train_bpe([text], vocab_size=600, output_path=tmp_path / "big" / "tokenizer.json")
    assert big.eod_id < 300 < big.vocab_size
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, random_model(GPT2))  # vocab 300
    with pytest.raises(
        CheckpointError,
        match=rf"has {big.vocab_size} tokens, more than the model's vocabulary of 300",
    ):
        export_hf(root, str(tmp_path / "hf"), tokenizer=str(big.path))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("settings", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("tokenizer", ["bpe", "byte"])
def test_exported_model_ends_generation_at_the_runs_end_of_document(tmp_path, settings, tokenizer):
    """Without ids in config.json HF fills in its own: Llama's eos 2 (a '"' in the BPE below, which
    transformers 4 copies into generate()'s stopping ids), GPT-2's 50256 (outside these
    vocabularies); transformers 5 takes them from generation_config.json only. Both must name
    the run's <|endoftext|>, whose id the byte tokenizer fixes at 256 though it ships no
    tokenizer file."""
    from meshtrain.services.dataloader.tokenizers.base import ByteTokenizer, train_bpe

    if tokenizer == "bpe":
        text = tmp_path / "corpus.txt"
        text.write_text('she said "the quick brown fox" and "the lazy dog". ' * 200)
        tok = train_bpe([text], vocab_size=300, output_path=tmp_path / "tok" / "tokenizer.json")
        spec = str(tok.path)
    else:
        tok, spec = ByteTokenizer(), "byte"
    model = random_model({**settings, "vocab_size": tok.vocab_size})
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, model, tokenizer=spec)
    export_hf(root, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    ).eval()
    eod = tok.eod_id
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (eod, eod)
    assert hf.generation_config.eos_token_id == eod

    def always(token: int):  # replaces the head's logits: greedy decoding then picks `token`
        def hook(module, inputs, output):
            return torch.where(torch.arange(output.shape[-1]) == token, 10.0, -10.0).expand_as(
                output
            )

        return hook

    prompt = torch.tensor([[5, 6, 7]])
    handle = hf.lm_head.register_forward_hook(always(eod))
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out[0, 3:].tolist() == [eod], "generation must stop at <|endoftext|>"
    handle.remove()
    hf.lm_head.register_forward_hook(always(2))
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out[0, 3:].tolist() == [2] * 5, "token 2 is an ordinary token"


def save_random_hf(cls, config, tmp_path, dtype=torch.float32):
    """(folder, model): a transformers `cls` built from `config` with every parameter random
    (scale 0.2), saved to tmp_path/src."""
    torch.manual_seed(0)
    model = cls(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(tmp_path / "src"))
    return tmp_path / "src", model


def hf_llama(tmp_path, dtype=torch.bfloat16, tie=False):
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
    )
    return save_random_hf(transformers.LlamaForCausalLM, config, tmp_path, dtype)[0]


def hf_gpt2(tmp_path):
    config = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=40)
    return save_random_hf(transformers.GPT2LMHeadModel, config, tmp_path)[0]


@pytest.mark.parametrize(
    "make",
    [hf_llama, hf_gpt2, lambda p: hf_llama(p, torch.float32, tie=True)],
    ids=["llama-bf16-untied", "gpt2-fp32", "llama-fp32-tied"],
)
def test_round_trip_hf_meshtrain_hf_is_bit_exact(tmp_path, make):
    src = make(tmp_path)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    export_hf(root, str(tmp_path / "back"))
    before = safetensors_torch.load_file(str(src / "model.safetensors"))
    after = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name].view(torch.uint8), tensor.view(torch.uint8)), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == json.loads((src / "config.json").read_text())["model_type"]


def test_imported_checkpoint_restores_into_the_trainer(tmp_path):
    src = hf_llama(tmp_path, torch.float32)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    meta = read_manifest(root, 0)["metadata"]
    job = JobConfig(model=ModelConfig(**meta["config"]["model"]))
    assert (job.model.num_query_groups, job.model.rotary_base, job.model.seq_length) == (
        2,
        5000.0,
        32,
    )
    model = GPT(job.model)
    par = Parallel(Mesh.single())
    state, _ = checkpoint_restore.restore(root, model, build_optimizer(model, job.optim), par)
    assert state.iteration == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            meshtrain_logits(model, tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize(
    "make, heads, groups", [(hf_gpt2, 2, None), (hf_llama, 2, 1)], ids=["gpt2", "llama-gqa"]
)
def test_restore_refuses_a_model_that_reads_the_heads_differently(tmp_path, make, heads, groups):
    """GPT-2's 4 heads of 16 and a 2-head model of 32 have the same fused QKV shape (3*hidden
    rows), as do Llama's 4 heads in 2 groups and 2 heads in 1 group: every shape matches, so
    only the saved config tells that the rows would be read as other heads."""
    src = make(tmp_path) if make is hf_gpt2 else make(tmp_path, torch.float32)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    saved = ModelConfig(**read_manifest(root, 0)["metadata"]["config"]["model"])
    wrong = dataclasses.replace(saved, num_attention_heads=heads, num_query_groups=groups)
    model = GPT(wrong)
    assert (
        model.layers[0].attention.qkv.weight.shape
        == GPT(saved).layers[0].attention.qkv.weight.shape
    )
    par = Parallel(Mesh.single())
    with pytest.raises(
        CheckpointError, match=rf"num_attention_heads=4.*model.num_attention_heads={heads}"
    ):
        checkpoint_restore.restore(root, model, build_optimizer(model, JobConfig().optim), par)


def test_restore_warns_when_rope_base_or_norm_epsilon_differ_from_the_saved_model(tmp_path, caplog):
    """Neither changes a shape, so restore cannot refuse on shapes; both change the function
    the weights compute (a Llama 3 import resumed without its rope_theta=500000 trains on with
    RoPE base 10000). Changing the RoPE base on purpose is a known context extension, so this
    is a warning, naming the key, the saved value and this run's."""
    src = hf_llama(tmp_path, torch.float32)
    root = str(tmp_path / "ckpt")
    import_hf(str(src), root)
    saved = ModelConfig(**read_manifest(root, 0)["metadata"]["config"]["model"])
    par = Parallel(Mesh.single())

    def restore(config: ModelConfig) -> list[str]:
        model = GPT(config)
        caplog.clear()
        with caplog.at_level("WARNING", logger="meshtrain.checkpoint"):
            checkpoint_restore.restore(root, model, build_optimizer(model, JobConfig().optim), par)
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    assert restore(saved) == []
    messages = restore(dataclasses.replace(saved, rotary_base=10000.0, norm_epsilon=1e-5))
    assert any("model.rotary_base" in m and "5000.0" in m and "10000.0" in m for m in messages), (
        messages
    )
    assert any("model.norm_epsilon" in m and "1e-06" in m and "1e-05" in m for m in messages), (
        messages
    )


def test_export_refuses_missing_misshapen_and_unmapped_tensors(tmp_path):
    model = random_model(LLAMA)
    cases = {
        "missing": {"drop": ("layers.1.mlp.fc1.weight",)},
        "wrong shapes": {"extra": {"final_norm.weight": torch.ones(65)}},
        "no mapping": {"extra": {"layers.0.attention.extra_scale": torch.ones(3)}},
    }
    for i, (message, kwargs) in enumerate(cases.items()):
        root = str(tmp_path / f"ckpt{i}")
        save_training_checkpoint(root, model, **kwargs)
        dst = tmp_path / f"hf{i}"
        with pytest.raises(CheckpointError, match=message):
            export_hf(root, str(dst))
        assert not dst.exists() and not list(tmp_path.glob(f"hf{i}.tmp-*"))


def test_export_refuses_configs_hf_cannot_express(tmp_path):
    cases = [
        ({**LLAMA, "activation": "gelu"}, "map to no Hugging Face architecture"),
        ({**GPT2, "num_query_groups": 2}, "no grouped-query attention"),
        ({**GPT2, "add_bias_linear": False}, "always has linear biases"),
    ]
    for i, (settings, message) in enumerate(cases):
        root = str(tmp_path / f"ckpt{i}")
        save_training_checkpoint(root, random_model(settings))
        with pytest.raises(CheckpointError, match=message):
            export_hf(root, str(tmp_path / f"hf{i}"))
        assert not (tmp_path / f"hf{i}").exists()


def test_export_refuses_an_existing_destination(tmp_path):
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, random_model(GPT2))
    (tmp_path / "hf").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        export_hf(root, str(tmp_path / "hf"))


def test_import_refuses_what_meshtrain_cannot_express(tmp_path):
    src = hf_llama(tmp_path, torch.float32)
    config = json.loads((src / "config.json").read_text())
    bad = {**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0}}
    (src / "config.json").write_text(json.dumps(bad))
    with pytest.raises(
        CheckpointError, match="rope scaling .* only plain RoPE and Llama 3's 'llama3' scaling"
    ):
        import_hf(str(src), str(tmp_path / "a"))
    (src / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="hidden_act"):
        import_hf(str(src), str(tmp_path / "b"))
    # a tensor the mapping does not know is an error, not silently dropped
    (src / "config.json").write_text(json.dumps(config))
    tensors = safetensors_torch.load_file(str(src / "model.safetensors"))
    safetensors_torch.save_file(
        {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)},
        str(src / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with pytest.raises(CheckpointError, match="no mapping"):
        import_hf(str(src), str(tmp_path / "c"))


def test_import_refuses_a_root_whose_later_steps_load_would_resume_instead(tmp_path):
    """`train --load ROOT` resumes ROOT's latest step; the import is step 0, so beside a run's
    checkpoints it would be passed over without a word."""
    src = hf_llama(tmp_path, torch.float32)
    root = str(tmp_path / "ckpt")
    save_training_checkpoint(root, random_model(GPT2), step=7)
    with pytest.raises(CheckpointError, match=r"already holds committed checkpoints \[7\]"):
        import_hf(str(src), root)
    assert list_checkpoints(root) == [7]


def test_import_names_a_broken_folder_instead_of_a_traceback(tmp_path):
    src = hf_llama(tmp_path, torch.float32)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "intermediate_size"})
    )
    with pytest.raises(CheckpointError, match="no 'intermediate_size'"):
        import_hf(str(src), str(tmp_path / "a"))
    (src / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not a readable JSON file"):
        import_hf(str(src), str(tmp_path / "b"))
    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
        )
    )
    with pytest.raises(
        CheckpointError, match="names files that are not there.*model-00001-of-00002"
    ):
        import_hf(str(src), str(tmp_path / "c"))


@pytest.mark.parametrize("key, value", [("hidden_size", "64"), ("num_attention_heads", 0)])
def test_import_names_a_config_number_of_the_wrong_type_instead_of_a_traceback(
    tmp_path, key, value
):
    """A Llama config's head size is computed before the config is validated: a string (a
    hand-edited config.json) raised TypeError, a zero ZeroDivisionError, as tracebacks."""
    src = hf_llama(tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(
        CheckpointError, match=rf"HF config {key}={value!r} is not a positive integer"
    ):
        import_hf(str(src), str(tmp_path / "a"))


def test_import_of_a_url_says_it_reads_local_folders_and_takes_file_urls(tmp_path):
    """Export writes to any URL, so a user imports what they exported to s3://... back: Path()
    made that 's3:/bucket/hf' and the error said it held no config.json, which it does. A
    file:// URL is a local folder and is imported (it failed the same way)."""
    with pytest.raises(
        CheckpointError, match=r"'s3://bucket/hf': import reads a local folder, not a URL"
    ):
        import_hf("s3://bucket/hf", str(tmp_path / "a"))
    src = hf_llama(tmp_path, torch.float32)
    import_hf(f"file://{src}", str(tmp_path / "b"))
    assert list_checkpoints(str(tmp_path / "b")) == [0]


def test_import_names_a_truncated_or_mismatched_safetensors_file_instead_of_a_traceback(tmp_path):
    """An interrupted download leaves a safetensors file shorter than its header says, and a
    shard from another download may lack what the index puts in it: safetensors raises its own
    SafetensorError for both, which reached the user as a traceback."""
    src = hf_llama(tmp_path, torch.float32)
    whole = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: not a readable safetensors file"
    ):
        import_hf(str(src), str(tmp_path / "a"))
    (src / "model.safetensors").write_bytes(whole)
    names = list(safetensors_torch.load_file(str(src / "model.safetensors")))
    safetensors_torch.save_file(
        {"model.norm.weight": torch.ones(64)}, str(src / "other.safetensors")
    )
    weight_map = {
        n: "other.safetensors" if n == "lm_head.weight" else "model.safetensors" for n in names
    }
    weight_map["model.norm.weight"] = "model.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        CheckpointError,
        match=r"puts tensor 'lm_head.weight' in other.safetensors, which does "
        r"not hold it",
    ):
        import_hf(str(src), str(tmp_path / "b"))
    assert list_checkpoints(str(tmp_path / "a")) == list_checkpoints(str(tmp_path / "b")) == []


def test_cli_import_tells_to_train_on_with_the_models_own_tokenizer(tmp_path, capsys):
    """`meshtrain train` takes its tokenizer from its own config, never from the checkpoint.
    The printed continuation named only [model], so following it trained the imported GPT-2
    on the default corpus's BPE ids (its vocabulary fits in the model's: no error), garbage
    without a word. The settings printed now carry data.tokenizer, which the trainer's own
    config loader reads back."""
    import argparse
    import tomllib

    from meshtrain.services.checkpoint.convert_cli import register_subcommands
    from meshtrain.services.dataloader.tokenizers.base import train_bpe
    from meshtrain.services.trainer.config.load import load_config

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    src = hf_gpt2(tmp_path)
    tok = train_bpe([text], vocab_size=300, output_path=src / "tokenizer.json")
    assert tok.vocab_size <= 300
    parser = argparse.ArgumentParser()
    register_subcommands(parser.add_subparsers(dest="ckpt_cmd", required=True))

    def settings(folder, root) -> tuple[str, dict]:
        args = parser.parse_args(["import", "--format", "hf", str(folder), str(root)])
        assert args.func(args) == 0
        out = capsys.readouterr().out
        head, toml = out.split("\n\n", 1)
        return head, tomllib.loads(toml)

    head, table = settings(src, tmp_path / "ckpt")
    assert table["data"] == {"tokenizer": str((src / "tokenizer.json").resolve())}
    assert "--data-path" in head and "meshtrain data preprocess" in head
    (tmp_path / "continue.toml").write_text(tomli_w.dumps(table))
    job = load_config(["--config", str(tmp_path / "continue.toml")])
    assert job.data.tokenizer == str((src / "tokenizer.json").resolve())
    assert (job.model.num_layers, job.model.vocab_size) == (2, 300)

    (src / "tokenizer.json").unlink()
    head, table = settings(src, tmp_path / "ckpt2")
    assert "data" not in table and "has no tokenizer.json, so also set data.tokenizer" in head


@pytest.mark.e2e
def test_hf_model_trains_on_in_meshtrain_and_exports_back(tmp_path):
    """HF Llama -> import -> `train --load` 3 steps -> export -> transformers loads the result."""
    from meshtrain.services.dataloader.preprocess import prepare_default_dataset
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import train

    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    model = read_manifest(str(tmp_path / "ckpt"), 0)["metadata"]["config"]["model"]
    prepare_default_dataset(tmp_path / "corpus", tokenizer="byte", max_bytes=200_000)
    args = [
        f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}"
        for k, v in model.items()
        if k in ModelConfig.__dataclass_fields__
    ]
    args += [
        "--model.seq_length=32",
        "--data.tokenizer=byte",
        f"--data.cache_dir={tmp_path / 'corpus'}",
        "--data.default_corpus_bytes=200000",
        "--data.split=80,20,0",
        "--train.micro_batch_size=4",
        "--train.global_batch_size=4",
        "--train.train_iters=3",
        "--train.eval_interval=0",
        "--train.device=cpu",
        f"--log.run_dir={tmp_path / 'run'}",
        "--log.plot=false",
        f"--checkpoint.load={tmp_path / 'ckpt'}",
        f"--checkpoint.save={tmp_path / 'ckpt2'}",
    ]
    result = train(load_config(args))
    assert sorted(result.losses) == [1, 2, 3]
    export_hf(str(tmp_path / "ckpt2"), str(tmp_path / "hf2"))
    trained = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf2"), dtype=torch.float32
    )
    original = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    )
    moved = (
        (trained.model.layers[0].mlp.up_proj.weight - original.model.layers[0].mlp.up_proj.weight)
        .abs()
        .max()
    )
    # Adam moves a weight at most ~lr per step (3 steps at lr 3e-4);
    # a fresh init would differ by ~0.1.
    assert 0 < moved < 0.01, "training did not start from the imported weights"
