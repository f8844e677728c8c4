"""The build steps of a `Trainer`: device, mesh, checks, the sharded model and its wrappers.

`train.Trainer.__init__` calls these in order: the kernel mode and the device, the checks that
refuse what this device cannot run (before any rank builds data or a model), the mesh and the
seed; then this rank's share of the model (built whole, sharded over the mesh), its
data-parallel wrapper, the bf16 weight copies, the compiled forward, the one-line model summary
and, last, the checkpointer. Each step is a function of the job's sections and what the steps
before it built, so `train.py` keeps the loop and the order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshtrain.kernels import dispatch
from meshtrain.services.checkpoint.config import CheckpointConfig
from meshtrain.services.common.client_security import ClientSecurity
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.security import AuthConfig
from meshtrain.services.trainer import checkpoint_saver
from meshtrain.services.trainer.checkpoint_state import Parallel, TrainedModel
from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.config.sections import JobConfig, OptimConfig, TrainConfig
from meshtrain.services.trainer.fp8 import Fp8Model, build_fp8
from meshtrain.services.trainer.metrics import ModelSize
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.model.moe import set_moe_loss_scale
from meshtrain.services.trainer.model.vision import freeze
from meshtrain.services.trainer.parallel import recompute
from meshtrain.services.trainer.parallel.context import parallelize_context
from meshtrain.services.trainer.parallel.data_parallel import DataParallel, forward_units
from meshtrain.services.trainer.parallel.expert import parallelize_experts
from meshtrain.services.trainer.parallel.fsdp import FullyShardedDataParallel
from meshtrain.services.trainer.parallel.mesh import Mesh, env_rank_world, init_process_group
from meshtrain.services.trainer.parallel.pipeline.engine import Pipeline, build_pipeline
from meshtrain.services.trainer.parallel.tensor import parallelize
from meshtrain.services.trainer.weight_copies import WeightCopies

log = logging.getLogger("meshtrain.train")  # the trainer's: the model summary is its first line

CompileOptions = dict[str, str | int | bool | Callable[..., Any]]
"""Inductor options (`torch.compile(options=...)`)."""


def set_kernel_mode(train: TrainConfig) -> None:
    """Set the fused ops' implementation (`dispatch.set_mode`) from train.kernels, train.compile
    and train.compiled_triton_ops."""
    # 'auto' under compile takes the reference ops and lets Inductor fuse them (every op on
    # Triton trained llama-1b slower), except train.compiled_triton_ops (RoPE and SwiGLU by
    # default, which trained it faster; measured: BENCHMARKS.md, 'Training throughput, one GPU'
    # and 'Levers tried and dropped'); `kernels = "triton"` forces them all.
    if train.kernels == "auto" and train.compile:
        if train.compiled_triton_ops:
            dispatch.set_mode("auto", set(train.compiled_triton_ops))
        else:
            dispatch.set_mode("reference")
    else:
        dispatch.set_mode(train.kernels)


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device='cuda' but no CUDA device is available")
        torch.cuda.set_device(env_rank_world()[2])
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_kernel_mode(device: torch.device) -> None:
    """Refuse a kernel mode this run cannot dispatch, before anything is built: an unknown
    $MESHTRAIN_KERNELS, or 'triton' (train.kernels or the variable) off CUDA, where every fused op
    would raise at the first forward (the Triton kernels serve CUDA tensors only)."""
    try:
        mode = dispatch.mode()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mode == "triton" and device.type != "cuda":
        env = os.environ.get("MESHTRAIN_KERNELS")
        source = f"MESHTRAIN_KERNELS={env}" if env else "train.kernels='triton'"
        raise ConfigError(
            f"{source} runs every fused op on its Triton kernel, on CUDA only; this run is on "
            f"{device.type}: use 'auto' or 'reference'"
        )


def check_attention_backend(backend: str, device: torch.device) -> None:
    """Refuse an SDPA backend pinned where PyTorch has none (cuDNN and memory-efficient
    attention are CUDA only), before anything is built, instead of SDPA's "No viable backend"
    traceback at the first forward."""
    if backend in ("cudnn", "efficient") and device.type != "cuda":
        raise ConfigError(
            f"model.attention_backend={backend!r} runs on CUDA only; this run is on {device.type}: "
            "use 'auto', 'flash' or 'math'"
        )


def check_document_attention(job: JobConfig, device: torch.device) -> None:
    """Refuse attention dropout with data.reset_attention_mask on CUDA, where attention within
    documents runs FlexAttention, which has no dropout."""
    if job.data.reset_attention_mask and device.type == "cuda" and job.model.attention_dropout:
        raise ConfigError(
            f"data.reset_attention_mask runs FlexAttention on CUDA, which has no attention "
            f"dropout: set model.attention_dropout=0 (it is {job.model.attention_dropout})"
        )


def check_coordinate_descent_tuning(on: bool, device: torch.device) -> None:
    """Refuse Inductor's coordinate-descent tuning off CUDA, before anything is built: it times
    the Triton kernels Inductor generates on the device. (The tuning itself is the compiled
    model's own option, set where the trainer compiles it.)"""
    if on and device.type != "cuda":
        raise ConfigError(
            f"train.compile_coordinate_descent_tuning tunes the Triton kernels Inductor generates "
            f"for a CUDA device; this run is on {device}"
        )


def build_mesh(job: JobConfig, device: torch.device) -> Mesh:
    """The mesh for this process: trivial when alone, else from torchrun/Slurm's environment."""
    _, world, _ = env_rank_world()
    if world == 1:
        for axis in ("tp", "pp", "cp", "ep"):
            n = getattr(job.parallel, axis)
            if n != 1:
                raise ConfigError(
                    f"parallel.{axis}={n} needs {n} processes; launch with "
                    f"`meshtrain train --nproc-per-node N` or torchrun"
                )
        p = job.parallel
        for key, n in (("dp_shard", p.dp_shard), ("dp_replicate", p.dp_replicate)):
            if n not in (-1, 1):  # else trained unsharded without a word
                raise ConfigError(
                    f"parallel.{key}={n} needs {n} processes; launch with "
                    f"`meshtrain train --nproc-per-node N` or torchrun"
                )
        if p.fully_sharded:
            # dp_shard = 1: nothing to shard over; the model trains whole, as torchtitan does
            log.warning(
                "fully sharded data parallelism (parallel.data_parallel_sharding_strategy=%r) in "
                "one process: dp_shard = 1, the model is not sharded (launch several ranks to "
                "shard it)",
                p.data_parallel_sharding_strategy,
            )
        return Mesh.single()
    timeout_s = job.parallel.distributed_timeout_minutes * 60
    init_process_group("nccl" if device.type == "cuda" else "gloo", timeout_s=timeout_s)
    mesh = Mesh.build(
        tp=job.parallel.tp,
        pp=job.parallel.pp,
        cp=job.parallel.cp,
        ep=job.parallel.ep,
        timeout_s=timeout_s,
        cp_a2a=job.parallel.cp_a2a_size,
        dp_replicate=job.parallel.dp_replicate,
    )
    if job.parallel.dp_shard not in (-1, mesh.dp_shard):
        raise ConfigError(
            f"parallel.dp_shard={job.parallel.dp_shard}: the {mesh.dp} data-parallel ranks over "
            f"parallel.dp_replicate={mesh.dp_replicate} replicas leave {mesh.dp_shard} per replica"
        )
    return mesh


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(
    job: JobConfig, mesh: Mesh, device: torch.device
) -> tuple[TrainedModel, Fp8Model | None, Pipeline | None]:
    """This rank's share of the job's model, on `device`: built whole from the current RNG state
    (the same on every rank), then sharded over the mesh's cp, tp and ep groups, its dense linears
    swapped for FP8 ones with train.fp8, and cut to this rank's pipeline chunks with pp > 1.

    Returns:
        (the model, or the pipeline stage holding this rank's chunks; the FP8 layers' state or
        None; the pipeline runtime or None).
    """
    gpt = GPT(job.model)  # full weights, same seed on every rank: sharding slices them
    parallelize_context(gpt, mesh, job.parallel.cp_comm_type)
    recompute.apply(gpt, job.parallel)
    parallelize(
        gpt,
        mesh,
        job.parallel.sequence_parallel,
        job.parallel.tp_comm_overlap,
        device,
        async_grad_reduce=job.parallel.tp_async_grad_reduce,
    )
    # after tp made new parameters of the sharded weights; the optimizer, data parallelism and
    # the checkpoint's optimizer state then see only the trained ones
    freeze(
        gpt,
        vision=job.train.freeze_vision,
        projector=job.train.freeze_projector,
        language_model=job.train.freeze_language_model,
    )
    parallelize_experts(gpt, mesh)  # this ep rank's experts; MoE statistics over dp x cp
    # after tp sharded them and ep picked this rank's experts (train.fp8_experts converts those),
    # before pp splits
    fp8 = build_fp8(gpt, job.train, mesh, device)
    pipeline = None
    if mesh.pp > 1:  # this rank's chunks of the model, and the runtime that runs its schedule
        pipeline = build_pipeline(gpt, mesh, job, device)  # scales the MoE aux losses too
        model: TrainedModel = pipeline.stage
    else:  # each micro-batch's loss is divided by their number: the aux losses' gradients too
        set_moe_loss_scale(gpt, mesh.dp * job.train.micro_batch_size / job.train.global_batch_size)
        model = gpt
    return model.to(device), fp8, pipeline


def build_data_parallel(
    model: torch.nn.Module,
    mesh: Mesh,
    parallel: ParallelConfig,
    optim: OptimConfig,
    pipeline: Pipeline | None,
    bf16_params: bool = False,
) -> DataParallel | FullyShardedDataParallel | None:
    """The data-parallel wrapper of this rank's `model` (its pipeline stage with `pipeline`):
    FSDP2's with parallel.use_torch_fsdp2; None in a single process. `bf16_params`: bf16
    parameters with fp32 masters offloaded (optim.offload_bf16_params)."""
    if not mesh.distributed:
        return None
    p = parallel
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[p.grad_reduce_dtype]
    if p.fully_sharded:
        return FullyShardedDataParallel(
            model,
            mesh,
            optim,
            reshard_after_forward=p.reshard_after_forward,
            reduce_dtype=reduce_dtype,
            tied_weight=pipeline.tied_weight if pipeline else None,
        )
    return DataParallel(
        model,
        mesh,
        optim,
        distributed_optimizer=p.use_distributed_optimizer,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        bucket_size=p.ddp_bucket_size,
        gather_units=pipeline.stage.forward_units() if pipeline else forward_units(_whole(model)),
        reduce_dtype=reduce_dtype,
        tied=pipeline.tied_weight() if pipeline else None,
        bf16_params=bf16_params,
    )


def _whole(model: torch.nn.Module) -> GPT:
    """The model of a run without pipeline parallelism: the whole GPT."""
    assert isinstance(model, GPT)
    return model


def build_weight_copies(
    model: torch.nn.Module, train: TrainConfig, mesh: Mesh, device: torch.device
) -> WeightCopies | None:
    """The bf16 weight copies train.bf16_weight_copies asks for (unset: under train.bf16 in a
    single process), with train.gradient_accumulation_fusion (unset: on CUDA) and
    train.expert_gradient_accumulation_fusion; None without.

    Raises:
        ConfigError: the copies, or either fusion into them, asked for where there are none
            (several ranks, bf16 parameters).
    """
    built = _weight_copies(model, train, mesh, device)
    if built is None and train.expert_gradient_accumulation_fusion:
        raise ConfigError(
            "train.expert_gradient_accumulation_fusion adds into the fp32 gradients beside the "
            "bf16 weight copies, and this job has none (they need a single process, this job has "
            f"{mesh.world_size} ranks, and fp32 parameters, not optim.offload_bf16_params' bf16)"
        )
    return built


def _weight_copies(
    model: torch.nn.Module, train: TrainConfig, mesh: Mesh, device: torch.device
) -> WeightCopies | None:
    """`build_weight_copies` before the expert fusion's refusal."""
    copies = train.bf16_weight_copies
    if any(p.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad):
        # bf16 device parameters (optim.offload_bf16_params): the model runs on them; an
        # explicit train.bf16_weight_copies is refused with them by the config check
        return None
    if copies and mesh.distributed:
        raise ConfigError(
            f"train.bf16_weight_copies runs in a single process; this job has {mesh.world_size} "
            f"ranks (tp={mesh.tp}, dp={mesh.dp}), whose gradient reductions hook the fp32 "
            "parameters: leave it unset or run one process"
        )
    fusion = train.gradient_accumulation_fusion
    if copies or (copies is None and train.bf16 and not mesh.distributed):
        fuse = fusion if fusion is not None else device.type == "cuda"
        return WeightCopies(
            model,
            torch.bfloat16,
            fuse_weight_grads=fuse,
            fuse_expert_weight_grads=train.expert_gradient_accumulation_fusion,
        )
    if fusion:
        raise ConfigError(
            "train.gradient_accumulation_fusion adds into the fp32 gradients from the bf16 weight "
            f"copies' GEMMs, and this job has none ({mesh.world_size} ranks: the copies run in a "
            "single process)"
        )
    return None


def compile_options(train: TrainConfig) -> CompileOptions | None:
    """Inductor options for everything the trainer compiles
    (train.compile_coordinate_descent_tuning)."""
    return {"coordinate_descent_tuning": True} if train.compile_coordinate_descent_tuning else None


def compiles_per_block(
    train: TrainConfig,
    parallel: ParallelConfig,
    pipelined: bool,
    fully_sharded: bool = False,
) -> bool:
    """Whether train.compile compiles the model block by block (`compile_model`) rather than whole:
    with a pipeline, parallel.overlap_param_gather, FSDP2 (`fully_sharded`) or full recompute."""
    return train.compile and (
        pipelined
        or parallel.overlap_param_gather
        or fully_sharded
        or parallel.recompute_granularity == "full"
    )


def compile_model(
    model: TrainedModel,
    train: TrainConfig,
    options: CompileOptions | None,
    parallel: ParallelConfig,
    pipelined: bool,
    fully_sharded: bool = False,
) -> Callable[..., Any]:
    """What a step runs the model through: under train.compile the compiled model or, where
    `compiles_per_block`, the model itself with each block and the loss head compiled in place;
    without train.compile the model."""
    if compiles_per_block(train, parallel, pipelined, fully_sharded):
        # Per-block compile keeps the all-gather waits (forward pre-hooks; FSDP2's, which
        # dynamo does not trace, as torchtitan compiles each block) outside the compiled
        # graphs, so they cost no graph breaks inside a block. Under full recompute it keeps
        # the checkpoint outside the compiled graphs, as torchtitan applies activation
        # checkpointing before compiling each block: a recomputed block then holds only its
        # input, and backward recomputes one block at a time. Compiled whole, the partitioner
        # and Inductor schedule the recompute of every block inside one backward graph, which
        # held far more than the blocks' inputs (BENCHMARKS.md, 'Long sequences').
        layers = model.layers  # a pipeline stage's by global number, a GPT's in order
        for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
            layer.compile(options=options)
        vision = getattr(model, "vision", None)
        if vision is not None and not pipelined:
            for layer in vision.layers:
                layer.compile(options=options)
        # And the output projection + loss: left eager, its matmuls ran a slow legacy GEMM
        # kernel and its softmax unfused, and ZeRO-1 + overlap scaled far less (measured:
        # BENCHMARKS.md, 'Parallel scaling, 2× H200').
        # in place: whatever holds the head keeps calling head.loss
        model.head.loss = torch.compile(model.head.loss, options=options)  # type: ignore[method-assign]
    elif train.compile:
        return torch.compile(model, options=options)
    return model


def check_cuda_graph(device: torch.device, mesh: Mesh, job: JobConfig) -> None:
    """Refuse train.cuda_graph where it cannot capture the step: off CUDA, with several ranks, or
    with a mixture of experts where the grouped expert GEMM cannot run (its per-expert loop
    reads the counts on the host; the config checks refused the other MoE cases already)."""
    if device.type != "cuda":
        raise ConfigError(f"train.cuda_graph needs a CUDA device; this run is on {device}")
    if mesh.distributed:
        raise ConfigError(
            f"train.cuda_graph runs in a single process; this job has {mesh.world_size} ranks, "
            "whose gradient reductions and collectives are not captured: leave it off or run one "
            "process"
        )
    if job.model.num_experts is None:
        return
    capability = torch.cuda.get_device_capability(device)
    if not hasattr(torch, "_grouped_mm") or capability[0] < 9 or not job.train.bf16:
        raise ConfigError(
            "train.cuda_graph captures a mixture of experts only where its grouped expert GEMM "
            f"runs (bf16 on compute capability 9.0 or newer); this run has train.bf16="
            f"{job.train.bf16} on a GPU of capability {capability[0]}.{capability[1]}, where the "
            "experts run as a loop that reads their token counts on the host: leave "
            "train.cuda_graph off"
        )


def log_model_summary(
    job: JobConfig,
    mesh: Mesh,
    device: torch.device,
    size: ModelSize,
    fp8: Fp8Model | None,
    weight_copies: WeightCopies | None,
    pipeline: Pipeline | None,
) -> None:
    """Log the model's size, precision and parallel layout in one line."""
    m, p = mesh, job.parallel
    precision = ", bf16 autocast" if job.train.bf16 else ""
    if fp8 is not None:
        precision += f", {fp8.describe()}"
    if weight_copies is not None:
        precision += ", bf16 weight copies"
        if weight_copies.fused:
            precision += " with fused gradient accumulation"
    active = (
        f" ({size.active_parameters / 1e6:.2f}M active: top-{job.model.moe_router_topk} of "
        f"{job.model.num_experts} experts)"
        if job.model.num_experts
        else ""
    )
    log.info(
        "model: %.2fM parameters%s, %.3g FLOPs/token, device %s%s; "
        "mesh tp=%d cp=%d pp=%d dp=%d ep=%d (world %d)%s%s%s%s",
        size.parameters / 1e6,
        active,
        size.flops_per_token,
        device,
        precision,
        m.tp,
        m.cp,
        m.pp,
        m.dp,
        m.ep,
        m.world_size,
        ", sequence parallel" if p.sequence_parallel else "",
        f", context parallel {p.cp_comm_type}" if m.cp > 1 else "",
        f", {pipeline.describe()}" if pipeline else "",
        f", fully sharded ({p.data_parallel_sharding_strategy}, dp_shard={m.dp_shard}"
        f"{f' x dp_replicate={m.dp_replicate}' if m.dp_replicate > 1 else ''})"
        if p.fully_sharded and m.distributed
        else "",
    )


def open_checkpointer(
    c: CheckpointConfig, par: Parallel, resumed_step: int | None, auth: AuthConfig
) -> checkpoint_saver.Checkpointer:
    """The checkpointer of checkpoint section `c`: local, or through the checkpoint service
    (checkpoint.service_address) with the client credentials of `auth`."""
    assert c.save is not None  # the trainer fills it in (RUN_DIR/checkpoints) before this
    return checkpoint_saver.Checkpointer(
        c.save,
        par,
        c.async_save,
        c.service_address,
        overwrite=c.overwrite,
        resumed_step=resumed_step,
        attempts=c.save_attempts,
        backoff=c.save_retry_backoff_s,
        retry_timeout=c.save_retry_timeout_s,
        direct=c.service_direct,
        security=ClientSecurity.from_config(auth) if c.service_address else None,
    )
