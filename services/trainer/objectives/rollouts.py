"""Where GRPO's completions come from: the colocated generator (the policy itself, in the
trainer's processes), or the rollout service's client, behind one `RolloutBackend` seam.

`ColocatedBackend` samples with the trainer's own model and a KV cache (`generate.py`'s
`forward_cached` and `filter_logits`), one prompt's group of G completions at a time. Under
tensor parallelism it runs the sharded model: every tp rank computes the same gathered logits
and draws from generators with the same seeds, so the ranks of a group sample the same tokens.
Completion j of prompt i of a request draws from its own generator, seeded with
`completion_seed(sampling.seed + i, j)` (`generate.draw_rows`, the rollout worker's rule too): a
caller that numbers prompts globally (seed = base + index of its first prompt) gets the same
completions however the prompts are split over data-parallel ranks or rollout workers, and the
rollout service gives the same completions as this generator for the same weights.

With `grpo.rollout = "service"` the backend is a `RolloutClient` built with the run's `auth`
settings and `grpo.max_staleness`; the trainer publishes its weights to it before each batch
(`publish.WeightsPublisher`).

    backend = rollout_backend(job, model, eod_id, device)
    completions = backend.generate(RolloutRequest(prompts, group_size=8, sampling=...))
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.rollout.types import Completion, RolloutBackend, RolloutRequest
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.generate import (
    KVCache,
    context_length,
    draw_rows,
    forward_cached,
    row_generators,
)

SERVICE_CLIENT = "meshtrain.services.rollout.rpc.client"


class ColocatedBackend:
    """A `RolloutBackend` on the trainer's own model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, eod_id: int, device: torch.device):
        self.model: Any = model  # a GPT (sharded under tp): layers, embedding, head
        self.eod_id, self.device = eod_id, device
        self.version = 0

    def update_weights(self, version: int) -> None:
        # the policy is the trainer's model itself: its weights are always the newest
        self.version = version

    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[Completion]:
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            out: list[Completion] = []
            for i, prompt in enumerate(request.prompts):
                out.extend(self._group(i, prompt, request))
            return out
        finally:
            self.model.train(was_training)

    def _group(self, index: int, prompt: list[int], request: RolloutRequest) -> list[Completion]:
        """The G completions of one prompt (a batch of G rows with the same prefix)."""
        s, g = request.sampling, request.group_size
        # the last sampled token is never fed back: it needs no position of its own
        steps = min(s.max_new_tokens, context_length(self.model) + 1 - len(prompt))
        if steps < 1:
            raise ConfigError(
                f"a prompt of {len(prompt)} tokens leaves no room in the model's "
                f"{context_length(self.model)} positions"
            )
        gens = row_generators([s.seed + index] * g, list(range(g)))
        rows = torch.tensor([prompt], device=self.device).expand(g, -1)  # (G, prompt)
        cache = KVCache(len(self.model.layers))
        logits = forward_cached(self.model, rows, cache)[:, -1].float()  # (G, vocab)
        done = torch.zeros(g, dtype=torch.bool, device=self.device)
        tokens, logps = [], []
        for step in range(steps):
            full = logits.log_softmax(-1)  # temperature 1, whole vocabulary: the loss's
            nxt = draw_rows(logits, s.temperature, s.top_k, s.top_p, gens)  # (G,)
            nxt = torch.where(done, torch.full_like(nxt, self.eod_id), nxt)
            tokens.append(nxt)
            logps.append(full.gather(-1, nxt[:, None]).squeeze(-1))
            done |= nxt == self.eod_id
            if step + 1 == steps or bool(done.all()):
                break
            logits = forward_cached(self.model, nxt[:, None], cache)[:, -1].float()
        toks = torch.stack(tokens, 1).tolist()  # (G, n)
        lps = torch.stack(logps, 1).tolist()
        out = []
        for row, lp in zip(toks, lps, strict=True):
            n = row.index(self.eod_id) + 1 if self.eod_id in row else len(row)
            finished = row[n - 1] == self.eod_id
            out.append(Completion(index, row[:n], lp[:n], self.version, finished))
        return out


def rollout_backend(
    job: JobConfig, model: torch.nn.Module, eod_id: int, device: torch.device
) -> RolloutBackend:
    """The backend `grpo.rollout` names: the colocated generator, or the rollout service's
    client (imported only then) with the run's token and TLS settings (`auth`, as for the data
    and checkpoint services) and `grpo.max_staleness`.

    Raises:
        ConfigError: rollout = 'service' where the rollout service is not installed.
    """
    g = job.grpo
    if g.rollout == "colocated":
        return ColocatedBackend(model, eod_id, device)
    if importlib.util.find_spec(SERVICE_CLIENT.rpartition(".")[0]) is None or (
        importlib.util.find_spec(SERVICE_CLIENT) is None
    ):
        raise ConfigError(
            "grpo.rollout='service': the rollout service is not installed (no "
            f"{SERVICE_CLIENT}); use grpo.rollout='colocated'"
        )
    client = importlib.import_module(SERVICE_CLIENT)
    from meshtrain.services.common.security import ClientSecurity

    return client.RolloutClient(
        list(g.rollout_addresses),
        ClientSecurity.from_config(job.auth),
        max_staleness=g.max_staleness,
        wait_s=g.rollout_wait_s,
        timeout_s=g.rollout_timeout_s,
    )
