"""The `[grpo]` section: on-policy RL with group-relative advantages, its rollouts and rewards.

Read when `train.objective = "grpo"`; docs/grpo.md gives TRL's, verl's and NeMo RL's name for
each key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshtrain.services.common.errors import ConfigError


@dataclass
class GRPOConfig:
    """GRPO (and its Dr. GRPO / DAPO variants)."""

    prompts_path: str | None = None
    """JSONL of prompts: each row a `prompt` string (used as is) or `messages` (rendered with the
    chat template, generation prompt added); other columns (an `answer`, ...) are
    given to the reward functions."""
    chat_template: str = "auto"
    """How `messages` rows are rendered: auto (the tokenizer's own), a built-in name (chatml,
    llama3) or a .jinja file."""
    group_size: int = 8
    """Completions sampled per prompt (G). train.global_batch_size counts completions, so a step
    takes global_batch_size / group_size prompts."""
    max_new_tokens: int = 64
    """Most tokens sampled per completion (a completion stops earlier at the tokenizer's EOD)."""
    temperature: float = 1.0
    """Sampling temperature of the completions (> 0). The loss's log-probs are at temperature 1
    whatever it is (TRL divides them by it: the two differ when it is not 1)."""
    top_k: int | None = None
    """Sample among the k most likely tokens only (unset: all)."""
    top_p: float | None = None
    """Sample among the smallest set of tokens with probability mass >= p (unset: all)."""
    beta: float = 0.0
    """Weight of the KL penalty against the frozen reference (k3 estimator); 0: no reference
    model is built."""
    epsilon: float = 0.2
    """Lower clip of the policy ratio (1 - epsilon), and the upper one unless epsilon_high."""
    epsilon_high: float | None = None
    """Upper clip (1 + epsilon_high; DAPO's clip-higher); unset: epsilon."""
    num_iterations: int = 1
    """Optimizer steps on each batch of rollouts (mu); the ratio is taken against the policy
    that started the batch."""
    loss_type: Literal["token-mean", "sequence-mean", "sequence-sum-norm"] = "token-mean"
    """token-mean: mean over every completion token of the batch (TRL's dapo); sequence-mean: per
    completion, then over completions (the GRPO paper, TRL's grpo); sequence-sum-norm: summed and
    divided by completions x max_new_tokens (Dr. GRPO, TRL's dr_grpo)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std (group), the batch's (batch), or not at all
    (none, Dr. GRPO)."""
    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions by import path, `package.module:function`
    (`meshtrain.services.trainer.objectives.rewards` documents the signature)."""
    reward_weights: list[float] | None = None
    """Weight of each reward function in the summed reward; unset: all 1."""
    reward_model: str | None = None
    """Checkpoint root of a reward model (trained with train.objective='reward': a scalar head)
    whose score of each prompt + completion is added to the rewards (TRL's reward_funcs=[model]);
    it is loaded frozen on each trainer process's device. Unset: the reward functions alone."""
    reward_model_step: int | None = None
    """Which step of reward_model (unset: its newest)."""
    reward_model_weight: float = 1.0
    """Weight of the reward model's score in the summed reward."""
    reward_model_batch_size: int = 32
    """Sequences the reward model scores per forward."""
    rollout: Literal["colocated", "service"] = "colocated"
    """colocated: the trainer's processes generate with the policy; service: the rollout service
    at rollout_addresses."""
    rollout_max_batch: int = 256
    """Completions the colocated generator decodes as one batch: a step's prompts x group_size
    are sampled in batches of at most this many rows (the same completions whatever it is; a
    larger batch is faster and holds a larger key/value cache)."""
    rollout_cuda_graphs: bool = True
    """On CUDA, the colocated generator replays each decode step as a captured CUDA graph (the
    same tokens, without a host-bound launch of every kernel per token). The graphs keep their
    key/value caches between rollouts (two shapes at most); off where that memory is needed
    for training. Never used with tp > 1 (the step's collectives stay eager)."""
    rollout_addresses: list[str] = field(default_factory=list)
    """host:port of the rollout workers (rollout = 'service')."""
    max_staleness: int = 0
    """How many optimizer steps older than the trainer's weights a completion's policy may be
    (the request's min_version is step - max_staleness); an older completion is refused."""
    publish: Literal["stream", "checkpoint"] = "stream"
    """How the trainer's weights reach the rollout workers before each batch (rollout =
    'service'; version = the step): stream (the full weights, gathered in the checkpoint's
    layout by dp rank 0's tensor-parallel group, sent by global rank 0) or checkpoint (a
    checkpoint of the step saved under checkpoint.save, which each worker loads: its --load must
    be that root)."""
    rollout_wait_s: float = 0.0
    """How long a rollout worker waits for the weights a request needs before it refuses (and
    the request goes to another worker)."""
    rollout_timeout_s: float = 600.0
    """Deadline of one request to a rollout worker."""
    reference_load: str | None = None
    """Checkpoint root of the reference model (beta > 0); unset: the policy as this run starts it.
    A run resumed past step 0 with beta > 0 must set it."""
    reference_load_step: int | None = None
    """Which step of reference_load (unset: its newest)."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(
                f"grpo.group_size={self.group_size}: group-relative advantages need >= 2 "
                "completions per prompt"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(f"grpo.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.num_iterations < 1:
            raise ConfigError(f"grpo.num_iterations={self.num_iterations} must be >= 1")
        if self.beta < 0:
            raise ConfigError(f"grpo.beta={self.beta} must be >= 0")
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"grpo.epsilon={self.epsilon} must be in (0, 1)")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            raise ConfigError(f"grpo.epsilon_high={self.epsilon_high} must be positive")
        if self.rollout_max_batch < 1:
            raise ConfigError(f"grpo.rollout_max_batch={self.rollout_max_batch} must be >= 1")
        if self.max_staleness < 0:
            raise ConfigError(f"grpo.max_staleness={self.max_staleness} must be >= 0")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(
                f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                f"{len(self.reward_funcs)} grpo.reward_funcs"
            )
        for path in self.reward_funcs:
            module, _, name = path.partition(":")
            if not module or not name:
                raise ConfigError(
                    f"grpo.reward_funcs: {path!r} is not an import path 'package.module:function'"
                )
        if self.reward_model is None and self.reward_model_step is not None:
            raise ConfigError("grpo.reward_model_step needs grpo.reward_model (a checkpoint root)")
        if self.reward_model_batch_size < 1:
            raise ConfigError(
                f"grpo.reward_model_batch_size={self.reward_model_batch_size} must be >= 1"
            )
        if not 0 <= self.rollout_wait_s <= 3600:
            raise ConfigError(f"grpo.rollout_wait_s={self.rollout_wait_s} must be in [0, 3600]")
        if self.rollout_timeout_s <= 0:
            raise ConfigError(f"grpo.rollout_timeout_s={self.rollout_timeout_s} must be positive")
        if self.temperature <= 0:
            raise ConfigError(
                f"grpo.temperature={self.temperature}: a group of greedy completions is one "
                "completion G times (no advantage); sample with temperature > 0"
            )
        from meshtrain.services.common.sampling import check_sampling

        check_sampling(self.temperature, self.top_k, self.top_p)
