"""The tokenizer side of a Hugging Face export (`convert.py`): which tokenizer.json the run
used, its end-of-document id (written to config.json as bos/eos), and the
`tokenizer_config.json` that makes `AutoTokenizer` load it as a fast tokenizer, with the chat
template the tokenizer came with (its own tokenizer_config.json or chat_template.jinja, carried
beside it by the checkpoint), so `apply_chat_template` renders as training did. The files are read
with the tokenizer libraries directly (`services/common/tokenizer_files.py`), not through the
dataloader's tokenizers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from meshtrain.services.common.errors import CheckpointError, DataError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.common.tokenizer_files import (
    BYTE_EOD_ID,
    EOD_TOKEN,
    eos_token,
    gpt2bpe_tokenizer_json,
    spec_eod_id,
)

log = logging.getLogger(__name__)


# Specs of tokenizers with no tokenizer.json form: the export goes without one (EOD still known).
_NO_HF_FORM = ("tiktoken:", "sentencepiece:", "null:", "megatron-tiktoken:")
_NO_HF_SUFFIXES = (".tiktoken", ".model")


def _has_no_hf_form(spec: str) -> bool:
    return spec.startswith(_NO_HF_FORM) or spec.endswith(_NO_HF_SUFFIXES)


def tokenizer_file(spec: str | None, where: str) -> Path | None:
    """The tokenizer.json a run used, or None when it has none (the byte tokenizer, tiktoken,
    SentencePiece and null tokenizers). GPT-2's vocab.json + merges.txt (`gpt2bpe:` specs) are
    written as a tokenizer.json first, in a folder removed when the process ends."""
    if spec in (None, "byte"):
        if spec == "byte":
            log.warning(
                "%s: the byte tokenizer has no Hugging Face form; exporting without one", where
            )
        return None
    if spec.startswith("gpt2bpe:"):
        return _gpt2bpe_tokenizer_json(spec, where)
    if _has_no_hf_form(spec):
        log.warning(
            "%s: the tokenizer %r has no Hugging Face tokenizer.json form; exporting without one",
            where,
            spec,
        )
        return None
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{where}: the run's tokenizer {spec!r} is not a readable tokenizer.json "
            "here; pass the file with --tokenizer"
        )
    return path


def eod_id(path: Path | None, spec: str | None, model: ModelConfig, where: str) -> int | None:
    """The id of `<|endoftext|>`, the run's end of document: from the tokenizer file, 256 for
    the byte tokenizer (which ships no file), None when there is no tokenizer to ask.

    Raises:
        CheckpointError: the file is not a tokenizer.json, or it or the id is larger than the
            model's vocabulary (not this model's tokenizer).
    """
    if path is None:
        eod = BYTE_EOD_ID if spec == "byte" else None  # the byte tokenizer ships no file
        if spec is not None and _has_no_hf_form(spec):
            try:
                eod = spec_eod_id(spec)
            except DataError as e:
                log.warning(
                    "%s: cannot read the run's tokenizer %r (%s); exporting without its EOD id",
                    where,
                    spec,
                    e,
                )
    else:
        tokenizer = _load(path, where)
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if size > model.vocab_size:
            # its ids past the model's rows crash the exported model (IndexError in the embedding)
            raise CheckpointError(
                f"{where}: tokenizer {str(path)!r} has {size} tokens, more than the model's "
                f"vocabulary of {model.vocab_size}: it is not this model's tokenizer"
            )
        eod = tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:  # a model's own tokenizer: the run's EOD was its eos_token
            try:
                eos = eos_token(path.parent / "tokenizer_config.json")
            except DataError:
                eos = None
            eod = None if eos is None else tokenizer.token_to_id(eos)
    if eod is not None and model.vocab_size is not None and eod >= model.vocab_size:
        raise CheckpointError(
            f"{where}: tokenizer {str(path or spec)!r} has {EOD_TOKEN} at id {eod}, outside the "
            f"model's vocabulary of {model.vocab_size}: it is not this model's tokenizer"
        )
    return eod


def tokenizer_config(
    path: Path, model: ModelConfig, where: str, ids: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A `tokenizer_config.json` that makes `AutoTokenizer` load `tokenizer.json` as a fast
    tokenizer.

    Args:
        path: the tokenizer.json.
        model: the model (its sequence length is the tokenizer's model_max_length).
        where: names the checkpoint in errors.
        ids: the imported model's special-token ids ("bos_token_id", "eos_token_id" (one or a
            list: the first), "pad_token_id"), named as tokens here; None: `<|endoftext|>` is
            bos and eos where it is a special token.
    """
    tokenizer = _load(path, where)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.seq_length,
    }
    template = _own_config(path, where).get("chat_template")
    if template:  # the tokenizer's chat template goes with it: `apply_chat_template` reads it
        config["chat_template"] = template
    if ids is not None:
        for key, value in ids.items():
            first = value[0] if isinstance(value, list) and value else value
            token = None if not isinstance(first, int) else tokenizer.id_to_token(first)
            if token is not None:
                config[key.removesuffix("_id")] = token
        return config
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    if EOD_TOKEN in special:
        config.update(bos_token=EOD_TOKEN, eos_token=EOD_TOKEN)
    return config


def chat_template_file(path: Path) -> Path | None:
    """The `chat_template.jinja` beside the tokenizer.json `path` (transformers reads it before
    the config's `chat_template`), or None."""
    found = path.parent / "chat_template.jinja"
    return found if found.is_file() else None


def _own_config(path: Path, where: str) -> dict[str, Any]:
    """The tokenizer_config.json beside the tokenizer.json `path` (carried with it by the
    checkpoint), or {} when there is none."""
    found = path.parent / "tokenizer_config.json"
    if not found.is_file():
        return {}
    try:
        config = json.loads(found.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: {str(found)!r} is not valid JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def _load(path: Path, where: str) -> Any:
    """The `tokenizers.Tokenizer` in `path`, or CheckpointError naming the file."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(
            f"{where}: tokenizer {str(path)!r} is not a tokenizer.json ({e})"
        ) from e


def _gpt2bpe_tokenizer_json(spec: str, where: str) -> Path:
    """GPT-2's vocab.json + merges.txt of a `gpt2bpe:` spec as a tokenizer.json, with
    `<|endoftext|>` marked special (so transformers takes it for bos/eos)."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="meshtrain-gpt2bpe-")
    atexit.register(shutil.rmtree, folder, True)
    path = Path(folder) / "tokenizer.json"
    try:
        gpt2bpe_tokenizer_json(spec, path)
    except DataError as e:
        raise CheckpointError(
            f"{where}: the run's tokenizer {spec!r} cannot be read here ({e}); "
            "pass a tokenizer.json with --tokenizer"
        ) from None
    return path
