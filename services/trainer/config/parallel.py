"""The job config's `parallel` section: the parallel layout and the memory plan.

`ParallelConfig` holds the parallel layout (tp, pp, cp, ep; dp is what the world size leaves),
the pipeline's chunks and schedule, data-parallel overlap and the recompute plan, and refuses
settings that contradict each other. What the model, the loop or FP8 need of that layout is
checked across sections by `checks.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from meshtrain.services.common.errors import ConfigError

log = logging.getLogger("meshtrain.config")


@dataclass
class ParallelConfig:
    """Parallel layout and memory plan. dp is whatever world size the other degrees leave."""

    tp: int = 1
    """Tensor-parallel degree (--tensor-model-parallel-size)."""
    pp: int = 1
    """Pipeline-parallel degree (--pipeline-model-parallel-size): blocks split over pp stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank, for the interleaved schedule (Megatron's flag of the same
    name); unset: 1, or num_layers / (pp x num_layers_per_virtual_pipeline_stage)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Blocks per virtual pipeline stage (Megatron's flag); the other way to set the chunks."""
    decoder_first_pipeline_num_layers: int | None = None
    """Blocks on the first pipeline stage when they do not split evenly (Megatron's flag); the
    stages without a fixed count share the rest evenly."""
    decoder_last_pipeline_num_layers: int | None = None
    """Blocks on the last pipeline stage (Megatron's flag)."""
    pipeline_layout: list[int] | None = None
    """Explicit block counts per virtual pipeline stage, in stage order (pp x chunks entries,
    0 allowed); overrides the even split and the first/last counts."""
    pipeline_schedule: Literal["auto", "none", "gpipe", "1f1b", "interleaved", "zb-h1"] = "auto"
    """Pipeline schedule: 'auto' is 1f1b, or interleaved with more than one chunk per rank (as
    Megatron); 'zb-h1' splits the backward and defers the weight gradients into the bubble;
    'gpipe' runs every forward first; 'none' one micro-batch at a time (a reference)."""
    cp: int = 1
    """Context-parallel degree (--context-parallel-size): each sequence split over cp ranks, in
    2·cp chunks with rank i holding chunks i and 2·cp−1−i (causal load balance)."""
    cp_comm_type: Literal["p2p", "a2a", "a2a+p2p"] = "p2p"
    """How context-parallel attention exchanges data (--cp-comm-type): 'p2p' rotates key/value
    blocks around a ring overlapped with attention; 'a2a' swaps sequence for heads with
    all-to-alls (DeepSpeed-Ulysses: the heads per tp rank must split over cp, or the key/value
    heads repeat to it); 'a2a+p2p' all-to-all inside groups of
    hierarchical_context_parallel_sizes[0] ranks and a ring across them."""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """For cp_comm_type 'a2a+p2p': [all-to-all size, ring size], product cp
    (--hierarchical-context-parallel-sizes)."""
    ep: int = 1
    """Expert-parallel degree (--expert-model-parallel-size): each MoE layer's experts are split
    over ep consecutive ranks of a dp x cp group (num_experts / ep each), tokens travel to them by
    all-to-all, and their gradients are averaged over the ranks holding the same experts. Must
    divide dp x cp and model.num_experts; needs model.num_experts."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel degree of the expert weights (--expert-tensor-parallel-size); unset: tp.
    Only tp itself is supported (each expert's inner width split over the tp ranks, as the dense
    MLP's); another value is refused."""
    sequence_parallel: bool = False
    """Shard norm/dropout regions along the sequence (needs tp > 1)."""
    tp_comm_overlap: bool = False
    """With sequence_parallel on CUDA/NCCL: overlap each linear's all-gather / reduce-scatter
    with its matmul (PyTorch symmetric-memory fused ops), as Megatron's --tp-comm-overlap. Exact,
    but at llama-1b TP=2 + SP it trained no faster than one GPU, far slower than without it
    (measured: BENCHMARKS.md, 'Levers tried and dropped'), so off; kept because Megatron users
    ask for it by that flag."""
    tp_async_grad_reduce: bool = True
    """Column-parallel linears launch the reduction of their input gradient (reduce-scatter with
    sequence parallelism, else all-reduce) before computing their weight gradient, so the two
    overlap (Megatron's asynchronous tensor-parallel all-reduce, on by default there too). Same
    arithmetic, a little faster at llama-1b TP=2 (measured: BENCHMARKS.md, 'Parallel scaling, 2×
    H200'). Nothing to do at tp=1; tp_comm_overlap, which fuses these collectives with the GEMMs
    instead, takes precedence."""
    distributed_timeout_minutes: float = 10.0
    """How long a collective waits for a peer rank before it raises and the rank exits 1
    (--distributed-timeout-minutes, as Megatron). A rank that dies is noticed at once (its
    connections close); one that hangs (SIGSTOP, stuck storage, a deadlock) only through this
    timeout, on the ranks waiting for it: the job ends after it (plus the launcher's 15 s)."""
    use_distributed_optimizer: bool = False
    """Shard Adam state over data-parallel ranks (ZeRO-1): reduce-scatter grads, all-gather
    params."""
    use_torch_fsdp2: bool = False
    """Fully sharded data parallelism on torch's FSDP2 (--use-torch-fsdp2): parameters, gradients
    and Adam state split over the dp_shard ranks, each block's parameters all-gathered just
    before its forward (the next block's prefetched) and its gradients reduce-scattered during
    the backward. The sharding is data_parallel_sharding_strategy's (unset: 'optim_grads_params',
    ZeRO-3)."""
    data_parallel_sharding_strategy: (
        Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None
    ) = None
    """What data-parallel ranks split (Megatron's --data-parallel-sharding-strategy): 'no_shard'
    nothing (plain DP); 'optim' the Adam state (ZeRO-1, the same as use_distributed_optimizer);
    'optim_grads' Adam state and gradients, parameters kept whole between forward and backward
    (ZeRO-2: FSDP2 with reshard_after_forward off); 'optim_grads_params' all three (ZeRO-3:
    each block's parameters gathered again for its backward). The last two run on FSDP2
    (use_torch_fsdp2). Unset: 'optim_grads_params' with use_torch_fsdp2, else 'optim' or
    'no_shard' by use_distributed_optimizer."""
    dp_replicate: int = 1
    """Hybrid sharding (torchtitan's data_parallel_replicate_degree): the data-parallel ranks
    form this many replicas, each fully sharding the model over dp / dp_replicate ranks, whose
    gradients are then averaged over the replicas. FSDP2 only; must divide dp."""
    dp_shard: int = -1
    """Ranks the model is fully sharded over (torchtitan's data_parallel_shard_degree): -1 is
    what the world size leaves (dp / dp_replicate); a value must equal it. FSDP2 only."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket as soon as backward has finished it (FSDP2 always does, per
    block)."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather each bucket's parameters just before the forward uses
    them (FSDP2 always does, per block)."""
    ddp_bucket_size: int = 40_000_000
    """Elements per gradient bucket."""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """What the data-parallel gradient reduction sends: the fp32 gradients as accumulated, or a
    bf16 copy of each bucket (half the bytes on the wire; each rank's contribution and the
    partial sums are rounded to bf16, and the result is copied back into the fp32 buffers).
    Accumulation over micro-batches stays fp32 (Megatron's --grad-reduce-in-bf16, also accepted,
    makes the buffers themselves bf16); the copies cost 2 bytes per parameter (ZeRO-1: plus
    2/dp) while the reductions are in flight. No effect at dp=1. At llama-1b DP=2 + ZeRO-1 no
    faster than fp32, whose reduction already runs under the backward (measured: BENCHMARKS.md,
    'Levers tried and dropped'); kept as Megatron's option for links where it does not (not
    measured here)."""
    recompute_granularity: Literal["none", "full", "selective"] = "none"
    """Activation recompute: whole blocks ('full') or only the attention core ('selective')."""
    recompute_method: Literal["uniform", "block"] | None = None
    """'full' only (refused otherwise; Megatron-LM refuses it with 'selective'): 'uniform'
    recomputes every chunk of recompute_num_layers blocks; 'block' recomputes the first
    recompute_num_layers blocks and stores the rest. Unset with 'full': 'uniform'."""
    recompute_num_layers: int | None = None
    """'full' only (refused otherwise): chunk size ('uniform') or number of recomputed blocks
    ('block'). Unset with 'full': 1."""

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(self, key) < 1:
                raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(self, key)}")
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp != self.tp:
            raise ConfigError(
                f"parallel.expert_tensor_parallel_size={etp}: only the tensor-parallel degree "
                f"itself (parallel.tp={self.tp}) is supported; leave it unset"
            )
        self._check_pipeline()
        self._check_context()
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ConfigError("parallel.tp_comm_overlap needs parallel.sequence_parallel")
        if not self.distributed_timeout_minutes > 0:
            raise ConfigError(
                f"parallel.distributed_timeout_minutes must be a positive number of minutes, "
                f"got {self.distributed_timeout_minutes}"
            )
        self._resolve_sharding()
        if self.overlap_param_gather and not (
            self.use_distributed_optimizer or self.use_torch_fsdp2
        ):
            raise ConfigError(
                "parallel.overlap_param_gather needs parallel.use_distributed_optimizer (or "
                "parallel.use_torch_fsdp2)"
            )
        self._resolve_recompute_plan()
        if self.ddp_bucket_size <= 0:
            raise ConfigError(
                f"parallel.ddp_bucket_size must be positive, got {self.ddp_bucket_size}"
            )

    @property
    def fully_sharded(self) -> bool:
        """Data parallelism runs on FSDP2 (strategy 'optim_grads' or 'optim_grads_params')."""
        return self.use_torch_fsdp2

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2 frees each block's gathered parameters after its forward (ZeRO-3), or keeps them
        for the backward (ZeRO-2)."""
        return self.data_parallel_sharding_strategy == "optim_grads_params"

    def _resolve_sharding(self) -> None:
        """Fill in data_parallel_sharding_strategy from use_torch_fsdp2 / use_distributed_optimizer
        (or those from it), refusing settings that say different things."""
        s = self.data_parallel_sharding_strategy
        if s is None:
            s = (
                "optim_grads_params"
                if self.use_torch_fsdp2
                else ("optim" if self.use_distributed_optimizer else "no_shard")
            )
        if s in ("optim_grads", "optim_grads_params"):
            if self.use_distributed_optimizer:
                raise ConfigError(
                    f"parallel.data_parallel_sharding_strategy={s!r} shards the Adam state on "
                    "FSDP2 itself; leave parallel.use_distributed_optimizer (ZeRO-1) off"
                )
            self.use_torch_fsdp2 = True
        elif self.use_torch_fsdp2:
            raise ConfigError(
                "parallel.use_torch_fsdp2 shards gradients and Adam state (and parameters): "
                "parallel.data_parallel_sharding_strategy must be 'optim_grads' or "
                f"'optim_grads_params', got {s!r}"
            )
        elif s == "optim":
            self.use_distributed_optimizer = True
        elif self.use_distributed_optimizer:
            raise ConfigError(
                "parallel.use_distributed_optimizer is data_parallel_sharding_strategy 'optim'; "
                "it contradicts 'no_shard'"
            )
        self.data_parallel_sharding_strategy = s
        if self.dp_replicate < 1 or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ConfigError(
                f"parallel.dp_replicate must be >= 1 and parallel.dp_shard >= 1 or -1 (the rest), "
                f"got {self.dp_replicate} and {self.dp_shard}"
            )
        if not self.use_torch_fsdp2 and (self.dp_replicate != 1 or self.dp_shard != -1):
            key = "dp_replicate" if self.dp_replicate != 1 else "dp_shard"
            raise ConfigError(
                f"parallel.{key} splits the data-parallel ranks for fully sharded data "
                "parallelism; set parallel.use_torch_fsdp2 (or a sharding strategy "
                "'optim_grads' / 'optim_grads_params') or leave it unset"
            )

    def _check_context(self) -> None:
        """Refuse a hierarchical split that does not match cp_comm_type or multiply to cp."""
        sizes = self.hierarchical_context_parallel_sizes
        if self.cp_comm_type == "a2a+p2p":
            if self.cp == 1:
                raise ConfigError("parallel.cp_comm_type='a2a+p2p' needs parallel.cp > 1")
            if sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != self.cp or min(sizes) < 1:
                raise ConfigError(
                    "parallel.cp_comm_type='a2a+p2p' needs "
                    "parallel.hierarchical_context_parallel_sizes = [all-to-all size, ring size] "
                    f"multiplying to parallel.cp={self.cp}, got {sizes}"
                )
        elif sizes is not None:
            raise ConfigError(
                "parallel.hierarchical_context_parallel_sizes is for cp_comm_type='a2a+p2p'; "
                f"cp_comm_type is {self.cp_comm_type!r}"
            )

    @property
    def cp_a2a_size(self) -> int:
        """Context-parallel ranks one all-to-all spans (1 with the ring alone)."""
        if self.cp_comm_type == "a2a":
            return self.cp
        if self.cp_comm_type == "a2a+p2p":
            sizes = self.hierarchical_context_parallel_sizes
            assert sizes is not None  # __post_init__ requires them with 'a2a+p2p'
            return sizes[0]
        return 1

    def _check_pipeline(self) -> None:
        """Refuse pipeline settings that a pp of 1 would ignore, or that contradict each other."""
        keys = (
            "virtual_pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
            "pipeline_layout",
        )
        given = [k for k in keys if getattr(self, k) is not None]
        if self.pp == 1 and (given or self.pipeline_schedule not in ("auto", "none")):
            what = given[0] if given else f"pipeline_schedule={self.pipeline_schedule!r}"
            raise ConfigError(f"parallel.{what} applies to pipeline parallelism; parallel.pp is 1")
        if (
            self.virtual_pipeline_model_parallel_size is not None
            and self.num_layers_per_virtual_pipeline_stage
        ):
            raise ConfigError(
                "set one of parallel.virtual_pipeline_model_parallel_size and "
                "parallel.num_layers_per_virtual_pipeline_stage, not both"
            )
        for k in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                raise ConfigError(f"parallel.{k} must be >= 1, got {getattr(self, k)}")
        if self.pipeline_layout is not None and (
            self.decoder_first_pipeline_num_layers is not None
            or self.decoder_last_pipeline_num_layers is not None
        ):
            raise ConfigError(
                "parallel.pipeline_layout lists every stage's blocks; leave "
                "decoder_first/last_pipeline_num_layers unset with it"
            )

    def pipeline_chunks(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (virtual stages), from whichever setting is given."""
        if self.virtual_pipeline_model_parallel_size is not None:
            return self.virtual_pipeline_model_parallel_size
        if self.num_layers_per_virtual_pipeline_stage is not None:
            per = self.num_layers_per_virtual_pipeline_stage
            if num_layers % (self.pp * per):
                raise ConfigError(
                    f"model.num_layers={num_layers} is not a multiple of parallel.pp={self.pp} x "
                    f"num_layers_per_virtual_pipeline_stage={per}"
                )
            return num_layers // (self.pp * per)
        if self.pipeline_layout is not None:
            if len(self.pipeline_layout) % self.pp:
                raise ConfigError(
                    f"parallel.pipeline_layout has {len(self.pipeline_layout)} entries, not a "
                    f"multiple of parallel.pp={self.pp}"
                )
            return len(self.pipeline_layout) // self.pp
        return 1

    def resolved_pipeline_schedule(self, num_layers: int) -> str:
        """The schedule 'auto' stands for here (1f1b, or interleaved with chunks)."""
        if self.pipeline_schedule != "auto":
            return self.pipeline_schedule
        return "interleaved" if self.pipeline_chunks(num_layers) > 1 else "1f1b"

    def _resolve_recompute_plan(self) -> None:
        """Refuse a method or layer count the granularity would ignore; fill in 'full''s defaults.

        Megatron-LM refuses recompute_method and recompute_num_layers with 'selective'; with no
        recompute it ignores them, which here is refused too (nothing is silently ignored).
        """
        if self.recompute_num_layers is not None and self.recompute_num_layers <= 0:
            raise ConfigError(
                f"parallel.recompute_num_layers must be positive, got {self.recompute_num_layers}"
            )
        if self.recompute_granularity == "full":
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
            return
        if (self.recompute_method, self.recompute_num_layers) == ("uniform", 1):
            # The defaults of both keys before they became unset: every config.toml written then
            # holds them, whatever the granularity, and must still load
            # (`--config RUN/config.toml`).
            log.warning(
                "parallel.recompute_method='uniform' and parallel.recompute_num_layers=1 have no "
                "effect with parallel.recompute_granularity=%r (a config written before they "
                "defaulted to unset); read as unset: remove them",
                self.recompute_granularity,
            )
            self.recompute_method = self.recompute_num_layers = None
        given = [
            f"parallel.{key}={getattr(self, key)!r}"
            for key in ("recompute_method", "recompute_num_layers")
            if getattr(self, key) is not None
        ]
        if given:
            raise ConfigError(
                f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to "
                f"parallel.recompute_granularity='full' only, got {self.recompute_granularity!r}: "
                "set --recompute-granularity full, or leave them unset"
            )
