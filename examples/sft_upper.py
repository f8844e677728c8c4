"""Make a small supervised fine-tuning dataset: a chat format to learn, from nothing.

Each conversation asks to write a word of three letters in capitals ("user: upper abc" ->
"assistant: ABC"), rendered by the tokenizer's own chat template (ChatML with one-letter role
names) and a character-level tokenizer that has ChatML's special tokens. One word in five is
never used, so a trained model can be checked on prompts it has not seen.
Writes FOLDER/tokenizer/ (tokenizer.json + tokenizer_config.json with its chat_template),
FOLDER/chats.jsonl, and the SFT dataset FOLDER/train (`meshtrain data preprocess --chat`);
then `meshtrain train --config deploy/configs/sft-tiny.toml` fine-tunes a tiny model on it.

    python examples/sft_upper.py data/sft-upper
"""

from __future__ import annotations

import itertools
import json
import random
import string
import sys
from pathlib import Path

LETTERS = "abcdefgh"
WORD_LENGTH = 3
# ChatML with one-letter role names: short conversations, so many pack into each sequence
TEMPLATE = (
    "{% set names = {'system': 'S', 'user': 'U', 'assistant': 'A'} %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + names[message['role']] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>A\\n' }}{% endif %}"
)


def words(held_out: bool) -> list[str]:
    """The training words, or (held_out) the one word in five never trained on."""
    every = ["".join(w) for w in itertools.product(LETTERS, repeat=WORD_LENGTH)]
    return [w for i, w in enumerate(every) if (i % 5 == 0) == held_out]


def answer(word: str) -> str:
    """What the assistant should say to `upper WORD`."""
    return word.upper()


def conversation(word: str, rng: random.Random) -> dict:
    """One chat: an optional system message, the request, the word in capitals."""
    messages = [
        {"role": "user", "content": f"upper {word}"},
        {"role": "assistant", "content": answer(word)},
    ]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "be brief"})
    return {"messages": messages}


def write_tokenizer(folder: Path) -> Path:
    """A character-level tokenizer.json with ChatML's specials, and its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    chars = ["<unk>"] + list(string.ascii_letters + string.digits + " \n.,:;!?'-_()")
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def make_data(folder: str | Path, conversations: int = 3000, seed: int = 0) -> dict[str, str]:
    """Write the tokenizer, the chats and the SFT dataset under `folder`.

    Returns:
        {"tokenizer": its folder, "prefix": the SFT dataset, "chats": the JSONL file}.
    """
    from meshtrain.services.dataloader.sft_data import preprocess_chat
    from meshtrain.services.dataloader.tokenizers.base import build_tokenizer

    folder = Path(folder)
    tokenizer = write_tokenizer(folder / "tokenizer")
    rng = random.Random(seed)
    train = words(held_out=False)
    chats = folder / "chats.jsonl"
    with open(chats, "w") as f:
        for _ in range(conversations):
            f.write(json.dumps(conversation(rng.choice(train), rng)) + "\n")
    tok = build_tokenizer(str(tokenizer))
    preprocess_chat([chats], folder / "train", tok, template="auto", max_tokens=129)
    return {"tokenizer": str(tokenizer), "prefix": str(folder / "train"), "chats": str(chats)}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(make_data(sys.argv[1]))
