"""GRPO's prompts: a JSONL file read and tokenized once, served in a seeded order.

Each row is `{"prompt": "...", ...}` (the text used as is) or `{"messages": [...], ...}`
(rendered with the chat template `data.chat_template`, the assistant's turn opened); its other
columns go to the reward functions. The prompts are laid out as an endless stream, each epoch a
permutation drawn from (seed, epoch); the prompts of batch k are the stream's
[k P, (k + 1) P) and data-parallel rank r takes the r-th of dp equal slices of them. So the
prompts of (step, rank) are a pure function of the file, the seed and the sizes, and a resumed
run reads what an unbroken one would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.chat import load_chat_template
from meshtrain.services.dataloader.tokenizers.base import Tokenizer


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text (as rendered), token ids and the row's other columns."""

    text: str
    ids: list[int]
    columns: dict


class PromptSet:
    """The prompts of a JSONL file (see the module docstring)."""

    def __init__(self, prompts: list[Prompt], seed: int):
        if not prompts:
            raise DataError("grpo.prompts_path holds no prompts")
        self.prompts, self.seed = prompts, seed
        self._orders: dict[int, np.ndarray] = {}

    @classmethod
    def read(
        cls, path: str | Path, tokenizer: Tokenizer, chat_template: str, seed: int
    ) -> PromptSet:
        """Read and tokenize `path`.

        Raises:
            DataError: a missing file, a row that is not JSON, has neither `prompt` nor
                `messages`, or renders to no tokens.
        """
        path = Path(path)
        if not path.is_file():
            raise DataError(f"grpo.prompts_path {path} does not exist")
        template = None
        prompts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
                raise DataError(f"{path}:{n}: a row needs exactly one of 'prompt' or 'messages'")
            if "prompt" in row:
                text = row.pop("prompt")
                if not isinstance(text, str):
                    raise DataError(f"{path}:{n}: 'prompt' must be a string")
                ids = tokenizer.encode(text)
            else:
                messages = row.pop("messages")
                # a prompt ends before the assistant's answer: SFT's check (an assistant turn
                # to train on) does not apply
                if not messages or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in messages
                ):
                    raise DataError(
                        f"{path}:{n}: 'messages' must be a non-empty list of "
                        "{'role': str, 'content': str}"
                    )
                if template is None:
                    template = load_chat_template(chat_template, tokenizer)
                text = template.render(messages, add_generation_prompt=True)
                ids = tokenizer.encode_with_special_tokens(text)
            if not ids:
                raise DataError(f"{path}:{n}: the prompt has no tokens")
            prompts.append(Prompt(text, ids, row))
        return cls(prompts, seed)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def longest(self) -> int:
        return max(len(p.ids) for p in self.prompts)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(len(self.prompts))}  # keep one epoch
        return self._orders[epoch]

    def indices(self, batch: int, per_batch: int, dp_rank: int, dp_size: int) -> list[int]:
        """Indices into the file of data-parallel rank `dp_rank`'s prompts of batch `batch`,
        which holds `per_batch` prompts over all ranks."""
        share = per_batch // dp_size
        start = batch * per_batch + dp_rank * share
        out = []
        for k in range(start, start + share):
            epoch, i = divmod(k, len(self.prompts))
            out.append(int(self._order(epoch)[i]))
        return out
