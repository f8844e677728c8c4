"""Chat rendering, the assistant-only loss mask, bad rows and the SFT dataset files."""

import json
import random

import numpy as np
import pytest

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.chat import (
    BadRow,
    check_conversation,
    load_chat_template,
    render_conversation,
)
from meshtrain.services.dataloader.indexed import IndexedDataset
from meshtrain.services.dataloader.sft_data import (
    check_sft_tokenizer,
    open_sft_parts,
    preprocess_chat,
)
from meshtrain.services.dataloader.tokenizers.base import ByteTokenizer, build_tokenizer

from .chat_data import reverse_conversation, write_chat_tokenizer, write_chats

CONVERSATIONS = [
    [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "again, twice"},
        {"role": "assistant", "content": "ok ok"},
    ],
    [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "fine"}],
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(str(write_chat_tokenizer(tmp_path_factory.mktemp("tok") / "t")))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_ids_and_mask_match_transformers_apply_chat_template(tok, messages):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok.path.parent))
    want = hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = render_conversation(load_chat_template("auto", tok), tok, messages)
    assert ids == list(want["input_ids"])
    assert mask == list(want["assistant_masks"])
    assert sum(mask) > 0


def test_builtin_chatml_renders_as_the_tokenizers_own_chatml(tok):
    own, builtin = load_chat_template("auto", tok), load_chat_template("chatml", tok)
    for messages in CONVERSATIONS:
        assert builtin.render(messages) == own.render(messages)
        assert render_conversation(builtin, tok, messages) == render_conversation(
            own, tok, messages
        )


def test_the_mask_covers_exactly_the_answers_and_their_end_of_turn(tok):
    ids, mask = render_conversation(load_chat_template("chatml", tok), tok, CONVERSATIONS[1])
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "hello there<|im_end|>\nok ok<|im_end|>\n"
    assert tok.decode(ids[: mask.index(1)]).endswith("<|im_start|>assistant\n")


def test_llama3_needs_its_special_tokens(tok):
    with pytest.raises(DataError, match="llama3.*<\\|start_header_id\\|>"):
        load_chat_template("llama3", tok)


def test_a_tokenizer_without_a_chat_template_says_to_name_one(tmp_path):
    t = build_tokenizer(str(write_chat_tokenizer(tmp_path / "t", chat_template=None)))
    with pytest.raises(DataError, match="no chat_template.*--chat-template"):
        load_chat_template("auto", t)


def test_a_template_file_and_jinja_sandbox(tmp_path, tok):
    path = tmp_path / "t.jinja"
    path.write_text("{{ ''.__class__.__mro__ }}")
    template = load_chat_template(str(path), tok)
    with pytest.raises(BadRow, match="template"):  # the sandbox refuses attribute escapes
        template.render(CONVERSATIONS[0])
    path.write_text("{% if messages|length > 9 %}{{ raise_exception('too many') }}{% endif %}x")
    assert load_chat_template(str(path), tok).render(CONVERSATIONS[0]) == "x"


def test_a_template_that_breaks_the_prefix_property_is_a_clear_error(tmp_path, tok):
    # renders the number of messages first: no prefix of the conversation renders as its start
    path = tmp_path / "count.jinja"
    path.write_text(
        "{{ messages|length }}{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}"
    )
    template = load_chat_template(str(path), tok)
    with pytest.raises(BadRow, match="not a prefix") as e:
        render_conversation(template, tok, CONVERSATIONS[0])
    assert e.value.reason == "template_prefix"


def test_a_token_across_a_turn_boundary_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # one token per whitespace-separated word: "a:cba" spans the prompt and the answer
    tok_path = tmp_path / "w" / "tokenizer.json"
    tok_path.parent.mkdir()
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", "u:abc", "a:cba", "u:", "a:"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.save(str(tok_path))
    tok = build_tokenizer(str(tok_path))
    path = tmp_path / "plain.jinja"
    path.write_text(
        "{% for m in messages %}{{ m.role[0] }}:{{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    with pytest.raises(BadRow, match="tokenized one by one differ"):
        render_conversation(load_chat_template(str(path), tok), tok, CONVERSATIONS[0])


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"messages": []}, "empty"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant"),
        ({"messages": [{"role": "assistant", "content": ["x"]}]}, "non_string_content"),
        ({"messages": [{"role": "assistant"}]}, "bad_message"),
        ({"text": "x"}, "not_a_conversation"),
        ([1, 2], "not_a_conversation"),
    ],
)
def test_bad_conversations_name_their_reason(row, reason):
    with pytest.raises(BadRow) as e:
        check_conversation(row)
    assert e.value.reason == reason


def _rows(rng):
    good = [reverse_conversation(rng) for _ in range(5)]
    bad = [
        "{not json",
        {"messages": [{"role": "robot", "content": "beep"}]},
        {"messages": []},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
        {
            "messages": [
                {"role": "user", "content": "x" * 80},
                {"role": "assistant", "content": "y"},
            ]
        },
    ]
    return good[:2] + bad[:3] + good[2:] + bad[3:]


def test_bad_rows_stop_names_file_line_and_reason(tmp_path, tok):
    path = write_chats(tmp_path / "c.jsonl", _rows(random.Random(0)))
    with pytest.raises(DataError, match=r"c\.jsonl:3: invalid_json"):
        preprocess_chat([path], tmp_path / "ds", tok, template="chatml", max_tokens=64)
    assert not (tmp_path / "ds.bin").exists() and not (tmp_path / "ds_lossmask.idx").exists()


def test_bad_rows_drop_counts_each_reason_in_the_metadata(tmp_path, tok):
    path = write_chats(tmp_path / "c.jsonl", _rows(random.Random(0)))
    stats = preprocess_chat(
        [path], tmp_path / "ds", tok, template="chatml", max_tokens=64, bad_rows="drop"
    )
    want = {
        "invalid_json": 1,
        "unknown_role": 1,
        "empty": 1,
        "no_assistant": 1,
        "non_string_content": 1,
        "too_long": 1,
    }
    assert dict(stats.dropped) == want and stats.conversations == 5
    tokens, mask, meta = open_sft_parts(str(tmp_path / "ds"))
    assert meta["dropped"] == want and meta["conversations"] == 5
    assert meta["chat_template"] == "chatml" and meta["eod_id"] == tok.eod_id
    assert tokens.num_documents == 5 and mask.dtype == np.uint8
    for i in range(5):
        t, m = tokens[i], mask[i]
        assert t[-1] == tok.eod_id and m[-1] == 0  # each conversation ends with EOD, untrained
        assert len(t) <= 64 and m.sum() > 0
    check_sft_tokenizer(meta, tok, "ds")
    with pytest.raises(DataError, match="made with tokenizer"):
        check_sft_tokenizer(meta, ByteTokenizer(), "ds")


def test_mask_files_that_do_not_match_the_tokens_are_refused(tmp_path, tok):
    rng = random.Random(1)
    a = write_chats(tmp_path / "a.jsonl", [reverse_conversation(rng) for _ in range(4)])
    b = write_chats(tmp_path / "b.jsonl", [reverse_conversation(rng) for _ in range(4)])
    preprocess_chat([a], tmp_path / "a", tok, template="chatml")
    preprocess_chat([b], tmp_path / "b", tok, template="chatml")
    for ext in (".bin", ".idx"):  # b's mask beside a's tokens
        (tmp_path / f"a_lossmask{ext}").write_bytes((tmp_path / f"b_lossmask{ext}").read_bytes())
    if not np.array_equal(
        IndexedDataset(str(tmp_path / "a")).sequence_lengths,
        IndexedDataset(str(tmp_path / "b")).sequence_lengths,
    ):
        with pytest.raises(DataError, match="lengths"):
            open_sft_parts(str(tmp_path / "a"))
    (tmp_path / "a.sft.json").unlink()
    with pytest.raises(DataError, match="not an SFT dataset"):
        open_sft_parts(str(tmp_path / "a"))


def test_cli_preprocess_chat(tmp_path, tok, capsys):
    import argparse

    from meshtrain.services.dataloader.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    path = write_chats(tmp_path / "c.jsonl", _rows(random.Random(0)))
    args = parser.parse_args(
        ["data", "preprocess", "--chat", "--input", str(path), "--output-prefix",
         str(tmp_path / "ds"), "--tokenizer", str(tok.path.parent), "--seq-length", "63",
         "--bad-rows", "drop", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "5 conversations" in out and "dropped 1 rows: too_long" in out
    meta = json.loads((tmp_path / "ds.sft.json").read_text())
    assert meta["max_tokens"] == 64 and meta["chat_template"] == "tokenizer"
    args = parser.parse_args(
        ["data", "preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "x"),
         "--tokenizer", "byte", "--bad-rows", "drop"]
    )  # fmt: skip
    with pytest.raises(DataError, match="--bad-rows applies to chat data"):
        args.func(args)
