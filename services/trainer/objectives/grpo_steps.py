"""GRPO in the trainer: the checks, the batches of rollouts each optimizer step trains on, and
the objective (`GRPO`) `Trainer` runs when `train.objective = "grpo"` (docs/grpo.md), on these:

    check_grpo_job(job, mesh)                    # what GRPO does not compose with, by name
    use_grpo_head(model, job.grpo)               # the policy's loss becomes the GRPO loss
    rollouts = Rollouts(job, mesh, device, tokenizer, backend, reference, publish)
    rollouts.micro_batches(step)                 # [(tokens, labels, RolloutTargets)] on device

Every `num_iterations` steps `Rollouts` publishes the current weights as version `step`
(`publish`: `WeightsPublisher.publish`, a version bump for the colocated generator), asks the
backend for G completions of each of this
data-parallel rank's prompts (`PromptSet`), scores them with the reward functions and the
reward model (grpo.reward_model, `reward_scorer.RewardScorer`), gathers the
rewards over dp for the advantages and the metrics, and lays prompt + completion out as
training sequences of `model.seq_length` (labels shifted by one, the loss mask on the
completion's tokens). The frozen reference's per-token log-probs are computed once per batch.
A run resumed inside a batch (step not a multiple of num_iterations) samples a new batch with the
resumed weights: the prompts are the same, the completions not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from meshtrain.services.common.errors import CheckpointError, ConfigError, MeshtrainError
from meshtrain.services.dataloader.tokenizers.base import Tokenizer, absolute_spec, build_tokenizer
from meshtrain.services.rollout.types import RolloutBackend, RolloutRequest, SamplingParams
from meshtrain.services.trainer.config.grpo import GRPOConfig
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.data import TrainData
from meshtrain.services.trainer.objectives.base import Objective
from meshtrain.services.trainer.objectives.dpo import FrozenReference
from meshtrain.services.trainer.objectives.grpo import (
    LOSS_STAT_NAMES,
    GRPOHead,
    GRPOLoss,
    RolloutTargets,
    TokenLogpsHead,
    finish_loss_stats,
    group_advantages,
)
from meshtrain.services.trainer.objectives.prompts import PromptSet
from meshtrain.services.trainer.objectives.publish import WeightsPublisher, check_publish
from meshtrain.services.trainer.objectives.reward_scorer import RewardScorer
from meshtrain.services.trainer.objectives.rewards import Rewards
from meshtrain.services.trainer.objectives.rollouts import rollout_backend
from meshtrain.services.trainer.parallel import mappings
from meshtrain.services.trainer.parallel.mesh import Mesh

if TYPE_CHECKING:
    from meshtrain.services.trainer.train import Trainer

log = logging.getLogger("meshtrain.train")

SEED_STRIDE = 1 << 20
"""Prompt seeds of one batch are base + global prompt index: batches hold fewer prompts."""


def check_grpo_job(job: JobConfig, mesh: Mesh) -> None:
    """Refuse what GRPO does not run with, naming the setting.

    Raises:
        ConfigError: no prompts or reward functions, the service without addresses, a batch
            that is not whole groups per rank, pipeline or context parallelism, sequence
            parallelism, FSDP, CUDA graphs, the data service, a weights publication the layout
            cannot gather (`check_publish`), or prompts too long for the sequence.
    """
    g, t = job.grpo, job.train
    if not g.prompts_path:
        raise ConfigError("train.objective='grpo' needs grpo.prompts_path (a JSONL of prompts)")
    if not g.reward_funcs and not g.reward_model:
        raise ConfigError("train.objective='grpo' needs grpo.reward_funcs or grpo.reward_model")
    # checked here, not when the config loads: `meshtrain up --rollout-workers` loads it first
    # and hands the workers it starts over in this key
    if g.rollout == "service" and not g.rollout_addresses:
        raise ConfigError("grpo.rollout='service' needs grpo.rollout_addresses (host:port)")
    if t.global_batch_size % (g.group_size * mesh.dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} counts completions: it must be a "
            f"multiple of grpo.group_size={g.group_size} x data-parallel size {mesh.dp}"
        )
    if t.global_batch_size // g.group_size >= SEED_STRIDE:
        raise ConfigError(f"train.global_batch_size / grpo.group_size must be < {SEED_STRIDE}")
    check_publish(job, mesh)
    for what, bad in (
        ("parallel.pipeline_model_parallel_size > 1", mesh.pp > 1),
        ("parallel.cp > 1", mesh.cp > 1),
        ("parallel.sequence_parallel", job.parallel.sequence_parallel),
        ("parallel.use_torch_fsdp2", job.parallel.fully_sharded),
        ("train.cuda_graph", t.cuda_graph),
        ("data.service_addresses (prompts are read in-process)", bool(job.data.service_addresses)),
    ):
        if bad:
            raise ConfigError(f"train.objective='grpo' with {what} is not supported yet")


def grpo_loss_settings(g: GRPOConfig) -> GRPOLoss:
    return GRPOLoss(g.beta, g.epsilon, g.epsilon_high, g.loss_type, g.max_new_tokens)


def use_grpo_head(model: nn.Module, g: GRPOConfig) -> GRPOHead:
    """Put the GRPO head in place of `model`'s."""
    head = GRPOHead(cast(nn.Module, model.head), grpo_loss_settings(g))
    model.head = head
    return head


class Rollouts:
    """The batches of rollouts of one data-parallel rank (see the module docstring)."""

    def __init__(
        self,
        job: JobConfig,
        mesh: Mesh,
        device: torch.device,
        tokenizer: Tokenizer,
        backend: RolloutBackend,
        reference=None,
        publish: Callable[[int], None] | None = None,
        reward_model: RewardScorer | None = None,
    ):
        g, t = job.grpo, job.train
        self.job, self.g, self.mesh, self.device = job, g, mesh, device
        self.tok, self.backend, self.reference = tokenizer, backend, reference
        self.publish = publish if publish is not None else backend.update_weights
        self.prompts = PromptSet.read(cast(str, g.prompts_path), tokenizer, g.chat_template, t.seed)
        self.rewards = Rewards.load(g.reward_funcs, g.reward_weights, reward_model is not None)
        self.reward_model = reward_model
        # the reward columns: each function's, then the reward model's (TRL's reward_funcs order)
        self.reward_names = self.rewards.names + (["reward_model"] if reward_model else [])
        self.reward_weights = self.rewards.weights + (
            [g.reward_model_weight] if reward_model else []
        )
        self.seq_length = job.model.seq_length
        if self.prompts.longest + g.max_new_tokens > self.seq_length + 1:
            raise ConfigError(
                f"the longest prompt ({self.prompts.longest} tokens) + grpo.max_new_tokens="
                f"{g.max_new_tokens} exceeds model.seq_length + 1 = {self.seq_length + 1}"
            )
        self.per_batch = t.global_batch_size // g.group_size  # prompts, over all dp ranks
        self.sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_k, g.top_p)
        self.batch_index: int | None = None
        self.micro: list = []
        self.metrics: dict[str, float] = {}
        log.info(
            "grpo: %d prompts from %s, %d per step x %d completions, rewards %s",
            len(self.prompts),
            g.prompts_path,
            self.per_batch,
            g.group_size,
            ", ".join(self.reward_names),
        )

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, RolloutTargets]]:
        """The micro-batches step `step` trains on: a new batch of rollouts every num_iterations
        steps (or on the first step this run takes), else the current one again."""
        k = step // self.g.num_iterations
        if k != self.batch_index:
            self.micro = self._new_batch(step, k)
            self.batch_index = k
        return self.micro

    def _new_batch(self, step: int, k: int) -> list:
        g, mesh, t = self.g, self.mesh, self.job.train
        share = self.per_batch // mesh.dp
        indices = self.prompts.indices(k, self.per_batch, mesh.dp_rank, mesh.dp)
        prompts = [self.prompts.prompts[i] for i in indices]
        base = (t.seed * 1_000_003 + k) * SEED_STRIDE % (1 << 62)
        sampling = SamplingParams(
            g.max_new_tokens, g.temperature, g.top_k, g.top_p, seed=base + mesh.dp_rank * share
        )
        self.publish(step)  # the weights these rollouts come from are version `step`
        request = RolloutRequest(
            [p.ids for p in prompts],
            g.group_size,
            sampling,
            min_version=max(0, step - g.max_staleness),
            request_id=f"step{step}-dp{mesh.dp_rank}",
        )
        completions = self.backend.generate(request)
        if len(completions) != len(prompts) * g.group_size:
            raise MeshtrainError(
                f"the rollout backend returned {len(completions)} completions for "
                f"{len(prompts)} prompts x {g.group_size}"
            )
        for c in completions:
            if c.policy_version < request.min_version:
                raise MeshtrainError(
                    f"a completion of policy version {c.policy_version} is older than "
                    f"grpo.max_staleness={g.max_staleness} allows at step {step}"
                )
        # per completion: each reward function's value, then length and finished (host floats)
        rows = []
        texts = [c.tokens[:-1] if c.finished else c.tokens for c in completions]
        model_scores = (
            self.reward_model.score(
                [prompts[c.prompt_index].ids + t for c, t in zip(completions, texts)]
            )
            if self.reward_model is not None
            else None
        )
        for i, (c, text_ids) in enumerate(zip(completions, texts, strict=True)):
            p = prompts[c.prompt_index]
            scores = self.rewards.score(p.text, self.tok.decode(text_ids), dict(p.columns))
            if model_scores is not None:
                scores.append(model_scores[i])
            rows.append([*scores, float(len(c.tokens)), float(c.finished)])
        local = torch.tensor(rows, dtype=torch.float32, device=self.device)  # (n, F + 2)
        every = (
            mappings.all_gather(local, 0, mesh.group("dp")) if mesh.dp > 1 else local
        )  # (dp * n, F + 2), rank by rank: the global batch in prompt order
        nf = len(self.reward_names)
        weights = torch.tensor(self.reward_weights, device=self.device)
        total = (every[:, :nf] * weights).sum(1)
        advantages = group_advantages(total.double().cpu(), g.group_size, g.scale_rewards).float()
        n = len(completions)
        mine = advantages[mesh.dp_rank * n : (mesh.dp_rank + 1) * n]
        self.metrics = self._metrics(every, total, nf)
        return self._sequences(prompts, completions, mine, every[:, nf].sum().item())

    def _metrics(self, every: torch.Tensor, total: torch.Tensor, nf: int) -> dict[str, float]:
        """TRL's reward and completion metrics of the batch (every rank's completions)."""
        g = self.g.group_size
        grouped_std = total.view(-1, g).std(1)
        lengths, finished = every[:, nf], every[:, nf + 1]
        out = {
            "reward": total.mean().item(),
            "reward_std": total.std().item(),
            "frac_reward_zero_std": (grouped_std.abs() < 1e-8).float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": 1.0 - finished.mean().item(),
        }
        for i, name in enumerate(self.reward_names):
            out[f"rewards/{name}/mean"] = every[:, i].mean().item()
            out[f"rewards/{name}/std"] = every[:, i].std().item()
        return out

    def _sequences(self, prompts, completions, advantages: torch.Tensor, tokens_total: float):
        """The rank's completions as training micro-batches on the device."""
        t, g = self.job.train, self.g
        seq, pad = self.seq_length, self.tok.eod_id
        n = len(completions)
        ids = torch.full((n, seq + 1), pad, dtype=torch.long)
        mask = torch.zeros(n, seq)
        for row, c in enumerate(completions):
            p = prompts[c.prompt_index].ids
            full = p + c.tokens
            ids[row, : len(full)] = torch.tensor(full)
            # label j is token j + 1: the completion's tokens are labels len(p)-1 .. len(full)-2
            mask[row, len(p) - 1 : len(full) - 1] = 1.0
        n_micro = t.global_batch_size // t.micro_batch_size // self.mesh.dp
        sequences = n * self.mesh.dp
        if g.loss_type == "token-mean":
            denominator = tokens_total
        elif g.loss_type == "sequence-mean":
            denominator = float(sequences)
        else:  # sequence-sum-norm
            denominator = float(sequences * g.max_new_tokens)
        # _micro_batch divides by n_micro and data parallelism averages gradients over dp
        scale = n_micro * self.mesh.dp / max(denominator, 1.0)
        out = []
        m = t.micro_batch_size
        for start in range(0, n, m):
            sl = slice(start, start + m)
            tokens = ids[sl, :-1].to(self.device)
            labels = ids[sl, 1:].to(self.device)
            targets = RolloutTargets(
                mask[sl].to(self.device), advantages[sl].to(self.device), scale
            )
            out.append((tokens, labels, targets))
        if self.reference is not None:
            for (_, _, targets), ref in zip(out, self.reference.logps(out), strict=True):
                targets.ref_logps = ref
        return out

    def take_metrics(self) -> dict[str, float]:
        return dict(self.metrics)


def reduce_loss_stats(stats: torch.Tensor | None, mesh: Mesh, device: torch.device) -> torch.Tensor:
    """A step's summed loss statistics over the dp ranks."""
    if stats is None:
        stats = torch.zeros(len(LOSS_STAT_NAMES) + 1, device=device)
    if mesh.dp > 1:
        stats = mappings.all_reduce(stats, mesh.group("dp"))
    return stats


class GRPO(Objective):
    """train.objective = 'grpo': each step's batches sampled by the policy (`Rollouts`), the
    clipped policy-ratio loss out of the policy's head."""

    def __init__(self, job: JobConfig, mesh: Mesh):
        check_grpo_job(job, mesh)
        super().__init__(job, mesh)
        self.config = job.grpo
        self.head: GRPOHead | None = None
        self.stats: torch.Tensor | None = None  # the last step's, summed on this rank

    def build_data(self, job: JobConfig, mesh: Mesh) -> TrainData:
        # the batches are sampled by the policy each step (`Rollouts`, built with the model)
        tok = build_tokenizer(job.data.tokenizer)
        spec = absolute_spec(job.data.tokenizer)
        return TrainData(None, None, tok.vocab_size, spec, str(job.grpo.prompts_path))

    def use_head(self, model: nn.Module) -> None:
        # the policy's head computes the clipped policy-ratio loss
        self.head = use_grpo_head(model, self.config)

    def build(self, trainer: Trainer) -> None:
        """The rollouts: the backend (the policy itself, or the rollout service) and, with
        grpo.beta > 0, the frozen reference (per-token log-probs, sharded like the policy)."""
        super().build(trainer)
        job, g = trainer.job, trainer.job.grpo
        tok = build_tokenizer(job.data.tokenizer)
        reference = None
        if g.beta > 0:
            reference = FrozenReference.build(
                job,
                self.mesh,
                trainer.device,
                trainer.model,
                trainer.state.iteration,
                trainer.autocast,
                load=(g.reference_load, g.reference_load_step),
                head=TokenLogpsHead,
            )
        scorer = None
        if g.reward_model is not None:
            scorer = RewardScorer.load(
                g.reward_model,
                g.reward_model_step,
                job,
                trainer.device,
                trainer.autocast,
                g.reward_model_batch_size,
            )
        backend = rollout_backend(job, trainer.model, tok.eod_id, trainer.device, trainer.autocast)
        publisher = WeightsPublisher(
            job, trainer.model, self.mesh, backend, self._checkpoint_for_rollouts
        )
        self.rollouts = Rollouts(
            job, self.mesh, trainer.device, tok, backend, reference, publisher.publish, scorer
        )

    def _checkpoint_for_rollouts(self, step: int) -> None:
        """grpo.publish = 'checkpoint': commit a checkpoint of step `step` (the current weights)
        for the rollout workers to load, unless this run has one of it already (collective)."""
        trainer = self.trainer
        if trainer.state.iteration != step:
            raise MeshtrainError(
                f"weights of step {step} asked for at step {trainer.state.iteration}"
            )
        if trainer.last_saved != step:
            if trainer.save() is None:
                raise CheckpointError(f"the checkpoint of step {step} could not be saved")
        trainer.checkpointer.wait()  # committed before a worker is asked to load it

    def micro_batches(self, step: int, reads: bool) -> list | None:
        # sampled by the policy (every grpo.num_iterations steps)
        return self.rollouts.micro_batches(step)

    def inputs(self, micro: list | None, n: int) -> list:
        # (tokens, labels, RolloutTargets), on the device already
        return micro if micro is not None else [None] * n

    def end_step(self) -> None:
        assert self.head is not None
        self.stats = self.head.take_stats()

    def step_metrics(self) -> dict[str, float]:
        # TRL's names
        stats = reduce_loss_stats(self.stats, self.mesh, self.trainer.device)
        return {**finish_loss_stats(stats, self.config.beta), **self.rollouts.take_metrics()}

    def evaluate(self) -> float:
        raise MeshtrainError("train.objective='grpo' has no validation set to evaluate")
