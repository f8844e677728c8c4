"""The user's meshtrain cache folder, shared by the services: the dataloader keeps its default
corpus, tokenizer and sample indices there, the checkpoint service the tokenizer files it unpacks
from checkpoints."""

from __future__ import annotations

import os


def user_cache_dir() -> str:
    """The user's cache folder for meshtrain: `$MESHTRAIN_CACHE`, else `$XDG_CACHE_HOME/meshtrain`,
    else `~/.cache/meshtrain`. Per user rather than per working directory, so the examples,
    `make run` and runs started from anywhere build the default corpus and tokenizer once."""
    explicit = os.environ.get("MESHTRAIN_CACHE")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(os.path.abspath(base), "meshtrain")
