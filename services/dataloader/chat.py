"""Chat conversations into token ids and an assistant-only loss mask (supervised fine-tuning).

A conversation is one JSONL line, `{"messages": [{"role": ..., "content": ...}, ...]}` (the
Hugging Face datasets format; the key is configurable), roles `system`, `user`, `assistant`.
It is rendered by a chat template: the tokenizer's own (`chat_template` of the
`tokenizer_config.json`, or `chat_template.jinja`, beside its tokenizer.json), rendered with
jinja2 in a sandbox as transformers' `apply_chat_template` does (`messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `tojson`, and the
`{% generation %}` tag accepted), or a built-in one (`chatml`, `llama3`), or a `.jinja` file.

The loss mask is found by rendering prefixes: the text through the generation prompt before
assistant message i, and through message i itself, bound that message's answer (its content
and end-of-turn marker). Every prefix must be a prefix of the whole rendering, and the segments
between those boundaries, tokenized one by one, must concatenate to the tokens of the whole
text (the token prefix property); a template or tokenizer that breaks either is reported, never
guessed around. `render_conversation` returns (ids, mask) with mask 1 on the assistant answers'
tokens. `check_conversation` names what is wrong with a row (`BadRow`, with a reason key).
`end_of_turn_id` is the token that closes an answer, where generation stops.

    template = load_chat_template("auto", tokenizer)
    ids, mask = render_conversation(template, tokenizer, messages)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.tokenizers.base import Tokenizer

ROLES = ("system", "user", "assistant")

# ChatML (OpenAI; Qwen, SmolLM, ...): the answer is the content and `<|im_end|>\n`.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3's turn format (without its default system prompt of dates).
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
# special tokens a built-in template needs as single ids of a tokenizer that has specials
_BUILTIN_SPECIALS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}
_BUILTIN_BOS = {"llama3": "<|begin_of_text|>"}


class BadRow(Exception):
    """A conversation that cannot be used; `reason` is a short key counted by the drop policy."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    name: str  # "chatml", "llama3", "tokenizer" or the .jinja path
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @property
    def digest(self) -> str:
        """SHA-256 of the template text and its tokens: recorded with a dataset."""
        blob = json.dumps([self.source, self.bos_token, self.eos_token]).encode()
        return hashlib.sha256(blob).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for `messages` (and the next assistant header if asked)."""
        import jinja2

        try:
            return _compile(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise BadRow("template_error", f"chat template {self.name!r} failed: {e}") from e


_COMPILED: dict[str, object] = {}


def _compile(source: str):
    """A jinja2 template in an immutable sandbox with transformers' globals and filters."""
    if source in _COMPILED:
        return _COMPILED[source]
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant marker): rendered
        as its body; the mask here comes from the prefixes, which works with or without it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"chat template does not compile: {e} (line {e.lineno})") from e
    _COMPILED[source] = compiled
    return compiled


def _token_text(value) -> str:
    if isinstance(value, dict):  # an AddedToken written out: {"content": "</s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tokenizer_config(tokenizer: Tokenizer) -> tuple[Path | None, dict]:
    """(folder, tokenizer_config.json) of a Hugging Face tokenizer; (None, {}) for others."""
    path = getattr(tokenizer, "path", None)
    if path is None or Path(path).suffix != ".json":
        return None, {}
    folder = Path(path).parent
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return folder, {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{config_path}: not valid JSON ({e})") from None
    return folder, config if isinstance(config, dict) else {}


def load_chat_template(template: str, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template to render conversations with.

    Args:
        template: "auto" (the tokenizer's own: `chat_template.jinja` or the `chat_template` of
            `tokenizer_config.json` beside its tokenizer.json; a named list picks "default"),
            a built-in name ("chatml", "llama3"), or the path of a `.jinja` file.
        tokenizer: the tokenizer the rendered text is encoded with.

    Returns:
        A ChatTemplate with the tokenizer's bos/eos tokens.

    Raises:
        DataError: no template found, a built-in whose special tokens the tokenizer lacks, or
            a template that does not compile.
    """
    folder, config = _tokenizer_config(tokenizer)
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    if template == "auto":
        source = None
        if folder is not None and (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            where = f"{folder}/tokenizer_config.json" if folder else f"tokenizer {tokenizer.spec}"
            raise DataError(
                f"{where} has no chat_template; name one: --chat-template "
                f"{' or '.join(BUILTIN_TEMPLATES)} or a .jinja file"
            )
        name = "tokenizer"
    elif template in BUILTIN_TEMPLATES:
        source, name = BUILTIN_TEMPLATES[template], template
        if tokenizer.name != "byte":  # the byte tokenizer has no specials: markers are text
            missing = [
                t
                for t in _BUILTIN_SPECIALS[template]
                if len(tokenizer.encode_with_special_tokens(t)) != 1
            ]
            if missing:
                raise DataError(
                    f"chat template {template!r} needs the special tokens {missing}, which "
                    f"tokenizer {tokenizer.spec} does not have as single tokens"
                )
        bos = _BUILTIN_BOS.get(template, bos)
    else:
        path = Path(template)
        if not path.is_file():
            raise DataError(
                f"chat template {template!r} is neither 'auto', a built-in "
                f"({', '.join(BUILTIN_TEMPLATES)}) nor an existing .jinja file"
            )
        source, name = path.read_text(encoding="utf-8"), str(path)
    if not eos:
        eos = tokenizer.decode([tokenizer.eod_id]) if tokenizer.name != "byte" else ""
    out = ChatTemplate(name, source, bos, eos)
    _compile(source)  # a syntax error is reported now, not at the first row
    return out


def check_conversation(row, messages_key: str = "messages", need_answer: bool = True) -> list[dict]:
    """The messages of one parsed JSONL row, validated (`need_answer` false: a prompt, which
    may have no assistant message).

    Raises:
        BadRow: not an object with a list under `messages_key` ("not_a_conversation"), no
            messages ("empty"), a message that is not {role, content} ("bad_message"), an
            unknown role ("unknown_role"), non-string content ("non_string_content"), or no
            assistant message ("no_assistant").
    """
    if not isinstance(row, dict) or messages_key not in row:
        raise BadRow("not_a_conversation", f"no {messages_key!r} key in the row")
    messages = row[messages_key]
    if not isinstance(messages, list):
        raise BadRow("not_a_conversation", f"{messages_key!r} is not a list of messages")
    if not messages:
        raise BadRow("empty", "the conversation has no messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadRow("bad_message", f"message {i} is not an object with role and content")
        if m["role"] not in ROLES:
            raise BadRow("unknown_role", f"message {i} has role {m['role']!r}, not one of {ROLES}")
        if not isinstance(m["content"], str):
            raise BadRow(
                "non_string_content",
                f"message {i} ({m['role']}) has {type(m['content']).__name__} content, "
                "not a string",
            )
    if need_answer and not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant", "the conversation has no assistant message to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render_conversation(
    template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict]
) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its loss mask (1 on the assistant answers' tokens).

    Args:
        template: the chat template.
        tokenizer: the tokenizer (special tokens in the rendering become their ids).
        messages: validated messages (`check_conversation`).

    Returns:
        (ids, mask), equal lengths; mask[j] is 1 iff token j belongs to an assistant answer.

    Raises:
        BadRow: "template_prefix": a prefix's rendering is not a prefix of the whole, or the
            tokens of the segments between turns do not concatenate to the whole's tokens.
    """
    full = template.render(messages)
    # (char offset, mask of the text before it since the previous edge): each answer runs from
    # the end of the generation prompt before it to the end of the rendering through it
    edges: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = template.render(messages[:i], add_generation_prompt=True)
        end = template.render(messages[: i + 1])
        for prefix, what in ((start, "the generation prompt before"), (end, "the end of")):
            if not full.startswith(prefix):
                raise BadRow(
                    "template_prefix",
                    f"chat template {template.name!r}: the rendering through {what} message {i} "
                    "is not a prefix of the whole conversation's (it renders earlier turns "
                    "differently as the conversation grows); use a template that does not",
                )
        if len(start) < (edges[-1][0] if edges else 0) or len(end) <= len(start):
            raise BadRow(
                "template_prefix",
                f"chat template {template.name!r}: assistant message {i} renders to no text "
                "after the generation prompt before it",
            )
        edges += [(len(start), 0), (len(end), 1)]
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for offset, trained in edges + [(len(full), 0)]:
        piece = tokenizer.encode_with_special_tokens(full[pos:offset]) if offset > pos else []
        ids += piece
        mask += [trained] * len(piece)
        pos = offset
    whole = tokenizer.encode_with_special_tokens(full)
    if whole != ids:
        raise BadRow(
            "template_prefix",
            f"tokenizer {tokenizer.spec}: the turns of chat template {template.name!r} tokenized "
            "one by one differ from the whole conversation tokenized at once (a token spans a "
            "turn boundary), so the assistant tokens cannot be told apart",
        )
    return ids, mask


def end_of_turn_id(template: ChatTemplate, tokenizer: Tokenizer) -> int | None:
    """The special token that closes an assistant turn in `template` (`<|im_end|>` in ChatML,
    `<|eot_id|>` in Llama 3): the first token the template writes after an answer's content,
    where it is a special token of `tokenizer`. None when the template ends a turn with plain
    text (or nothing): then only the end of document stops a generated answer.

    Raises:
        BadRow: the template fails to render a one-turn conversation.
    """
    probe = "Hello"
    asked = [{"role": "user", "content": "Hi"}]
    start = template.render(asked, add_generation_prompt=True)
    full = template.render([*asked, {"role": "assistant", "content": probe}])
    if not full.startswith(start) or probe not in full[len(start) :]:
        return None
    after = full[len(start) :].split(probe, 1)[1]
    special = tokenizer.encode_with_special_tokens(after)
    plain = tokenizer.encode(after)
    # a marker that is a special token encodes differently when specials are parsed
    if not special or special[:1] == plain[:1]:
        return None
    return special[0]
