"""The rollout worker's core: one single-device policy, its version, and batched sampling of a
`RolloutRequest`'s prompts x group_size completions with a key/value cache. No gRPC here: the
service's `rpc/` converts messages and calls `RolloutEngine.generate` / `set_weights`.

The sampling itself is the trainer's `batched_sampling.sample_rows` (GRPO's colocated generator
runs it too): prompts of different lengths are left-padded into one batch; each row keeps its own
positions and its keys never include the padding, so a row's tokens and log-probs do not depend
on what else is in the batch. Each completion draws from its own generator, seeded by
`completion_seed(request seed + prompt index, sample index)`, the prompt index counted in the
caller's whole request: the result is a function of (weights, request) alone, however the
prompts are batched or spread over workers, and the same as the trainer's colocated generator
gives for the same weights and seed.

The log-prob of a sampled token is taken under the policy's full-vocabulary distribution at
temperature 1 (log_softmax of the raw logits), whatever temperature, top-k or top-p drew it:
that is the pi_theta(token | prefix) the policy-ratio loss compares with the trainer's own.

    engine = RolloutEngine(GPT(config), version=0, eod_id=0)
    completions = engine.generate(RolloutRequest(prompts=[[5, 6, 7]], group_size=4))
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from meshtrain.services.common.errors import InvalidRequestError, MeshtrainError
from meshtrain.services.rollout.types import Completion, RolloutRequest
from meshtrain.services.rollout.weights import check_weights
from meshtrain.services.trainer.batched_sampling import sample_rows
from meshtrain.services.trainer.decode_graphs import DecodeGraphs
from meshtrain.services.trainer.generate import context_length


class StaleWeightsError(MeshtrainError):
    """The request asks for a policy version newer than the worker holds (after the bounded
    wait). The gRPC shell answers FAILED_PRECONDITION; the client tries another worker."""


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask for, checked before anything is allocated."""

    max_prompts: int = 256
    max_prompt_tokens: int = 4096
    max_group_size: int = 64
    max_new_tokens: int = 4096
    max_completions: int = 4096
    """prompts x group_size."""
    max_batch_rows: int = 64
    """Rows decoded at once (larger requests run in several batches, with the same result)."""
    max_wait_s: float = 60.0
    """Longest a request waits for weights of its min_version before it is refused."""


def check_request(request: RolloutRequest, limits: Limits, context: int) -> None:
    """Raises InvalidRequestError naming the first field over its bound."""
    n = len(request.prompts)
    if n < 1 or n > limits.max_prompts:
        raise InvalidRequestError(f"prompts: {n} prompts, must be 1..{limits.max_prompts}")
    if not 1 <= request.group_size <= limits.max_group_size:
        raise InvalidRequestError(
            f"group_size must be 1..{limits.max_group_size}, got {request.group_size}"
        )
    if n * request.group_size > limits.max_completions:
        raise InvalidRequestError(
            f"prompts x group_size = {n * request.group_size} exceeds {limits.max_completions}"
        )
    new = request.sampling.max_new_tokens
    if new > limits.max_new_tokens:
        raise InvalidRequestError(f"max_new_tokens must be <= {limits.max_new_tokens}, got {new}")
    if request.min_version < 0:
        raise InvalidRequestError(f"min_version must be >= 0, got {request.min_version}")
    for i, prompt in enumerate(request.prompts):
        if not 1 <= len(prompt) <= limits.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompts[{i}]: {len(prompt)} tokens, must be 1..{limits.max_prompt_tokens}"
            )
        # the last sampled token is never fed back: it needs no position of its own
        if len(prompt) + new > context + 1:
            raise InvalidRequestError(
                f"prompts[{i}]: {len(prompt)} tokens + max_new_tokens {new} exceed the model's "
                f"{context} positions + 1"
            )


class RolloutEngine:
    """A policy on one device that samples completions; thread-safe.

    Generation and weight updates take one lock, so a request is answered by one version from
    its first token to its last, and an update is applied whole or not at all.
    """

    def __init__(
        self,
        model,
        version: int = 0,
        eod_id: int | None = None,
        limits: Limits | None = None,
        recent_results: int = 64,
        cuda_graphs: bool = True,
    ):
        """Args:
        model: a single-device GPT (its device and dtype are where sampling runs).
        version: the version of its current weights.
        eod_id: a completion stops after emitting this id (None: always max_new_tokens).
        limits: request bounds.
        recent_results: answers kept by request id, so a retried request is answered from
            memory rather than sampled again (0: none).
        cuda_graphs: on a CUDA device, replay each decode step as a captured CUDA graph
            (trainer/decode_graphs.py); weights are copied into the captured parameters, so the
            graphs stay valid across updates.
        """
        self.model = model.eval()
        self.eod_id = eod_id
        self.limits = limits or Limits()
        self._version = version
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # held while generating or applying weights
        self._recent: OrderedDict[str, list[Completion]] = OrderedDict()
        self._recent_max = recent_results
        self.graphs = DecodeGraphs(enabled=cuda_graphs)
        vocab = model.vocab_size
        if eod_id is not None and not 0 <= eod_id < vocab:
            raise InvalidRequestError(f"eod_id {eod_id} is outside the vocabulary of {vocab}")

    @property
    def version(self) -> int:
        return self._version

    @property
    def context(self) -> int:
        return context_length(self.model)

    def describe(self) -> dict:
        """What a client may want to know: model size, vocabulary, context, version."""
        c = self.model.config
        return {
            "version": self._version,
            "vocab_size": self.model.vocab_size,
            "context_length": self.context,
            "num_layers": c.num_layers,
            "hidden_size": c.hidden_size,
            "num_parameters": self.model.num_parameters(),
            "eod_id": -1 if self.eod_id is None else self.eod_id,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "device": str(next(self.model.parameters()).device),
        }

    # ---- weights -------------------------------------------------------------------------

    def set_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Make `tensors` (every parameter of the model, by name) the policy of `version`.

        All tensors are checked and converted first; only then, under the lock, copied in: a
        bad or partial update raises and leaves the current weights generating.

        Raises:
            InvalidRequestError: a missing, unknown or misshapen tensor, or a version older than
                the current one.
        """
        if version < self._version:
            raise InvalidRequestError(
                f"weights of version {version} are older than the worker's {self._version}"
            )
        params = dict(self.model.named_parameters())
        staged = check_weights(tensors, params, self.model.vocab_size)
        with self._lock:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(staged[name])
            with self._cond:
                self._version = version
                self._recent.clear()
                self._cond.notify_all()

    def load_checkpoint(self, root: str, step: int) -> None:
        """Load committed checkpoint `step` under `root` (any layout saved it); its version is
        `step`. Read whole before anything is applied."""
        from meshtrain.services.rollout.weights import read_checkpoint

        names = [name for name, _ in self.model.named_parameters()]
        self.set_weights(read_checkpoint(root, step, names), version=step)

    def wait_for_version(self, min_version: int, timeout_s: float) -> int:
        """Block until the weights reach `min_version` (at most `timeout_s` seconds).

        Raises:
            StaleWeightsError: still older after the wait.
        """
        deadline = time.monotonic() + max(0.0, min(timeout_s, self.limits.max_wait_s))
        with self._cond:
            while self._version < min_version:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StaleWeightsError(
                        f"the worker holds policy version {self._version}; the request needs "
                        f">= {min_version} (publish newer weights, or allow more staleness)"
                    )
                self._cond.wait(left)
            return self._version

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self, request: RolloutRequest, prompt_offset: int = 0, wait_s: float = 0.0
    ) -> list[Completion]:
        """`group_size` completions of each prompt, grouped by prompt, all of one version.

        Args:
            request: the prompts, group size, sampling and staleness bound.
            prompt_offset: the index of `request.prompts[0]` in the caller's whole request (its
                completions are seeded by that index: a request split over workers gives what
                one worker would); `Completion.prompt_index` stays local to `request`.
            wait_s: how long to wait for weights of `request.min_version`.

        Raises:
            InvalidRequestError: a field over its bound.
            StaleWeightsError: the weights stay older than `request.min_version`.
        """
        check_request(request, self.limits, self.context)
        if prompt_offset < 0:
            raise InvalidRequestError(f"prompt_offset must be >= 0, got {prompt_offset}")
        key = f"{request.request_id}@{prompt_offset}" if request.request_id else ""
        self.wait_for_version(request.min_version, wait_s)
        with self._lock:
            version = self._version
            if version < request.min_version:  # the wait's answer is re-read under the lock
                raise StaleWeightsError(
                    f"policy version {version} is older than min_version {request.min_version}"
                )
            if key and key in self._recent:
                return list(self._recent[key])
            rows = [(i, j) for i in range(len(request.prompts)) for j in range(request.group_size)]
            out: list[Completion] = []
            step = self.limits.max_batch_rows
            for start in range(0, len(rows), step):
                out += self._sample(request, rows[start : start + step], prompt_offset, version)
            if key and self._recent_max:
                self._recent[key] = out
                while len(self._recent) > self._recent_max:
                    self._recent.popitem(last=False)
            return list(out)

    def _sample(
        self,
        request: RolloutRequest,
        rows: list[tuple[int, int]],
        offset: int,
        version: int,
    ) -> list[Completion]:
        """Sample the completions of `rows` ((prompt, sample) pairs) as one left-padded batch."""
        sp = request.sampling
        sampled = sample_rows(
            self.model,
            [request.prompts[i] for i, _ in rows],
            [sp.seed + offset + i for i, _ in rows],
            [j for _, j in rows],
            sp.max_new_tokens,
            sp.temperature,
            sp.top_k,
            sp.top_p,
            self.eod_id,
            self.graphs,
        )
        return [
            Completion(i, s.tokens, s.logprobs, version, s.finished)
            for (i, _), s in zip(rows, sampled, strict=True)
        ]


def engine_from_checkpoint(
    root: str,
    step: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    eod_id: int | None = None,
    limits: Limits | None = None,
    version: int | None = None,
    cuda_graphs: bool = True,
) -> RolloutEngine:
    """A worker's engine: the model a committed checkpoint records, with its weights, on one
    device; its version is `version` (None: the step).

    Args:
        root: checkpoint root.
        step: which step (None: the newest committed).
        device: auto (cuda when there is one), cpu or cuda.
        dtype: auto (bfloat16 on cuda, float32 on cpu), float32 or bfloat16.
        eod_id: a completion ends after this token.
        limits: request bounds.
        version: the policy version the weights count as (None: the step).
        cuda_graphs: replay each decode step as a CUDA graph on a CUDA device.
    """
    from meshtrain.services.rollout.weights import checkpoint_config, read_checkpoint
    from meshtrain.services.trainer.model import GPT

    config, step = checkpoint_config(root, step)
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda: no CUDA device here")
    dev = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    wanted = dtype if dtype != "auto" else ("bfloat16" if dev.type == "cuda" else "float32")
    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device=dev).to(getattr(torch, wanted))
    if model.rope_cos is not None:  # buffers derived from the config: rebuild them off meta
        from meshtrain.services.trainer.model.rotary import rotary_tables

        cos, sin = rotary_tables(config)
        model.rope_cos, model.rope_sin = cos.to(dev), sin.to(dev)  # type: ignore[assignment]
    start = step if version is None else version
    engine = RolloutEngine(
        model, version=start, eod_id=eod_id, limits=limits, cuda_graphs=cuda_graphs
    )
    names = [name for name, _ in model.named_parameters()]
    engine.set_weights(read_checkpoint(root, step, names), version=start)
    return engine
