"""A trained reward model as a GRPO reward (`grpo.reward_model`): loaded frozen on the trainer
process's device, it scores token sequences (prompt + completion) in batches.

    scorer = RewardScorer.load(root, step, job, device, autocast, batch_size)
    scorer.score([prompt_ids + completion_ids, ...])   # [float], one per sequence

The checkpoint must be a reward model (its recorded model config has `reward_head`, so it holds
`score.weight`) tokenized as the policy is (same vocabulary, same tokenizer files, or for
file-less tokenizers the same spec): its score of another tokenizer's ids would be noise. A
sequence's score is the scalar head at its last token, as `reward_model.RewardHead` trains it
(the completion's EOD is not part of it); one longer than the reward model's seq_length keeps
its end.
"""

from __future__ import annotations

import logging

import torch

from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.checkpoint.tokenizer_store import METADATA_KEY, tokenizer_boxes
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.rollout.weights import check_weights, checkpoint_config, read_checkpoint
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.model.rotary import rotary_tables

log = logging.getLogger("meshtrain.train")


def _tokenizer_files(record: dict | None) -> list[str] | None:
    """The sha256 of a checkpoint's carried tokenizer files (companions aside), or None."""
    if not record:
        return None
    return sorted(e["sha256"] for e in record.get("files", []) if not e.get("companion"))


def check_same_tokenizer(root: str, step: int, job: JobConfig, vocab_size: int) -> None:
    """Refuse a reward model tokenized otherwise than the policy.

    Raises:
        ConfigError: another vocabulary size, other tokenizer files, or another file-less spec.
    """
    policy_vocab = job.model.vocab_size
    if policy_vocab is not None and vocab_size != policy_vocab:
        raise ConfigError(
            f"grpo.reward_model: {root} step {step} has a vocabulary of {vocab_size}, the "
            f"policy {policy_vocab}: the reward model must use the policy's tokenizer"
        )
    metadata = read_manifest(root, step).get("metadata", {})
    theirs = _tokenizer_files(metadata.get(METADATA_KEY))
    ours = _tokenizer_files(tokenizer_boxes(job.data.tokenizer)[1])
    if theirs is None and ours is None:  # file-less tokenizers (byte, null): compare the spec
        saved = ((metadata.get("config") or {}).get("data") or {}).get("tokenizer")
        same = saved is None or saved == job.data.tokenizer
    else:
        same = theirs == ours
    if not same:
        raise ConfigError(
            f"grpo.reward_model: {root} step {step} was trained with another tokenizer than the "
            f"policy's ({job.data.tokenizer}): the reward model must use the policy's tokenizer"
        )


class RewardScorer:
    """A frozen reward model on one device (see the module docstring)."""

    def __init__(self, model: GPT, device: torch.device, autocast, batch_size: int):
        self.model, self.device, self.autocast = model, device, autocast
        self.batch_size = batch_size

    @classmethod
    def load(
        cls,
        root: str,
        step: int | None,
        job: JobConfig,
        device: torch.device,
        autocast,
        batch_size: int = 32,
    ) -> RewardScorer:
        """The reward model of checkpoint `step` (None: the newest) under `root`.

        Raises:
            ConfigError: the checkpoint has no scalar head, or another tokenizer.
            CheckpointError: no such checkpoint, or one that cannot be read.
        """
        config, step = checkpoint_config(root, step)
        if not config.reward_head:
            raise ConfigError(
                f"grpo.reward_model: {root} step {step} is not a reward model (its model has no "
                "scalar head, model.reward_head); train one with train.objective='reward'"
            )
        assert config.vocab_size is not None  # checkpoint_config resolves it
        check_same_tokenizer(root, step, job, config.vocab_size)
        # built on the meta device: no memory, and no draw from the policy's RNG streams
        with torch.device("meta"):
            model = GPT(config)
        model = model.to_empty(device=device)
        if model.rope_cos is not None:  # buffers derived from the config: rebuilt off meta
            cos, sin = rotary_tables(config)
            model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)  # type: ignore[assignment]
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        tensors = check_weights(
            read_checkpoint(root, step, list(params)), params, config.vocab_size
        )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[name])
        model.eval()
        model.requires_grad_(False)
        log.info("grpo reward model: %s step %d", root, step)
        return cls(model, device, autocast, batch_size)

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[float]:
        """Each token sequence's reward (its last token's scalar head)."""
        seq_length = self.model.config.seq_length
        out: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = [s[-seq_length:] for s in sequences[start : start + self.batch_size]]
            if any(not s for s in chunk):
                raise ValueError("the reward model cannot score an empty sequence")
            width = max(len(s) for s in chunk)
            # right padding: causal attention keeps it out of every real token's state
            tokens = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, s in enumerate(chunk):
                tokens[row, : len(s)] = torch.tensor(s)
            last = torch.tensor([len(s) - 1 for s in chunk], device=self.device)
            with self.autocast:
                scores = self.model(tokens.to(self.device))  # (batch, width)
            rows = torch.arange(len(chunk), device=self.device)
            out += scores[rows, last].float().tolist()
        return out
