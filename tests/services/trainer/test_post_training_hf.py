"""A Hugging Face model through SFT and DPO and back, with the commands of docs/post-training.md
("From a Hugging Face checkpoint through SFT and DPO and back"): import a random tiny Llama
whose tokenizer has a chat template, fine-tune it on the chat format of `examples/sft_upper.py`
(`--finetune` from the import), run DPO from the SFT result (`--finetune` again), export it, and
ask it through transformers' `apply_chat_template` and through `meshtrain generate --chat`.
"""

import functools
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
# deploy/configs/sft-tiny.toml's shapes; dpo-tiny.toml's model is a byte-level GPT, so the DPO
# step names the SFT model's settings on its command line
TINY_LLAMA = [
    "--num-layers=2",
    "--ffn-hidden-size=256",
    "--normalization=rmsnorm",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--position-embedding-type=rope",
]


def _example():
    spec = importlib.util.spec_from_file_location("sft_upper", REPO / "examples/sft_upper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def meshtrain(cwd: Path, *args: str) -> str:
    """Run `meshtrain ARGS` in `cwd`; its stdout, or the failure with its stderr's end."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "meshtrain", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, f"meshtrain {' '.join(args)}:\n{r.stderr[-3000:]}"
    return r.stdout


def _hf_model(folder: Path, example) -> None:
    """A random LlamaForCausalLM of sft-tiny.toml's shapes with the example's chat tokenizer,
    whose end of turn `<|im_end|>` is the model's eos (as a chat model's is)."""
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    example.write_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def _write_data(folder: Path, example) -> None:
    """chats.jsonl (SFT) and pairs.jsonl (DPO, conversational: the answer in capitals is
    chosen, the word as asked rejected), from the training words only."""
    rng = random.Random(0)
    train = example.words(held_out=False)
    with open(folder / "chats.jsonl", "w") as f:
        for _ in range(2000):
            f.write(json.dumps(example.conversation(rng.choice(train), rng)) + "\n")
    with open(folder / "pairs.jsonl", "w") as f:
        for _ in range(200):
            w = rng.choice(train)
            pair = {
                "prompt": [{"role": "user", "content": f"upper {w}"}],
                "chosen": [{"role": "assistant", "content": example.answer(w)}],
                "rejected": [{"role": "assistant", "content": w}],
            }
            f.write(json.dumps(pair) + "\n")


def _hf_answers(folder: Path, words: list[str]) -> tuple[list[str], list[list[int]]]:
    """transformers' greedy answers (text, and token ids with the end of turn) to
    `upper WORD`, asked through the folder's own chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    texts, ids = [], []
    for word in words:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"upper {word}"}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=8, do_sample=False)
        new = out[0, prompt.shape[1] :].tolist()
        ids.append(new)
        texts.append(tok.decode(new, skip_special_tokens=True))
    return texts, ids


@pytest.mark.e2e
@pytest.mark.slow  # seven commands, each importing torch, and 60 training steps: minutes
def test_hf_model_through_sft_and_dpo_and_back(tmp_path):
    from meshtrain.services.checkpoint.reader import list_checkpoints

    example = _example()
    _hf_model(tmp_path / "hf", example)
    _write_data(tmp_path, example)
    held_out = example.words(held_out=True)[::3][:20]
    before, _ = _hf_answers(tmp_path / "hf", held_out)
    assert sum(a == example.answer(w) for a, w in zip(before, held_out)) == 0

    run = functools.partial(meshtrain, tmp_path)
    run("ckpt", "import", "--format", "hf", "hf", "ckpt/base")
    run("data", "preprocess", "--chat", "--input", "chats.jsonl", "--output-prefix", "data/chats",
        "--tokenizer", "hf", "--seq-length", "128")  # fmt: skip
    run("train", "--config", str(REPO / "deploy/configs/sft-tiny.toml"),
        "--load", "ckpt/base", "--finetune", "--save", "ckpt/sft",
        "--data-path", "data/chats", "--data.tokenizer=hf",
        "--train.train_iters=50", "--train.eval_interval=0", "--run-dir", "runs/sft",
        "--log.plot=false")  # fmt: skip
    run("data", "preprocess-pairs", "--chat", "--input", "pairs.jsonl",
        "--output-prefix", "data/prefs", "--tokenizer", "hf", "--max-length", "129")  # fmt: skip
    run("train", "--config", str(REPO / "deploy/configs/dpo-tiny.toml"), *TINY_LLAMA,
        "--load", "ckpt/sft", "--finetune", "--save", "ckpt/dpo",
        "--dpo.data_path=data/prefs", "--data.tokenizer=hf",
        "--train.train_iters=10", "--train.eval_interval=0", "--run-dir", "runs/dpo",
        "--log.plot=false")  # fmt: skip
    run("ckpt", "export", "ckpt/dpo", "hf-dpo")

    # --finetune starts each run at step 0 from the weights alone
    assert list_checkpoints(str(tmp_path / "ckpt/sft")) == [50]
    assert list_checkpoints(str(tmp_path / "ckpt/dpo")) == [10]
    dpo = [json.loads(line) for line in open(tmp_path / "runs/dpo/metrics.jsonl")]
    assert dpo[-1]["rewards/accuracies"] > 0.5, dpo[-1]

    # the exported model speaks the chat format: right answers to words never trained on
    assert "chat_template" in json.loads((tmp_path / "hf-dpo/tokenizer_config.json").read_text())
    after, hf_ids = _hf_answers(tmp_path / "hf-dpo", held_out)
    right = sum(a == example.answer(w) for a, w in zip(after, held_out))
    assert right >= 0.8 * len(held_out), list(zip(held_out, after))

    # meshtrain generate --chat gives transformers' tokens (greedy; the end of turn stops both)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf-dpo")
    for word, ids in list(zip(held_out, hf_ids))[:2]:
        out = run("generate", "--load", "ckpt/dpo", "--chat", "--prompt", f"upper {word}",
                  "--temperature", "0", "--max-new-tokens", "8", "--json")  # fmt: skip
        answer = json.loads(out)["completion"]
        assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>"), ids
        assert answer == tok.decode(ids[:-1]), (word, answer, ids)


def test_exported_logits_equal_meshtrain_on_a_chat_prompt(tmp_path):
    """The import → export round trip of a chat model keeps its template, and transformers'
    logits on `apply_chat_template`'s prompt equal meshtrain's on `generate --chat`'s (fp32
    CPU: 1e-4 absolute, the two attention implementations' summation order)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshtrain.services.checkpoint.convert import model_config, tensor_specs
    from meshtrain.services.checkpoint.hf.convert import export_hf, import_hf
    from meshtrain.services.checkpoint.reader import read_manifest
    from meshtrain.services.checkpoint.tokenizer_store import tokenizer_spec
    from meshtrain.services.dataloader.chat import end_of_turn_id, load_chat_template
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
    from meshtrain.services.trainer.checkpointing import load_checkpoint
    from meshtrain.services.trainer.generate import generate
    from meshtrain.services.trainer.model import GPT

    example = _example()
    _hf_model(tmp_path / "hf", example)
    root = str(tmp_path / "ckpt")
    import_hf(str(tmp_path / "hf"), root)
    export_hf(root, str(tmp_path / "out"))
    manifest = read_manifest(root, 0)
    spec = tokenizer_spec(root, 0, manifest["metadata"])
    assert (Path(spec).parent / "tokenizer_config.json").is_file()  # carried beside it
    ours = build_tokenizer(spec)
    template = load_chat_template("auto", ours)
    assert end_of_turn_id(template, ours) == ours.encode_with_special_tokens("<|im_end|>")[0]
    messages = [{"role": "user", "content": "upper abc"}]
    ids = ours.encode_with_special_tokens(template.render(messages, add_generation_prompt=True))

    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    theirs = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert theirs["input_ids"] == ids
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    model = GPT(model_config(manifest["metadata"], tensor_specs(manifest), root))
    load_checkpoint(root, model, step=0)
    model.eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        expected = hf(prompt).logits
        got = model(prompt)[..., : expected.shape[-1]]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    ours_out = generate(model, prompt, 6, temperature=0)
    # no stop on either side: six tokens each, the random model's greedy choices
    theirs_out = hf.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert ours_out.tolist() == theirs_out.tolist()
