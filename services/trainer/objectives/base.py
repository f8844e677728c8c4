"""What a training objective supplies to the loop: its checks, its batches, its head, its step's
statistics and its evaluation. `Trainer` (train.py) builds, steps and loops the same way for
every objective and asks the one of `train.objective` (`objective_for`) for what differs:

    objective = objective_for(job, mesh)        # refuses what it does not run with, by name
    data = objective.build_data(job, mesh)      # its batch sources (TrainData)
    objective.use_head(model)                   # the policy's loss becomes the objective's
    objective.build(trainer)                    # what it needs of the built run (a reference)
    micro = objective.micro_batches(step, reads)
    inputs = objective.inputs(micro, n)         # each micro-batch's forward arguments, on device
    objective.end_step(); objective.step_metrics()
    objective.evaluate(); objective.eval_metrics()

Language modeling (pretraining, SFT, vision-language) is `language.LanguageModeling`; preference
tuning `dpo.DPO`; GRPO `grpo_steps.GRPO`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from meshtrain.services.common.errors import DataError
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.data import TrainData
from meshtrain.services.trainer.parallel.mesh import Mesh

if TYPE_CHECKING:
    from torch import nn

    from meshtrain.services.trainer.train import Trainer


class Objective(ABC):
    """One objective's part of a run. Subclasses check the job in `__init__` and implement
    `build_data`, `micro_batches`, `inputs` and `evaluate`; the other hooks default to nothing."""

    reference: Any = None
    """The frozen reference model the loss compares with, where the objective keeps one."""
    rollouts: Any = None
    """The batches of rollouts (GRPO), where the objective samples its own."""

    def __init__(self, job: JobConfig, mesh: Mesh):
        self.mesh = mesh
        self._trainer: Trainer | None = None

    @property
    def trainer(self) -> Trainer:
        """The run this objective was built into (`build`)."""
        assert self._trainer is not None, "Objective.build has not run"
        return self._trainer

    @abstractmethod
    def build_data(self, job: JobConfig, mesh: Mesh) -> TrainData:
        """This rank's batch sources (collective where the data service shares batches)."""

    def use_head(self, model: nn.Module) -> None:
        """Put the objective's head in place of the model's LM head (built, not yet wrapped)."""

    def build(self, trainer: Trainer) -> None:
        """Bind to the run once its model, optimizer state and forward are built."""
        self._trainer = trainer

    @abstractmethod
    def micro_batches(self, step: int, reads: bool) -> list | None:
        """The host micro-batches of step `step` (0-based); None on a pipeline stage that
        reads no data (`reads` False)."""

    @abstractmethod
    def inputs(self, micro: list | None, n: int) -> Iterable:
        """The forward arguments of each of the step's `n` micro-batches, on the device (n Nones
        for a stage that reads no data, `micro` None)."""

    def end_step(self) -> None:
        """After the optimizer step: take what the step's micro-batches kept (statistics)."""

    def step_metrics(self) -> dict[str, float]:
        """Extra columns of a logged step's metrics row (collective: every rank calls it)."""
        return {}

    @abstractmethod
    def evaluate(self) -> float:
        """The validation loss (identical on every rank; collective)."""

    def eval_metrics(self) -> dict[str, float]:
        """Statistics of the last `evaluate`, written as `eval_<name>` columns."""
        return {}


def objective_for(job: JobConfig, mesh: Mesh) -> Objective:
    """The objective of `train.objective`, its checks passed.

    Raises:
        ConfigError: what that objective does not run with.
    """
    if job.train.objective == "dpo":
        from meshtrain.services.trainer.objectives.dpo import DPO

        return DPO(job, mesh)
    if job.train.objective == "reward":
        from meshtrain.services.trainer.objectives.reward_model import RewardModeling

        return RewardModeling(job, mesh)
    if job.train.objective == "grpo":
        from meshtrain.services.trainer.objectives.grpo_steps import GRPO

        return GRPO(job, mesh)
    from meshtrain.services.trainer.objectives.language import LanguageModeling

    return LanguageModeling(job, mesh)


def check_token_ids(batch, job: JobConfig, data: TrainData) -> None:
    """Refuse a token id past the model's vocabulary (data tokenized with another tokenizer
    than data.tokenizer), naming it, instead of an embedding IndexError or a CUDA device
    assert. On the host tensors, before the upload: no device synchronization."""
    if batch.tokens.device.type != "cpu":  # already uploaded (the max would wait for the device)
        return
    vocab = job.model.vocab_size
    assert vocab is not None  # set from the tokenizer as the run is built
    top = max(int(batch.tokens.max()), int(batch.labels.max()))
    if top >= vocab:
        shown = " ".join(map(str, job.data.data_path)) or data.prefix
        raise DataError(
            f"token id {top} is outside the model's vocabulary of {vocab} (tokenizer "
            f"{data.tokenizer}): the data {shown} was preprocessed with another tokenizer; "
            "give that one as --tokenizer"
        )
