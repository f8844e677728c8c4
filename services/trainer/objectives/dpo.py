"""Preference tuning in the trainer: the checks, the pairs' batch sources, the policy's head and
the frozen reference model on the same mesh.

`DPO` is the objective `Trainer` runs when `train.objective = "dpo"` (docs/dpo.md), on these:

    check_dpo_job(job, mesh)                    # what DPO does not compose with, refused by name
    data = build_preference_data(job, dp_rank, dp_size)
    use_preference_head(model, job.dpo)         # the policy's loss becomes the DPO loss
    reference = FrozenReference.build(job, mesh, device, model, start_step)
    reference.logps(micro)                      # each micro-batch's reference sums, no grad

The frozen reference is a second copy of the model built and sharded like the policy (tensor and
pipeline stages alike), in eval mode and without gradients; it is never given to the optimizer
or the checkpointer. It starts as a copy of the policy's starting weights, or loads
`dpo.reference_load`, which a run resumed past step 0 must set (its policy has moved on).
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.dataloader.preference import (
    PreferenceBatch,
    PreferenceBatchSource,
    PreferencePairs,
)
from meshtrain.services.dataloader.tokenizers.base import absolute_spec, build_tokenizer
from meshtrain.services.trainer.build import build_model
from meshtrain.services.trainer.checkpoint_restore import restore
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.config.dpo import DPOConfig
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.data import TrainData
from meshtrain.services.trainer.objectives.base import Objective, check_token_ids
from meshtrain.services.trainer.objectives.preference import (
    STAT_NAMES,
    DPOLoss,
    PairTargets,
    PreferenceHead,
    SequenceLogpsHead,
    finish_stats,
)
from meshtrain.services.trainer.parallel import mappings
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.pipeline.engine import Pipeline

if TYPE_CHECKING:
    from meshtrain.services.trainer.train import Trainer

log = logging.getLogger("meshtrain.train")


def check_dpo_job(job: JobConfig, mesh: Mesh) -> None:
    """Refuse what preference tuning does not run with, naming the setting.

    Raises:
        ConfigError: no pairs, the data service, context parallelism, fully sharded data
            parallelism, CUDA graphs, evaluation through a pipeline, or a reference the loss
            type does not take.
    """
    d = job.dpo
    if not d.data_path:
        raise ConfigError("train.objective='dpo' needs dpo.data_path (preprocessed pairs)")
    if job.data.service_addresses:
        raise ConfigError(
            "train.objective='dpo' reads its pairs in-process: the data service does not serve "
            "preference pairs yet; leave data.service_addresses empty"
        )
    if mesh.cp > 1:
        raise ConfigError("train.objective='dpo' with parallel.cp > 1 is not supported yet")
    if job.parallel.fully_sharded:
        raise ConfigError(
            "train.objective='dpo' with parallel.use_torch_fsdp2 is not supported yet (the frozen "
            "reference is not sharded): use ZeRO-1 (parallel.use_distributed_optimizer)"
        )
    if job.train.cuda_graph:
        raise ConfigError("train.cuda_graph does not capture the DPO step; leave it off")
    if d.valid_data_path and mesh.pp > 1:
        raise ConfigError(
            "dpo.valid_data_path with parallel.pipeline_model_parallel_size > 1 is not supported "
            "yet: evaluate with pp=1"
        )


def dpo_loss(d: DPOConfig) -> DPOLoss:
    return DPOLoss(d.loss_type, d.beta, d.label_smoothing, d.simpo_gamma)


def pair_sources(
    job: JobConfig,
    dp_rank: int,
    dp_size: int,
    data_path: str,
    valid_data_path: str | None,
    reference: bool = False,
) -> tuple[PreferenceBatchSource, PreferenceBatchSource | None]:
    """This data-parallel rank's train and valid (None unless given and evaluated) pair sources,
    with each dataset's precomputed reference column when `reference`."""
    t = job.train

    def source(prefix: str) -> PreferenceBatchSource:
        pairs = PreferencePairs(prefix)
        ref = None
        if reference:
            ref = pairs.reference()
            log.info("dpo reference: %s, computed with %s", prefix, pairs.reference_source())
        return PreferenceBatchSource(
            pairs,
            job.model.seq_length,
            t.micro_batch_size,
            t.global_batch_size,
            dp_rank,
            dp_size,
            t.seed,
            ref,
        )

    valid = source(valid_data_path) if valid_data_path and t.eval_interval > 0 else None
    return source(data_path), valid


def build_preference_data(job: JobConfig, dp_rank: int, dp_size: int) -> TrainData:
    """The train (and valid) pair sources of this data-parallel rank, with the reference column
    when dpo.reference is 'precomputed'."""
    d = job.dpo
    tok = build_tokenizer(job.data.tokenizer)
    assert d.data_path is not None  # check_dpo_job
    train, valid = pair_sources(
        job, dp_rank, dp_size, d.data_path, d.valid_data_path, d.reference == "precomputed"
    )
    log.info(
        "dpo data: %s (%d pairs), tokenizer %s, loss %s, reference %s",
        d.data_path,
        train.pairs.num_pairs,
        job.data.tokenizer,
        d.loss_type,
        d.reference,
    )
    return TrainData(train, valid, tok.vocab_size, absolute_spec(job.data.tokenizer), d.data_path)


def use_preference_head(model: nn.Module, d: DPOConfig) -> PreferenceHead:
    """Put the preference head in place of `model`'s (a GPT or a pipeline stage)."""
    head = PreferenceHead(cast(nn.Module, model.head), dpo_loss(d))
    model.head = head
    return head


def pair_micro_batches(
    batches: list[PreferenceBatch], on_device, references: list[torch.Tensor | None] | None
) -> list[tuple[torch.Tensor, torch.Tensor, PairTargets]]:
    """(tokens, labels, PairTargets) of each micro-batch on the device; `references` (the frozen
    reference's sums) replace the batches' precomputed column when given."""
    out = []
    for i, b in enumerate(batches):
        tensors = (b.tokens, b.labels, b.loss_mask) + (
            (b.reference,) if b.reference is not None else ()
        )
        up = on_device(tensors)
        ref = references[i] if references is not None else (up[3] if len(up) > 3 else None)
        out.append((up[0], up[1], PairTargets(up[2], ref)))
    return out


def _wrap_head(model: nn.Module, head: type[nn.Module]) -> None:
    """Put `head` over the model's LM head (which any module with the same calls may replace)."""
    model.head = head(cast(nn.Module, model.head))


class FrozenReference:
    """The reference model (see the module docstring): `logps(micro)` gives each micro-batch's
    (2B,) reference sums (GRPO: (B, seq) per-token log-probs) on the rank that computes the loss
    (the last pipeline stage), None on the others."""

    def __init__(self, model: nn.Module, pipeline: Pipeline | None, autocast):
        self.model, self.pipeline, self.autocast = model, pipeline, autocast

    @classmethod
    def build(
        cls,
        job: JobConfig,
        mesh: Mesh,
        device: torch.device,
        policy: nn.Module,
        start_step: int,
        autocast,
        load: tuple[str | None, int | None] | None = None,
        head: type[nn.Module] = SequenceLogpsHead,
    ) -> FrozenReference:
        """Built like the policy; its weights copied from the policy's (as this run starts), or
        loaded from `load` = (root, step or None) (unset: dpo.reference_load and its step).
        `head` replaces the model's LM head: per-sequence sums (DPO) or per-token log-probs
        (GRPO's `TokenLogpsHead`).

        Raises:
            ConfigError: a resumed run (start_step > 0) without a reference checkpoint.
        """
        root, step = (
            load if load is not None else (job.dpo.reference_load, job.dpo.reference_load_step)
        )
        key = "dpo.reference_load" if load is None else "grpo.reference_load"
        if root is None and start_step > 0:
            raise ConfigError(
                f"this run resumes at step {start_step}, where the policy is no longer the "
                f"reference: set {key} to the checkpoint the run started from"
            )
        if root is not None:
            return cls.load(job, mesh, device, root, step, autocast, head)
        # the policy's RNG streams (dropout, the data order) must not notice the second model
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model, _, pipeline = build_model(job, mesh, device)
            _wrap_head(model, head)
            with torch.no_grad():
                for (name, p), (pname, q) in zip(
                    model.named_parameters(), policy.named_parameters(), strict=True
                ):
                    assert name == pname, (name, pname)
                    p.copy_(q)
        return cls._frozen(model, pipeline, autocast)

    @classmethod
    def load(
        cls,
        job: JobConfig,
        mesh: Mesh,
        device: torch.device,
        root: str,
        step: int | None,
        autocast,
        head: type[nn.Module] = SequenceLogpsHead,
    ) -> FrozenReference:
        """Built like the policy, with the weights of checkpoint `step` (unset: the newest) under
        `root`, whatever layout saved it.

        Raises:
            CheckpointError: no such checkpoint, or one that does not fit the model.
        """
        # neither the model's initialization nor the checkpoint's RNG states may reach the
        # caller's generators (torch's, Python's and NumPy's: restore sets all three)
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model, _, pipeline = build_model(job, mesh, device)
            _wrap_head(model, head)
            restore(
                root,
                cast(Any, model),  # a GPT, or the pipeline stage holding this rank's part
                None,
                Parallel(mesh),
                step,
            )
        random.setstate(py_state)
        np.random.set_state(np_state)
        log.info("reference model: loaded from %s", root if step is None else f"{root} step {step}")
        return cls._frozen(model, pipeline, autocast)

    @classmethod
    def _frozen(cls, model: nn.Module, pipeline: Pipeline | None, autocast) -> FrozenReference:
        model.eval()
        model.requires_grad_(False)
        return cls(model, pipeline, autocast)

    @torch.no_grad()
    def logps(self, micro) -> list[torch.Tensor | None]:
        """micro: [(tokens, labels, PairTargets)] on the device, or Nones on middle stages."""
        if self.pipeline is None:
            out: list[torch.Tensor | None] = []
            for tokens, labels, targets in micro:
                with self.autocast:
                    out.append(self.model(tokens, labels, targets.loss_mask).float())
            return out
        return self._pipeline_logps(micro)

    def _pipeline_logps(self, micro) -> list[torch.Tensor | None]:
        """Every micro-batch through the reference's stages in order (forward only)."""
        assert self.pipeline is not None
        runtime = self.pipeline.runtime
        stage, pp = self.pipeline.stage, runtime.mesh.pp
        out: list[torch.Tensor | None] = [None] * len(micro)
        for m in range(len(micro)):
            for s in range(pp * stage.virtual):
                if s % pp != stage.pp_rank:
                    continue
                c = s // pp
                if stage.chunk_is_first(c):
                    x = micro[m][0]
                else:
                    x = torch.empty(
                        runtime.act_shape, dtype=runtime.act_dtype, device=runtime.device
                    )
                    dist.recv(x, runtime.prev)
                labels = mask = None
                if stage.chunk_is_last(c):
                    labels, mask = micro[m][1], micro[m][2].loss_mask
                with self.autocast:
                    y = stage.forward_chunk(c, x, labels, mask)
                if stage.chunk_is_last(c):
                    out[m] = y.float()
                else:
                    dist.send(y.contiguous(), runtime.next)
        return out


def reduce_stats(
    stats: torch.Tensor | None,
    mesh: Mesh,
    device: torch.device,
    names: tuple[str, ...] = STAT_NAMES,
) -> torch.Tensor:
    """A step's summed pair statistics (`names`, then the pair count) over the ranks that
    computed parts of them: the dp ranks' pairs, held by the last pipeline stage (zeros
    elsewhere)."""
    if stats is None:
        stats = torch.zeros(len(names) + 1, device=device)
    if mesh.pp > 1:
        stats = mappings.all_reduce(stats, mesh.group("pp"))
    if mesh.dp > 1:
        stats = mappings.all_reduce(stats, mesh.group("dp"))
    return stats


@torch.no_grad()
def evaluate_pairs(objective: Any, names: tuple[str, ...]) -> tuple[float, dict[str, float]]:
    """The mean loss of a pair objective (DPO, reward modeling) over the held-out pairs
    (eval_iters global batches), and the pairs' mean statistics under `names`. `objective` has
    `trainer`, `mesh`, `head` (keeping statistics) and `inputs`."""
    trainer = objective.trainer
    assert objective.head is not None and trainer.data.valid is not None
    valid: Any = trainer.data.valid
    trainer.model.eval()
    objective.head.take_stats()  # this step's are already kept
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)
    for step in range(trainer.job.train.eval_iters):
        micro = valid.micro_batches(step)
        for tokens, labels, targets in objective.inputs(micro, len(micro)):
            with trainer.autocast:
                loss = trainer.forward(tokens, labels, targets).double()
            total += loss * tokens.shape[0] / 2  # a mean over the micro-batch's pairs
    trainer.model.train()
    mesh = objective.mesh
    stats = reduce_stats(objective.head.take_stats(), mesh, trainer.device, names)
    total = mappings.all_reduce(total, mesh.group("dp")) if mesh.dp > 1 else total
    return (total / stats[-1].double().clamp(min=1.0)).item(), finish_stats(stats, names)


class DPO(Objective):
    """train.objective = 'dpo': pairs in, the preference loss out of the policy's head, the
    frozen reference's sums (dpo.reference = 'frozen') computed on every stage of a step."""

    def __init__(self, job: JobConfig, mesh: Mesh):
        check_dpo_job(job, mesh)
        super().__init__(job, mesh)
        self.config = job.dpo
        self.head: PreferenceHead | None = None
        self.stats: torch.Tensor | None = None  # the last step's, summed on this rank
        self.eval_stats: dict[str, float] = {}

    def build_data(self, job: JobConfig, mesh: Mesh) -> TrainData:
        return build_preference_data(job, mesh.dp_rank, mesh.dp)

    def use_head(self, model: nn.Module) -> None:
        # the policy's head computes the DPO loss (its statistics kept here)
        self.head = use_preference_head(model, self.config)

    def build(self, trainer: Trainer) -> None:
        super().build(trainer)
        if trainer.job.dpo.reference == "frozen":
            self.reference = FrozenReference.build(
                trainer.job,
                self.mesh,
                trainer.device,
                trainer.model,
                trainer.state.iteration,
                trainer.autocast,
            )

    def micro_batches(self, step: int, reads: bool) -> list | None:
        source: Any = self.trainer.data.train
        return source.micro_batches(step) if reads else None

    def inputs(self, micro: list | None, n: int) -> list:
        """(tokens, labels, PairTargets) of each micro-batch on the device, with the frozen
        reference's log-probs (computed here, on every stage of a pipeline), or n Nones for a
        stage that reads no data."""
        trainer = self.trainer
        inputs: list = [None] * n
        if micro is not None:
            for b in micro:
                check_token_ids(b, trainer.job, trainer.data)
            inputs = pair_micro_batches(
                micro, lambda ts: next(iter(trainer.uploader.upload([ts]))), None
            )
        if self.reference is not None:
            refs = self.reference.logps(inputs)
            inputs = [
                x if x is None else (x[0], x[1], PairTargets(x[2].loss_mask, r))
                for x, r in zip(inputs, refs, strict=True)
            ]
        return inputs

    def end_step(self) -> None:
        assert self.head is not None
        self.stats = self.head.take_stats()

    def step_metrics(self) -> dict[str, float]:
        # TRL's names: rewards/accuracies, ...
        return finish_stats(reduce_stats(self.stats, self.mesh, self.trainer.device))

    def evaluate(self) -> float:
        """The mean preference loss over the held-out pairs, and their statistics in
        `eval_metrics`."""
        loss, self.eval_stats = evaluate_pairs(self, STAT_NAMES)
        return loss

    def eval_metrics(self) -> dict[str, float]:
        return self.eval_stats
