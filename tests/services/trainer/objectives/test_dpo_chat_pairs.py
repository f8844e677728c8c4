"""Conversational preference pairs (`meshtrain data preprocess-pairs --chat`): rendered with
the tokenizer's chat template as SFT renders chats, special tokens as their ids, the loss on
the answer and its end-of-turn marker only."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.chat import load_chat_template
from meshtrain.services.dataloader.preference import PreferencePairs, write_pairs
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture
def chat_tokenizer(tmp_path):
    spec = importlib.util.spec_from_file_location("sft_upper", REPO / "examples/sft_upper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return build_tokenizer(str(module.write_tokenizer(tmp_path / "tok")))


def _write(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_pairs_render_with_the_template(tmp_path, chat_tokenizer):
    tok = chat_tokenizer
    template = load_chat_template("auto", tok)
    row = {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "chosen": [{"role": "assistant", "content": "HI"}],
        "rejected": [{"role": "assistant", "content": "hi"}],
    }
    src = _write(tmp_path / "pairs.jsonl", row, {**row, "prompt": "hi"})
    summary = write_pairs(src, tmp_path / "p", tok, 64, chat_template=template)
    assert summary["pairs"] == 2 and summary["chat_template"] == "tokenizer"
    pairs = PreferencePairs(tmp_path / "p")
    special = tok.encode_with_special_tokens
    prompt = special(
        "<|im_start|>S\nbe brief<|im_end|>\n<|im_start|>U\nhi<|im_end|>\n<|im_start|>A\n"
    )
    chosen = special("HI<|im_end|>\n") + [tok.eod_id]
    rejected = special("hi<|im_end|>\n") + [tok.eod_id]
    assert pairs.data[0].tolist() == prompt + chosen and pairs.data[1].tolist() == prompt + rejected
    assert pairs.prompt_lengths[0] == len(prompt)
    short = special("<|im_start|>U\nhi<|im_end|>\n<|im_start|>A\n")  # a string prompt: the user's
    assert pairs.data[2].tolist() == short + chosen and pairs.prompt_lengths[2] == len(short)

    # without --chat a message list is refused, naming the option; a bad row names its line
    with pytest.raises(DataError, match="--chat"):
        write_pairs(src, tmp_path / "q", tok, 64)
    bad = _write(tmp_path / "bad.jsonl", row, {**row, "chosen": [{"role": "user", "content": "x"}]})
    with pytest.raises(DataError, match=r"bad.jsonl:2: bad_message"):
        write_pairs(bad, tmp_path / "r", tok, 64, chat_template=template)
