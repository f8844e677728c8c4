"""The dataloader's config section (`[data]`): where training tokens come from.

The trainer's job config embeds it; the data service will take the same section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.errors import ConfigError, NotBuiltError


@dataclass
class DataConfig:
    """Where training tokens come from."""

    data_path: list[str] = field(default_factory=list)
    """Indexed dataset prefix (PREFIX.bin/.idx); empty: the embedded default corpus."""
    tokenizer: str = "bpe"
    """'bpe' (trained on the default corpus), 'byte', or a path to a tokenizer.json."""
    default_vocab_size: int = 4096
    """Vocabulary of the BPE trained for the embedded default corpus."""
    default_corpus_bytes: int = 8_000_000
    """How much of the Python standard library's source the default corpus takes."""
    split: str = "969,30,1"
    """Train/valid/test weights over documents, Megatron style."""
    cache_dir: str = ".cache/meshtrain"
    """Where the default corpus, its tokenizer and its dataset are built and cached."""

    def __post_init__(self) -> None:
        if len(self.data_path) > 1:
            raise NotBuiltError(
                f"data.data_path lists {len(self.data_path)} entries; blending several "
                "datasets by weight is not built yet: give one PREFIX"
            )
        if self.data_path and self.tokenizer == "bpe":
            raise ConfigError(
                "data.tokenizer='bpe' means the BPE trained for the embedded corpus; with "
                "data.data_path give 'byte' or the tokenizer.json the dataset was built with"
            )
