"""Sampling: the KV-cache decode against full recomputation, the filters,
and `meshtrain generate`."""

import json
import os
import subprocess
import sys

import pytest
import torch

import meshtrain
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.dataloader.config import DataConfig
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.generate import KVCache, filter_logits, forward_cached, generate
from meshtrain.services.trainer.model import GPT
from tests.services.trainer.model.test_gpt import (
    GPT2,
    LLAMA,
    build,
)  # the model tests' two tiny shapes


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama-gqa"])
def test_cached_decode_matches_full_recompute(kw):
    model = build(**kw)
    prompt = torch.randint(0, 301, (2, 5))
    out = generate(model, prompt, 20, temperature=0)
    assert out.shape == (2, 25)
    # Reference: greedy with the whole sequence recomputed each step by the training forward.
    ref = prompt
    with torch.no_grad():
        for _ in range(20):
            ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    # And the logits of every position agree (fp32 CPU: within 1e-5 absolute).
    cache = KVCache(len(model.layers))
    steps = [forward_cached(model, out[:, :5], cache)]
    for i in range(5, out.shape[1]):
        steps.append(forward_cached(model, out[:, i : i + 1], cache))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(steps, dim=1), model(out), atol=1e-5, rtol=1e-5)


def test_top_k_one_is_greedy_and_seed_repeats():
    model = build(**LLAMA)
    prompt = torch.randint(0, 301, (1, 4))
    greedy = generate(model, prompt, 10, temperature=0)
    assert torch.equal(generate(model, prompt, 10, temperature=1.0, top_k=1), greedy)
    a = generate(model, prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = generate(model, prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)[0, 2:]).all()
    assert not torch.isinf(filter_logits(logits, top_k=2)[0, :2]).any()
    # softmax mass of the best one is ~0.64, so p=0.5 keeps only it, p=0.9 the best two/three.
    assert torch.isinf(filter_logits(logits, top_p=0.5)[0, 1:]).all()
    assert not torch.isinf(filter_logits(logits, top_p=0.9)[0, :2]).any()


def test_stops_at_context_length():
    model = build(**GPT2)
    out = generate(model, torch.randint(0, 301, (1, 30)), 10, temperature=0)
    assert out.shape == (1, 32)


def test_exported():
    assert meshtrain.generate is generate


TEXT = "the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def trained_root(tmp_path_factory):
    """A tiny byte-level model that has memorized TEXT, saved as a committed checkpoint."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=64,
        vocab_size=257,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.tensor([list(TEXT.encode())])
    for _ in range(300):
        loss = model(
            ids[:, :-1], labels=ids[:, 1:], loss_mask=torch.ones_like(ids[:, 1:], dtype=torch.float)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    meshtrain.save_checkpoint(
        root, 300, model, opt, job=JobConfig(model=cfg, data=DataConfig(tokenizer="byte"))
    )
    return root


def cli(*args):
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "meshtrain", "generate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.e2e
def test_cli_reproduces_memorized_text(trained_root):
    n = len(TEXT) - 10
    r = cli(
        "--load",
        trained_root,
        "--prompt",
        TEXT[:10],
        "--temperature",
        "0",
        "--max-new-tokens",
        str(n),
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == TEXT + "\n"
    r = cli(
        "--load",
        trained_root,
        "--prompt",
        TEXT[:10],
        "--top-k",
        "1",
        "--max-new-tokens",
        str(n),
        "--device",
        "cpu",
    )
    assert r.stdout == TEXT + "\n"


@pytest.mark.e2e
def test_cli_seed_repeats(trained_root):
    args = (
        "--load",
        trained_root,
        "--prompt",
        "the",
        "--temperature",
        "2",
        "--seed",
        "7",
        "--max-new-tokens",
        "20",
        "--device",
        "cpu",
    )
    a, b = cli(*args), cli(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args, word",
    [
        (("--prompt", "x"), "no committed checkpoint"),
        (("--prompt", "x", "--temperature", "-1"), "temperature"),
        (("--prompt", "x", "--top-p", "0"), "top_p"),
        (("--prompt", "x", "--top-p", "1.5"), "top_p"),
        (("--prompt", "x", "--system", "be brief"), "need --chat"),
    ],
)
def test_cli_bad_input(tmp_path, args, word):
    r = cli("--load", str(tmp_path), *args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and word in lines[0], r.stderr


@pytest.mark.e2e
def test_samples_are_separated_by_a_header_line_or_printed_as_json(trained_root, capsys):
    from meshtrain.services.cli import main

    args = ["generate", "--load", trained_root, "--prompt", TEXT[:10], "--device", "cpu"]
    args += ["--temperature", "0", "--max-new-tokens", "5", "--num-samples", "2"]
    assert main(args) == 0
    sample = TEXT[:15]
    assert capsys.readouterr().out == (
        f"--- sample 1 of 2 ---\n{sample}\n--- sample 2 of 2 ---\n{sample}\n"
    )
    assert main([*args, "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [
        {"sample": i, "text": sample, "completion": TEXT[10:15]} for i in (1, 2)
    ]


def test_cached_decode_with_images_matches_full_recompute(tmp_path):
    """A vision-language model's images are part of the prefill: greedy decoding with the KV
    cache equals recomputing the whole sequence, images included, at every step; without the
    images, or with another image, the continuation's logits differ. The image goes through the
    data side's decoding and normalization (image_prompt.py)."""
    from PIL import Image

    from meshtrain.services.common.model_config import VisionConfig
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
    from meshtrain.services.trainer.image_prompt import expand_prompt, load_images

    vision = VisionConfig(
        image_size=16, patch_size=8, hidden_size=16, num_layers=2, num_attention_heads=2,
        ffn_hidden_size=32, image_token_id=257,
    )  # fmt: skip
    model = build(**{**LLAMA, "vision": vision, "vocab_size": 301})
    paths = []
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.new("RGB", (24, 20), colour).save(paths[-1])
    tok = build_tokenizer("byte")
    ids = expand_prompt("Look: <image> and <image>?", 2, tok, vision)
    assert ids.count(257) == 2 * 4 and ids[:6] == tok.encode("Look: ")
    images = load_images(paths, vision)  # (2, 3, 16, 16), CLIP-normalized
    assert images.shape == (2, 3, 16, 16)
    prompt = torch.tensor([ids, ids])  # two rows: the images of each, row by row
    both = images.repeat(2, 1, 1, 1)
    out = generate(model, prompt, 8, temperature=0, images=both)
    ref = prompt
    with torch.no_grad():
        for _ in range(8):
            nxt = model(ref, images=both)[:, -1].argmax(-1, keepdim=True)
            ref = torch.cat([ref, nxt], dim=1)
    assert torch.equal(out, ref)
    with torch.no_grad():
        seen = forward_cached(model, prompt, KVCache(len(model.layers)), both)[:, -1]
        other = forward_cached(model, prompt, KVCache(len(model.layers)), both.flip(0))[:, -1]
    assert not torch.allclose(seen, other)
    with pytest.raises(ValueError, match="placeholder"):
        generate(model, prompt, 2, temperature=0, images=images)  # 2 images for 4 placeholders
    with pytest.raises(ConfigError, match="1 <image> tags for 2"):
        expand_prompt("<image>", 2, tok, vision)


@pytest.mark.e2e
def test_chat_needs_a_template_and_stops_at_the_end_of_turn(trained_root, capsys):
    """The byte tokenizer has no chat template of its own: --chat says so; a built-in one
    renders (its markers are bytes, so only the end of document stops the answer)."""
    from meshtrain.services.cli import main

    args = ["generate", "--load", trained_root, "--prompt", "the", "--device", "cpu", "--chat"]
    assert main(args) == 2
    assert "no chat_template" in capsys.readouterr().err
    assert main([*args, "--chat-template", "chatml", "--temperature", "0", "--json"]) == 0
    (sample,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sample["text"] == sample["completion"] and "<|im_start|>" not in sample["text"]
    assert generate(build(**LLAMA), torch.tensor([1, 2]), 5, temperature=0, eod_id=[]).shape == (7,)
