"""Building a job's pipeline: split the model, pick and check the schedule, wire the runtime.

pipeline = build_pipeline(model, mesh, job, device)   # model: full GPT, tensor-parallel already
pipeline.stage                                         # this rank's chunks (an nn.Module)
loss = pipeline.step(micro_batches)                    # one step's forward and backward
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.model.moe import MoE
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.pipeline.runtime import PipelineRuntime
from meshtrain.services.trainer.parallel.pipeline.stage import PipelineStage, stage_layers
from meshtrain.services.trainer.parallel.pipeline.zero_bubble import (
    DeferrableLinear,
    WeightGradStore,
)
from meshtrain.services.trainer.parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
)


class Pipeline:
    """A rank's stage and runtime, and what the trainer asks of them."""

    def __init__(
        self,
        stage: PipelineStage,
        runtime: PipelineRuntime,
        schedule: str,
        per_document: bool = False,
    ):
        self.stage, self.runtime, self.schedule = stage, runtime, schedule
        self.per_document = per_document  # micro-batches carry document ids / positions

    @property
    def n_micro(self) -> int:
        return self.runtime.n_micro

    @property
    def reads_data(self) -> bool:
        """The first stage needs tokens, the last labels and the loss mask; middle stages
        nothing, unless attention or positions follow packed documents (every stage's blocks
        need the document ids and positions)."""
        return self.stage.is_first or self.stage.is_last or self.per_document

    def attach(self, ddp, autocast) -> None:
        """Wire in what the trainer builds after the stage: data parallelism (its reductions start
        in a chunk's last backward; deferred weight gradients report to it) and the forward's
        autocast context."""
        self.runtime.ddp, self.runtime.autocast = ddp, autocast
        if self.runtime.store is not None:
            self.runtime.store.on_ready = ddp.grad_ready

    def tied_weight(self) -> nn.Parameter | None:
        """The word embedding this rank shares with the other end of the pipeline (tied
        embeddings: the first stage's, or the last stage's copy), else None."""
        s = self.stage
        if s.config.untie_embeddings_and_output_weights or s.embedding is None:
            return None
        weight = s.embedding.word_embeddings.weight
        assert isinstance(weight, nn.Parameter)  # typed Tensor by torch's stubs
        return weight

    def step(self, micro) -> torch.Tensor:
        return self.runtime.step(micro)

    def describe(self) -> str:
        s = self.stage
        chunks = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) else "none" for r in s.chunk_layers)
        return (
            f"pipeline stage {s.pp_rank}/{s.pp} ({self.schedule}, {self.n_micro} micro-batches, "
            f"blocks {chunks})"
        )


def _defer_weight_grads(stage: PipelineStage, store: WeightGradStore) -> None:
    """Route every block linear through `store` (zero-bubble schedules); names do not change.

    In a MoE block the attention and the shared expert's linears are deferred; the router and
    the stacked expert GEMMs compute their weight gradients in the backward-input action."""
    for layer in stage.layers.values():
        mlps = (
            [layer.mlp]
            if not isinstance(layer.mlp, MoE)
            else ([layer.mlp.shared_expert] if layer.mlp.shared_expert is not None else [])
        )
        linears = [(layer.attention, "qkv"), (layer.attention, "proj")]
        linears += [(mlp, name) for mlp in mlps for name in ("fc1", "fc2")]
        for parent, name in linears:
            module = getattr(parent, name)
            module.weight.grad_deferred = True  # DataParallel: final in W, not in autograd's hook
            if isinstance(module, nn.Linear):
                setattr(parent, name, DeferrableLinear(module, store))
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.linear = store.linear
                module.async_grad = False  # its fused backward computes dW on the spot
            else:
                raise ConfigError(
                    "zero-bubble schedules cannot defer the weight gradient of "
                    f"{type(module).__name__}"
                )


def activation_shape(job: JobConfig, tp: int) -> tuple[tuple[int, ...], torch.dtype]:
    """What flows between stages: (micro_batch, this rank's tokens: seq/cp, over tp too with
    sequence parallelism, hidden), in the residual stream's dtype (bf16 under bf16 autocast
    unless fp32_residual_connection)."""
    m, p = job.model, job.parallel
    seq = m.seq_length // p.cp
    seq = seq // tp if p.sequence_parallel else seq
    bf16 = job.train.bf16 and not m.fp32_residual_connection
    # a micro-batch of preference pairs is their chosen and rejected sequences
    sequences = job.train.micro_batch_size * (2 if job.train.objective == "dpo" else 1)
    return (
        sequences,
        seq,
        m.hidden_size,
    ), torch.bfloat16 if bf16 else torch.float32


def build_pipeline(model: GPT, mesh: Mesh, job: JobConfig, device: torch.device) -> Pipeline:
    """This rank's stage of `model` and a runtime for the job's schedule (see the module docstring).

    Raises:
        ConfigError: a layout that does not split, a schedule that cannot run these sizes, or a
            setting the schedule cannot compose with.
    """
    p, t = job.parallel, job.train
    chunks = p.pipeline_chunks(job.model.num_layers)
    schedule = p.resolved_pipeline_schedule(job.model.num_layers)
    if chunks > 1 and schedule != "interleaved":
        raise ConfigError(
            f"parallel.pipeline_schedule={schedule!r} runs one model chunk per rank; with "
            f"{chunks} virtual stages per rank use 'interleaved' (or 'auto')"
        )
    if schedule == "interleaved" and chunks == 1:
        raise ConfigError(
            "parallel.pipeline_schedule='interleaved' needs virtual stages: set "
            "parallel.virtual_pipeline_model_parallel_size or num_layers_per_virtual_pipeline_stage"
        )
    if schedule == "zb-h1":
        if t.compile:
            raise ConfigError(
                "parallel.pipeline_schedule='zb-h1' defers weight gradients through Python "
                "closures, which torch.compile cannot trace: leave train.compile off or use '1f1b'"
            )
        if p.tp_comm_overlap:
            raise ConfigError(
                "parallel.pipeline_schedule='zb-h1' and parallel.tp_comm_overlap both take over "
                "the linears' backward: use one of them"
            )
    stages = stage_layers(
        job.model.num_layers,
        mesh.pp,
        chunks,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
        p.pipeline_layout,
    )
    for r in range(1, mesh.pp - 1):  # checked for every rank on every rank: all refuse alike
        if not any(len(stages[c * mesh.pp + r]) for c in range(chunks)):
            raise ConfigError(
                f"parallel.pipeline_layout={p.pipeline_layout} leaves pipeline rank {r} without "
                "blocks, and a middle rank holds no embedding or head: give it at least one block"
            )
    stage = PipelineStage(model, mesh.pp_rank, mesh.pp, stages, p)
    store = None
    if schedule == "zb-h1":
        store = WeightGradStore()
        _defer_weight_grads(stage, store)
    n_micro = t.global_batch_size // (t.micro_batch_size * mesh.dp)
    shape, dtype = activation_shape(job, mesh.tp)
    runtime = PipelineRuntime(
        stage, mesh, schedule, n_micro, shape, dtype, device, weight_store=store
    )
    per_document = job.data.reset_attention_mask or job.data.reset_position_ids
    return Pipeline(stage, runtime, schedule, per_document)
