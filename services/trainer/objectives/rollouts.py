"""Where GRPO's completions come from: the colocated generator (the policy itself, in the
trainer's processes), or the rollout service's client, behind one `RolloutBackend` seam.

`ColocatedBackend` samples with the trainer's own model (`batched_sampling.sample_rows`, the rollout
worker's sampler too): every prompt's group of G completions of a request in one left-padded
batch with a static key/value cache (or in batches of `grpo.rollout_max_batch` completions),
under the trainer's autocast (bf16 with train.bf16), each decode step replayed as a CUDA graph
on a GPU (`grpo.rollout_cuda_graphs`). Its log-probs are reported but the loss
does not use them: GRPO's old log-probs are the trainer's forward's (objectives/grpo.py). Under
tensor parallelism it runs the sharded model: every tp rank computes the same gathered logits
and draws from generators with the same seeds, so the ranks of a group sample the same tokens.
Completion j of prompt i of a request draws from its own generator, seeded with
`completion_seed(sampling.seed + i, j)` (`generate.row_generators`, the rollout worker's rule): a
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

import contextlib
import importlib
import importlib.util
from contextlib import AbstractContextManager
from typing import Any

import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.rollout.types import Completion, RolloutBackend, RolloutRequest
from meshtrain.services.trainer.batched_sampling import sample_rows
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.decode_graphs import DecodeGraphs

SERVICE_CLIENT = "meshtrain.services.rollout.rpc.client"


class ColocatedBackend:
    """A `RolloutBackend` on the trainer's own model (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        eod_id: int,
        device: torch.device,
        autocast: AbstractContextManager[Any] | None = None,
        max_batch: int = 256,
        cuda_graphs: bool = True,
    ):
        """Args:
        model: the policy (a GPT, sharded under tp).
        eod_id: a completion ends after this token.
        device: where the model is.
        autocast: the trainer's autocast (bf16 with train.bf16), entered while sampling.
        max_batch: completions decoded as one batch (grpo.rollout_max_batch).
        cuda_graphs: replay each decode step as a CUDA graph on a CUDA device
            (grpo.rollout_cuda_graphs). The optimizer updates the parameters in place, so the
            graphs read each step's weights; a parameter given new storage drops them.
        """
        if max_batch < 1:
            raise ConfigError(f"grpo.rollout_max_batch must be >= 1, got {max_batch}")
        self.model: Any = model  # a GPT (sharded under tp): layers, embedding, head
        self.eod_id, self.device = eod_id, device
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        self.max_batch = max_batch
        self.version = 0
        # a full batch and the remainder: at most two shapes a run's rollouts come in
        self.graphs = DecodeGraphs(max_graphs=2, enabled=cuda_graphs)

    def update_weights(self, version: int) -> None:
        # the policy is the trainer's model itself: its weights are always the newest
        self.version = version

    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[Completion]:
        s = request.sampling
        rows = [(i, j) for i in range(len(request.prompts)) for j in range(request.group_size)]
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            out: list[Completion] = []
            for start in range(0, len(rows), self.max_batch):
                chunk = rows[start : start + self.max_batch]
                with self.autocast:
                    sampled = sample_rows(
                        self.model,
                        [request.prompts[i] for i, _ in chunk],
                        [s.seed + i for i, _ in chunk],
                        [j for _, j in chunk],
                        s.max_new_tokens,
                        s.temperature,
                        s.top_k,
                        s.top_p,
                        self.eod_id,
                        self.graphs,
                    )
                out += [
                    Completion(i, r.tokens, r.logprobs, self.version, r.finished)
                    for (i, _), r in zip(chunk, sampled, strict=True)
                ]
            return out
        finally:
            self.model.train(was_training)


def rollout_backend(
    job: JobConfig,
    model: torch.nn.Module,
    eod_id: int,
    device: torch.device,
    autocast: AbstractContextManager[Any] | None = None,
) -> RolloutBackend:
    """The backend `grpo.rollout` names: the colocated generator (sampling under `autocast`, the
    trainer's), or the rollout service's
    client (imported only then) with the run's token and TLS settings (`auth`, as for the data
    and checkpoint services) and `grpo.max_staleness`.

    Raises:
        ConfigError: rollout = 'service' where the rollout service is not installed.
    """
    g = job.grpo
    if g.rollout == "colocated":
        # under tensor parallelism the decode step holds collectives: not captured
        graphs = g.rollout_cuda_graphs and job.parallel.tp == 1
        return ColocatedBackend(model, eod_id, device, autocast, g.rollout_max_batch, graphs)
    if importlib.util.find_spec(SERVICE_CLIENT.rpartition(".")[0]) is None or (
        importlib.util.find_spec(SERVICE_CLIENT) is None
    ):
        raise ConfigError(
            "grpo.rollout='service': the rollout service is not installed (no "
            f"{SERVICE_CLIENT}); use grpo.rollout='colocated'"
        )
    client = importlib.import_module(SERVICE_CLIENT)
    from meshtrain.services.common.client_security import ClientSecurity

    return client.RolloutClient(
        list(g.rollout_addresses),
        ClientSecurity.from_config(job.auth),
        max_staleness=g.max_staleness,
        wait_s=g.rollout_wait_s,
        timeout_s=g.rollout_timeout_s,
    )
