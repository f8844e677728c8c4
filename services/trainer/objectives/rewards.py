"""Rule-based rewards for GRPO: loading reward functions by import path, scoring completions,
and two example functions (an exact-match answer and a format check).

A reward function is a plain Python callable, named in the config as `package.module:function`
(`grpo.reward_funcs`), called once per completion with keyword arguments:

    def reward(prompt: str, completion: str, **columns) -> float

`prompt` is the prompt's text (a `messages` row: its rendered chat), `completion` the sampled
text (decoded, without the EOD token), and `columns` every other column of the prompt's JSONL
row (e.g. `answer`). It returns a float; the rewards of several functions are summed with
`grpo.reward_weights`. A function should accept `**columns` it does not use, so one prompts
file can serve several functions.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from meshtrain.services.common.errors import ConfigError

RewardFn = Callable[..., float]


def load_reward_func(path: str) -> RewardFn:
    """The callable at `package.module:function`.

    Raises:
        ConfigError: the module does not import, or has no such callable.
    """
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"grpo.reward_funcs: cannot import {module_name!r} ({e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"grpo.reward_funcs: {module_name!r} has no function {name!r}")
    return fn


@dataclass
class Rewards:
    """The reward functions of a run, their names (TRL's: the function's __name__) and weights."""

    funcs: list[RewardFn]
    names: list[str]
    weights: list[float]

    @classmethod
    def load(cls, paths: list[str], weights: list[float] | None, model: bool = False) -> Rewards:
        """The functions at `paths`; none only beside a reward model (`model`)."""
        if not paths and not model:
            raise ConfigError("train.objective='grpo' needs grpo.reward_funcs or grpo.reward_model")
        funcs = [load_reward_func(p) for p in paths]
        return cls(funcs, [p.partition(":")[2] for p in paths], weights or [1.0] * len(paths))

    def score(self, prompt: str, completion: str, columns: dict) -> list[float]:
        """Each function's reward of one completion.

        Raises:
            ValueError: a function returned something that is not a finite-able number.
        """
        out = []
        for fn, name in zip(self.funcs, self.names, strict=True):
            value = fn(prompt=prompt, completion=completion, **columns)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"reward function {name} returned {value!r}, not a float")
            out.append(float(value))
        return out

    def total(self, per_func: list[float]) -> float:
        return sum(w * r for w, r in zip(self.weights, per_func, strict=True))


# ---------------------------------------------------------------- examples

_NUMBER = re.compile(r"-?\d+")


def exact_answer(prompt: str, completion: str, answer: str | int = "", **columns) -> float:
    """1.0 if the completion's first integer equals the row's `answer` and nothing but spaces
    surrounds it, 0.5 if its first integer is right but other text follows, else 0.0."""
    match = _NUMBER.search(completion)
    if match is None or match.group() != str(answer).strip():
        return 0.0
    return 1.0 if completion.strip() == match.group() else 0.5


def digits_only(prompt: str, completion: str, **columns) -> float:
    """A format check: 1.0 if the completion is a (signed) integer and nothing else, else 0.0."""
    return 1.0 if re.fullmatch(r"\s*-?\d+\s*", completion) else 0.0
