"""What a rollout backend takes and returns, shared by the colocated generator (in the trainer's
processes) and the rollout service's client: a request for G completions of each prompt, the
completions with the log-probability of every sampled token, and the policy version that made
them. Plain dataclasses of Python ints and floats, no torch, so the service's wire form and the
trainer's loop agree on one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from meshtrain.services.common.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled (the same meaning as `meshtrain generate`'s flags)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    """Seed of the request's generator: the same request at the same policy version gives the
    same completions."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        from meshtrain.services.common.sampling import check_sampling

        check_sampling(self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class RolloutRequest:
    """G completions for each prompt, from a policy no older than `min_version`."""

    prompts: list[list[int]]
    """Token ids of each prompt (already rendered with the chat template, if any)."""
    group_size: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    min_version: int = 0
    """The oldest policy version whose completions the trainer accepts (staleness bound)."""
    request_id: str = ""
    """Names the request, so a retried one is answered once (exactly-once across workers)."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    """Index into `RolloutRequest.prompts`."""
    tokens: list[int]
    """The sampled token ids after the prompt (ending with EOD if the policy stopped)."""
    logprobs: list[float]
    """log p(token | prefix) of each sampled token under the policy that sampled it, at
    temperature 1 over the full vocabulary (the quantity the policy-ratio loss needs)."""
    policy_version: int
    """The version of the weights that produced it."""
    finished: bool
    """True if the completion ended with EOD, False if it hit max_new_tokens."""


class RolloutBackend(Protocol):
    """Something that turns prompts into completions: the colocated generator or a client of
    the rollout service. Both give, for the same weights, seed and request, the same tokens."""

    def generate(self, request: RolloutRequest) -> list[Completion]:
        """`group_size` completions per prompt, grouped by prompt (prompt 0's G, then 1's, ...)."""
        ...

    def update_weights(self, version: int) -> None:
        """Make the policy of version `version` (the trainer's current weights, published by
        the caller) the one that generates from now on."""
        ...
