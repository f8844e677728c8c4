"""The tokenizer side of a Hugging Face export (`services/checkpoint/hf.py`): which
tokenizer.json the run used, its end-of-document id (written to config.json as bos/eos), and
the `tokenizer_config.json` that makes `AutoTokenizer` load it as a fast tokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.dataloader.tokenizers import EOD_TOKEN, ByteTokenizer
from meshtrain.services.common.model_config import ModelConfig

log = logging.getLogger(__name__)


def tokenizer_file(spec: str | None, where: str) -> Path | None:
    """The tokenizer.json a run used, or None when it has none (the byte tokenizer)."""
    if spec in (None, "byte"):
        if spec == "byte":
            log.warning("%s: the byte tokenizer has no Hugging Face form; exporting without one", where)
        return None
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{where}: the run's tokenizer {spec!r} is not a readable tokenizer.json "
                              "here; pass the file with --tokenizer")
    return path


def eod_id(path: Path | None, spec: str | None, model: ModelConfig, where: str) -> int | None:
    """The id of `<|endoftext|>`, the run's end of document: from the tokenizer file, 256 for
    the byte tokenizer (which ships no file), None when there is no tokenizer to ask.

    Raises:
        CheckpointError: the file is not a tokenizer.json, or it or the id is larger than the
            model's vocabulary (not this model's tokenizer).
    """
    if path is None:
        eod = ByteTokenizer().eod_id if spec == "byte" else None  # the byte tokenizer ships no file
    else:
        tokenizer = _load(path, where)
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if size > model.vocab_size:
            # its ids past the model's rows crash the exported model (IndexError in the embedding)
            raise CheckpointError(f"{where}: tokenizer {str(path)!r} has {size} tokens, more than the model's "
                                  f"vocabulary of {model.vocab_size}: it is not this model's tokenizer")
        eod = tokenizer.token_to_id(EOD_TOKEN)
    if eod is not None and eod >= model.vocab_size:
        raise CheckpointError(f"{where}: tokenizer {str(path or spec)!r} has {EOD_TOKEN} at id {eod}, outside the "
                              f"model's vocabulary of {model.vocab_size}: it is not this model's tokenizer")
    return eod


def tokenizer_config(path: Path, model: ModelConfig, where: str) -> dict[str, Any]:
    """A `tokenizer_config.json` that makes `AutoTokenizer` load `tokenizer.json` as a fast tokenizer."""
    special = {t.content for t in _load(path, where).get_added_tokens_decoder().values() if t.special}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "model_max_length": model.seq_length}
    if EOD_TOKEN in special:
        config.update(bos_token=EOD_TOKEN, eos_token=EOD_TOKEN)
    return config


def _load(path: Path, where: str) -> Any:
    """The `tokenizers.Tokenizer` in `path`, or CheckpointError naming the file."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"{where}: tokenizer {str(path)!r} is not a tokenizer.json ({e})") from e
