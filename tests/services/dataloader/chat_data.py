"""Small chat data for the SFT tests: a character-level Hugging Face tokenizer with ChatML's
special tokens and chat template, and conversations of a synthetic instruction format."""

import json
import random
import string
from pathlib import Path

# ChatML with transformers' `{% generation %}` marks around each answer (its content, its
# <|im_end|> and the newline after it), so `return_assistant_tokens_mask` can be compared.
CHATML_WITH_GENERATION = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_chat_tokenizer(folder: Path, chat_template: str | None = CHATML_WITH_GENERATION) -> Path:
    """A character-level tokenizer.json (one id per character) with ChatML's specials and,
    beside it, a tokenizer_config.json holding `chat_template`. Returns the tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    chars = ["<unk>"] + list(string.ascii_letters + string.digits + " \n.,:;!?'-_()[]{}/")
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def reverse_conversation(rng: random.Random, letters: str = "abcdefgh", size=(3, 5)) -> dict:
    """`user: reverse WORD` -> `assistant: DROW`, sometimes after a system message."""
    word = "".join(rng.choice(letters) for _ in range(rng.randint(*size)))
    messages = [
        {"role": "user", "content": f"reverse {word}"},
        {"role": "assistant", "content": word[::-1]},
    ]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "be brief"})
    return {"messages": messages}


def write_chats(path: Path, rows: list) -> Path:
    """One JSON line per row (a dict is dumped, a str written as it is)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
