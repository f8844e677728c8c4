"""The trainer's job config: one dataclass per component, TOML files, overrides and aliases.

A job config has the sections `model`, `data`, `train`, `optim`, `parallel`, `checkpoint`,
`log` and `auth` (tokens and TLS for the services and the control endpoint); each component
receives only its own section. Sources apply in order: defaults, the `--config FILE` TOML,
then command-line overrides, either `--section.key=value` or a Megatron-style alias
(`--hidden-size 768`, `--bf16`). Unknown keys, wrong types and flags for
features that are not built yet are errors that name the key.

    meshtrain train --config deploy/configs/tiny.toml --train-iters 50 --model.num_layers=4
    meshtrain train --help-config        # every key, its type, default and documentation
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from meshtrain.services.checkpoint.config import CheckpointConfig
from meshtrain.services.common import config as cfg
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig  # re-exported: the job's `model` section
from meshtrain.services.common.security import AuthConfig
from meshtrain.services.dataloader.config import DataConfig
from meshtrain.services.trainer.flags import (  # re-exported: the command line's half
    ALIASES,
    accepted_flags,
    parse_overrides,
)
from meshtrain.services.trainer.megatron_flags import NO_EFFECT

log = logging.getLogger("meshtrain.config")


KERNEL_OPS = ("rms_norm", "layer_norm", "gelu", "swiglu", "rope", "cross_entropy", "linear_cross_entropy")
"""The fused ops of `kernels` (kernels.OPS; kept here so the config needs no torch)."""


@dataclass
class TrainConfig:
    """The loop: batch sizes, length, evaluation, precision and device."""

    micro_batch_size: int = 8
    """Samples per forward/backward on one rank."""
    global_batch_size: int = 32
    """Samples per optimizer step (gradient accumulation makes up the rest)."""
    train_iters: int = 200
    """Optimizer steps to run in total (a resumed run continues up to this)."""
    eval_interval: int = 50
    """Evaluate the held-out loss every this many steps (0: never)."""
    eval_iters: int = 10
    """Global batches per evaluation (Megatron's --eval-iters): every evaluation runs the same
    eval_iters x global_batch_size held-out samples, split over the data-parallel ranks."""
    seed: int = 1234
    """Seeds model init, data order and dropout."""
    bf16: bool = False
    """bf16 autocast with fp32 master weights (meant for CUDA; CPU runs it too, as the tests do)."""
    bf16_weight_copies: bool | None = None
    """Under train.bf16: keep a bf16 copy of every linear layer's weight and bias, cast once per
    optimizer step, instead of autocast casting the fp32 weights in every micro-batch; their bf16
    gradients are added straight into the fp32 gradients (services/trainer/weight_copies.py).
    The same values as autocast, less memory traffic per micro-batch: llama-1b on an H200 trained
    at 1.032x the plain compiled baseline against 1.011x without (gpt2-125m: unchanged).
    Unset: on wherever it applies (train.bf16 in a single process; with several ranks the
    gradient reductions hook the fp32 parameters); true asks for it, false turns it off."""
    gradient_accumulation_fusion: bool | None = None
    """With train.bf16_weight_copies: add each linear layer's weight gradient into its fp32 .grad
    inside the weight-gradient GEMM (cuBLAS, fp32 output, beta=1), as Megatron-LM's
    --gradient-accumulation-fusion, instead of writing a bf16 gradient and adding it after: less
    memory traffic, no bf16 rounding of each micro-batch's gradient (off CUDA the same sums run as
    an fp32 matmul and an add, no faster). On an H200 it trained llama-1b at 1.020x the run
    without it, gpt2-125m at 1.006x and gpt2-350m at 1.008x (BENCHMARKS.md).
    Unset: on wherever the copies are on and the device is CUDA; true asks for it (on any
    device), false turns it off."""
    fp8: Literal["e4m3", "hybrid"] | None = None
    """Train the transformer blocks' dense linear layers on FP8 GEMMs (--fp8-format): 'e4m3'
    everywhere, or 'hybrid' (e4m3 activations and weights, e5m2 gradients). Needs train.bf16:
    everything else stays bf16 autocast with fp32 master weights and optimizer state (the output
    layer, embeddings, norms, attention and MoE experts too), so checkpoints are the same as a
    bf16 run's and load either way (services/trainer/fp8/). Unset: off."""
    fp8_recipe: Literal["tensorwise", "rowwise", "delayed"] = "tensorwise"
    """FP8 scaling (--fp8-recipe): 'tensorwise' scales each tensor by its current amax; 'rowwise'
    each row of every GEMM operand along the summed dimension (finer, slower; train.fp8='e4m3'
    only); 'delayed' by the largest amax of the last fp8_amax_history_len steps (Transformer
    Engine's default; its first step, and a resumed run's, scale by the current amax)."""
    fp8_amax_history_len: int = 1024
    """'delayed': steps of amax history (--fp8-amax-history-len)."""
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"
    """'delayed': scale from the history's largest amax or its newest (--fp8-amax-compute-algo)."""
    fp8_margin: int = 0
    """Scale down by 2^margin below the format's largest value (--fp8-margin)."""
    fp8_bf16_first_last: bool = False
    """Keep the first fp8_bf16_layers_at_start and last fp8_bf16_layers_at_end blocks in bf16
    (--first-last-layers-bf16)."""
    fp8_bf16_layers_at_start: int = 1
    """With fp8_bf16_first_last: blocks at the start kept bf16 (--num-layers-at-start-in-bf16)."""
    fp8_bf16_layers_at_end: int = 1
    """With fp8_bf16_first_last: blocks at the end kept bf16 (--num-layers-at-end-in-bf16)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' picks CUDA when present."""
    cuda_graph: bool = False
    """CUDA, one process: capture one micro-batch's forward and backward (gradients accumulated
    inside it) as a CUDA graph at the first step and replay it for every micro-batch, launching
    its thousands of kernels with one call (services/trainer/graphs.py). Gradients are then
    zeroed in place instead of dropped; the graph holds one micro-batch's activations for the
    whole run, and every micro-batch must have the same shape (it does: fixed micro-batch size
    and sequence length). On an H200 it trained gpt2-125m at micro-batch 4, where the host
    cannot keep up, 1.60x faster; at the configs' micro-batches, where the GPU is the
    bottleneck, it changed nothing measurable (BENCHMARKS.md)."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    compile_coordinate_descent_tuning: bool = False
    """Under train.compile on CUDA: Inductor tunes each Triton kernel it generates for the model
    (the fused norm, activation, cast and loss kernels) by coordinate descent over its launch
    settings, timing them on the device (torch._inductor.config.coordinate_descent_tuning, for
    this model's graphs only). Costs compile time: gpt2-125m's first step took about 2.5 minutes
    longer on an H200. Measured there 1.012x on gpt2-125m and 1.001x on llama-1b (BENCHMARKS.md),
    so it is off by default."""
    kernels: Literal["auto", "reference", "triton"] = "auto"
    """Fused-op implementation: 'auto' takes the Triton kernels on CUDA in eager mode, and
    under train.compile the plain-torch reference (Inductor fuses it with its neighbours; on an
    H200 faster end to end than every op on Triton) except for the ops in
    train.compiled_triton_ops; off CUDA the reference. 'triton' forces the kernels everywhere
    (under compile too: each is a triton_op that Inductor launches itself), 'reference' the
    reference. $MESHTRAIN_KERNELS overrides."""
    compiled_triton_ops: list[str] = field(default_factory=lambda: ["rope", "swiglu"])
    """With kernels='auto' and train.compile on CUDA: the ops (of rms_norm, layer_norm, gelu,
    swiglu, rope, cross_entropy, linear_cross_entropy) that take their Triton kernel inside the
    compiled graph instead of Inductor's fusion of the reference; ignored with any other
    kernels setting. Default: RoPE and SwiGLU, whose kernels beat Inductor's fusions (llama-1b
    on an H200: 1.012-1.019x the plain compiled baseline, against 1.001-1.011x with none;
    adding rms_norm was slower; BENCHMARKS.md). [] keeps every op on the reference. The loss:
    linear_cross_entropy is the fused chunked projection + loss; cross_entropy alone keeps
    Inductor's projection and runs the Triton cross-entropy on its logits."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s per device for MFU; unset: known GPUs only (H100/H200: 989)."""
    control_port: int | None = None
    """Serve the trainer's gRPC control endpoint (status, checkpoint now, stop) on rank 0 at
    this port (0: any free port; the address goes to RUN_DIR/control.addr); unset: no endpoint."""
    control_host: str | None = None
    """Interface the control endpoint binds; unset: $MESHTRAIN_CONTROL_HOST, else 127.0.0.1."""
    metrics_port: int | None = None
    """With the control endpoint: serve Prometheus metrics (step, loss, tokens/s, ETA, RPCs) on
    this port (0: any free port, in RUN_DIR/metrics.addr); unset: $MESHTRAIN_METRICS_PORT or none."""

    def __post_init__(self) -> None:
        for key in ("micro_batch_size", "global_batch_size", "train_iters", "eval_iters"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"train.{key} must be positive, got {getattr(self, key)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} must be a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}"
            )
        unknown = [op for op in self.compiled_triton_ops if op not in KERNEL_OPS]
        if unknown:
            raise ConfigError(f"train.compiled_triton_ops: unknown op {unknown[0]!r}; the ops are "
                              f"{', '.join(KERNEL_OPS)}")
        if self.bf16_weight_copies and not self.bf16:
            raise ConfigError("train.bf16_weight_copies keeps bf16 copies of the weights for bf16 autocast: "
                              "it needs train.bf16=true")
        if self.gradient_accumulation_fusion and not (self.bf16 and self.bf16_weight_copies is not False):
            raise ConfigError("train.gradient_accumulation_fusion adds the bf16 weight copies' gradients into the fp32 "
                              "gradients: it needs train.bf16=true and train.bf16_weight_copies left on")
        if self.fp8 is not None:
            if not self.bf16:
                raise ConfigError(f"train.fp8={self.fp8!r} runs the linear layers in FP8 inside bf16 autocast: it "
                                  "needs train.bf16=true (--bf16)")
            if self.fp8_recipe == "rowwise" and self.fp8 != "e4m3":
                raise ConfigError(f"train.fp8_recipe='rowwise' casts gradients to e4m3 (row-scaled FP8 GEMMs take "
                                  f"e4m3 operands only): set train.fp8='e4m3', not {self.fp8!r}")
            for key in ("fp8_amax_history_len", "fp8_bf16_layers_at_start", "fp8_bf16_layers_at_end",
                        "fp8_margin"):
                if getattr(self, key) < (1 if key == "fp8_amax_history_len" else 0):
                    raise ConfigError(f"train.{key} must be >= {1 if key == 'fp8_amax_history_len' else 0}, "
                                      f"got {getattr(self, key)}")
        if self.cuda_graph and self.device == "cpu":
            raise ConfigError("train.cuda_graph captures the step as a CUDA graph: it needs a CUDA device, but "
                              "train.device='cpu'")
        if self.compile_coordinate_descent_tuning and not self.compile:
            raise ConfigError("train.compile_coordinate_descent_tuning tunes compiled kernels: it needs "
                              "train.compile=true")
        if self.metrics_port is not None and self.control_port is None:
            # the metrics are served beside the control endpoint; without it nothing would be
            raise ConfigError(f"train.metrics_port={self.metrics_port} serves Prometheus metrics beside the control "
                              "endpoint: it needs train.control_port set too (0: any free port)")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Linear warmup steps from 0 to lr."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of the decay length (--lr-warmup-fraction): lr_decay_iters (unset:
    train_iters) x this, rounded down to whole steps; instead of lr_warmup_iters."""
    lr_decay_iters: int | None = None
    """Steps over which to decay to min_lr; unset: train_iters."""
    lr_decay_style: Literal["cosine", "linear", "constant", "wsd", "inverse-square-root"] = "cosine"
    """Shape of the decay after warmup. 'wsd' (warmup-stable-decay; Megatron's WSD) holds lr until
    the last lr_wsd_decay_iters steps of the decay, then decays to min_lr in lr_wsd_decay_style;
    'inverse-square-root' is lr x sqrt(warmup / step), never below min_lr."""
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """With lr_decay_style='wsd': the shape of the final decay over progress p from 0 to 1:
    exponential 2 x 0.5^p - 1, linear 1 - p, cosine (1 + cos(pi p)) / 2, minus_sqrt 1 - sqrt(p)
    (of lr - min_lr, above min_lr)."""
    lr_wsd_decay_iters: int | None = None
    """With lr_decay_style='wsd' (required then): steps of the final decay, ending at lr_decay_iters."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (never on norms or biases)."""
    decay_embeddings: bool = False
    """Also apply weight decay to the embedding tables."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""

    def __post_init__(self) -> None:
        if not (0 <= self.min_lr <= self.lr < math.inf):
            raise ConfigError(f"optim: need 0 <= min_lr <= lr, got lr={self.lr} min_lr={self.min_lr}")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key} must be in [0, 1), got {getattr(self, key)}")
        if not 0 <= self.adam_eps < math.inf:
            raise ConfigError(f"optim.adam_eps must be >= 0, got {self.adam_eps}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_grad < 0:
            raise ConfigError(f"optim.clip_grad must be >= 0, got {self.clip_grad}")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"optim.lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_warmup_fraction is not None:
            if not 0 <= self.lr_warmup_fraction < 1:
                raise ConfigError(f"optim.lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}")
            if self.lr_warmup_iters:
                raise ConfigError("set one of optim.lr_warmup_iters and optim.lr_warmup_fraction, not both")
        if self.lr_decay_style == "wsd":
            if self.lr_wsd_decay_iters is None or self.lr_wsd_decay_iters <= 0:
                raise ConfigError("optim.lr_decay_style='wsd' needs optim.lr_wsd_decay_iters, the steps of its final "
                                  f"decay (--lr-wsd-decay-iters), > 0; got {self.lr_wsd_decay_iters}")
        elif self.lr_wsd_decay_iters is not None:
            raise ConfigError(f"optim.lr_wsd_decay_iters applies to lr_decay_style='wsd', not {self.lr_decay_style!r}")
        # An explicit decay length the warmup reaches would leave lr at its peak for good (the
        # schedule has nothing to decay over); 0 would silently mean "unset".
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ConfigError(f"optim.lr_decay_iters={self.lr_decay_iters} must be greater than "
                              f"optim.lr_warmup_iters={self.lr_warmup_iters} (unset: train_iters)")


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
    but at llama-1b TP=2 + SP on two H200s it trained at 0.99x one GPU against 1.39x without it
    (BENCHMARKS.md), so off; kept because Megatron users ask for it by that flag."""
    tp_async_grad_reduce: bool = True
    """Column-parallel linears launch the reduction of their input gradient (reduce-scatter with
    sequence parallelism, else all-reduce) before computing their weight gradient, so the two
    overlap (Megatron's asynchronous tensor-parallel all-reduce, on by default there too). Same
    arithmetic; +1.5% tokens/s at llama-1b TP=2 on two H200s (one same-job comparison). Nothing to do at tp=1;
    tp_comm_overlap, which fuses these collectives with the GEMMs instead, takes precedence."""
    distributed_timeout_minutes: float = 10.0
    """How long a collective waits for a peer rank before it raises and the rank exits 1
    (--distributed-timeout-minutes, as Megatron). A rank that dies is noticed at once (its
    connections close); one that hangs (SIGSTOP, stuck storage, a deadlock) only through this
    timeout, on the ranks waiting for it: the job ends after it (plus the launcher's 15 s)."""
    use_distributed_optimizer: bool = False
    """Shard Adam state over data-parallel ranks (ZeRO-1): reduce-scatter grads, all-gather params."""
    overlap_grad_reduce: bool = False
    """Reduce each gradient bucket as soon as backward has finished it."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather each bucket's parameters just before the forward uses them."""
    ddp_bucket_size: int = 40_000_000
    """Elements per gradient bucket."""
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """What the data-parallel gradient reduction sends: the fp32 gradients as accumulated, or a
    bf16 copy of each bucket (half the bytes on the wire; each rank's contribution and the
    partial sums are rounded to bf16, and the result is copied back into the fp32 buffers).
    Accumulation over micro-batches stays fp32 (Megatron's --grad-reduce-in-bf16, also accepted,
    makes the buffers themselves bf16); the copies cost 2 bytes per parameter (ZeRO-1: plus
    2/dp) while the reductions are in flight. No effect at dp=1. At llama-1b DP=2 + ZeRO-1 on two
    H200s no faster than fp32, whose reduction already runs under the backward (BENCHMARKS.md);
    kept as Megatron's option for links where it does not (not measured here)."""
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
            raise ConfigError(f"parallel.expert_tensor_parallel_size={etp}: only the tensor-parallel degree itself "
                              f"(parallel.tp={self.tp}) is supported; leave it unset")
        self._check_pipeline()
        self._check_context()
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ConfigError("parallel.tp_comm_overlap needs parallel.sequence_parallel")
        if not self.distributed_timeout_minutes > 0:
            raise ConfigError(f"parallel.distributed_timeout_minutes must be a positive number of minutes, "
                              f"got {self.distributed_timeout_minutes}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("parallel.overlap_param_gather needs parallel.use_distributed_optimizer")
        self._resolve_recompute_plan()
        if self.ddp_bucket_size <= 0:
            raise ConfigError(f"parallel.ddp_bucket_size must be positive, got {self.ddp_bucket_size}")

    def _check_context(self) -> None:
        """Refuse a hierarchical split that does not match cp_comm_type or multiply to cp."""
        sizes = self.hierarchical_context_parallel_sizes
        if self.cp_comm_type == "a2a+p2p":
            if self.cp == 1:
                raise ConfigError("parallel.cp_comm_type='a2a+p2p' needs parallel.cp > 1")
            if sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != self.cp or min(sizes) < 1:
                raise ConfigError(f"parallel.cp_comm_type='a2a+p2p' needs parallel.hierarchical_context_parallel_sizes "
                                  f"= [all-to-all size, ring size] multiplying to parallel.cp={self.cp}, got {sizes}")
        elif sizes is not None:
            raise ConfigError("parallel.hierarchical_context_parallel_sizes is for cp_comm_type='a2a+p2p'; "
                              f"cp_comm_type is {self.cp_comm_type!r}")

    @property
    def cp_a2a_size(self) -> int:
        """Context-parallel ranks one all-to-all spans (1 with the ring alone)."""
        if self.cp_comm_type == "a2a":
            return self.cp
        if self.cp_comm_type == "a2a+p2p":
            return self.hierarchical_context_parallel_sizes[0]
        return 1

    def _check_pipeline(self) -> None:
        """Refuse pipeline settings that a pp of 1 would ignore, or that contradict each other."""
        keys = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_layout")
        given = [k for k in keys if getattr(self, k) is not None]
        if self.pp == 1 and (given or self.pipeline_schedule not in ("auto", "none")):
            what = given[0] if given else f"pipeline_schedule={self.pipeline_schedule!r}"
            raise ConfigError(f"parallel.{what} applies to pipeline parallelism; parallel.pp is 1")
        if self.virtual_pipeline_model_parallel_size is not None and self.num_layers_per_virtual_pipeline_stage:
            raise ConfigError("set one of parallel.virtual_pipeline_model_parallel_size and "
                              "parallel.num_layers_per_virtual_pipeline_stage, not both")
        for k in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                raise ConfigError(f"parallel.{k} must be >= 1, got {getattr(self, k)}")
        if self.pipeline_layout is not None and (self.decoder_first_pipeline_num_layers is not None
                                                 or self.decoder_last_pipeline_num_layers is not None):
            raise ConfigError("parallel.pipeline_layout lists every stage's blocks; leave "
                              "decoder_first/last_pipeline_num_layers unset with it")

    def pipeline_chunks(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (virtual stages), from whichever setting is given."""
        if self.virtual_pipeline_model_parallel_size is not None:
            return self.virtual_pipeline_model_parallel_size
        if self.num_layers_per_virtual_pipeline_stage is not None:
            per = self.num_layers_per_virtual_pipeline_stage
            if num_layers % (self.pp * per):
                raise ConfigError(f"model.num_layers={num_layers} is not a multiple of parallel.pp={self.pp} x "
                                  f"num_layers_per_virtual_pipeline_stage={per}")
            return num_layers // (self.pp * per)
        if self.pipeline_layout is not None:
            if len(self.pipeline_layout) % self.pp:
                raise ConfigError(f"parallel.pipeline_layout has {len(self.pipeline_layout)} entries, not a "
                                  f"multiple of parallel.pp={self.pp}")
            return len(self.pipeline_layout) // self.pp
        return 1

    def resolved_pipeline_schedule(self, num_layers: int) -> str:
        """The schedule 'auto' stands for here (1f1b, or interleaved with chunks)."""
        if self.pipeline_schedule != "auto":
            return self.pipeline_schedule
        return "interleaved" if self.pipeline_chunks(num_layers) > 1 else "1f1b"

    def _resolve_recompute_plan(self) -> None:
        """Refuse a method or layer count that the granularity would ignore; fill in 'full''s defaults.

        Megatron-LM refuses recompute_method and recompute_num_layers with 'selective'; with no
        recompute it ignores them, which here is refused too (nothing is silently ignored).
        """
        if self.recompute_num_layers is not None and self.recompute_num_layers <= 0:
            raise ConfigError(f"parallel.recompute_num_layers must be positive, got {self.recompute_num_layers}")
        if self.recompute_granularity == "full":
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
            return
        if (self.recompute_method, self.recompute_num_layers) == ("uniform", 1):
            # The defaults of both keys before they became unset: every config.toml written then
            # holds them, whatever the granularity, and must still load (`--config RUN/config.toml`).
            log.warning("parallel.recompute_method='uniform' and parallel.recompute_num_layers=1 have no effect "
                        "with parallel.recompute_granularity=%r (a config written before they defaulted to "
                        "unset); read as unset: remove them", self.recompute_granularity)
            self.recompute_method = self.recompute_num_layers = None
        given = [f"parallel.{key}={getattr(self, key)!r}" for key in ("recompute_method", "recompute_num_layers")
                 if getattr(self, key) is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to "
                              f"parallel.recompute_granularity='full' only, got {self.recompute_granularity!r}: "
                              "set --recompute-granularity full, or leave them unset")


@dataclass
class LogConfig:
    """The run directory and what is written to it."""

    run_dir: str | None = None
    """Run directory; unset: a new folder under runs/."""
    log_interval: int = 10
    """Write a metrics line every this many steps."""
    progress: Literal["auto", "bar", "lines"] = "auto"
    """'auto': a progress bar on a terminal, plain log lines otherwise."""
    plot: bool = True
    """Write loss.png (train and eval loss) at the end."""
    tensorboard_dir: str | None = None
    """Also write the scalars of metrics.jsonl as TensorBoard events to this folder
    (--tensorboard-dir; needs the `tensorboard` extra); unset: none."""
    wandb_project: str | None = None
    """Also log the scalars of metrics.jsonl to this Weights & Biases project (--wandb-project;
    needs the `wandb` extra; WANDB_MODE=offline writes the run locally); unset: none."""
    wandb_exp_name: str | None = None
    """W&B run name (--wandb-exp-name); unset: the run directory's name."""
    wandb_save_dir: str | None = None
    """Folder for W&B's local files (--wandb-save-dir); unset: RUN_DIR/wandb."""
    wandb_entity: str | None = None
    """W&B team or user (--wandb-entity); unset: W&B's default."""

    def __post_init__(self) -> None:
        if self.log_interval <= 0:
            raise ConfigError(f"log.log_interval must be positive, got {self.log_interval}")
        for key in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
            if getattr(self, key) is not None and self.wandb_project is None:
                raise ConfigError(f"log.{key} is a W&B setting: it needs log.wandb_project (--wandb-project)")


@dataclass
class JobConfig:
    """A whole training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and recompute."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    log: LogConfig = field(default_factory=LogConfig)
    """Run directory and logging."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """Tokens and TLS: what the trainer sends to the data and checkpoint services, and what its
    control endpoint requires (file paths only; no secret is part of the config)."""

    def __post_init__(self) -> None:
        # Known from the config alone: refused here, not once every rank has built its data.
        check_tensor_parallel(self.model, self.parallel.tp, self.parallel.sequence_parallel)
        check_context_parallel(self.model, self.parallel)
        check_experts(self.model, self.parallel, self.train)
        check_fp8(self.train, self.parallel)


def check_fp8(train: TrainConfig, parallel: ParallelConfig) -> None:
    """What FP8 does not combine with (train.fp8's own values are checked by TrainConfig)."""
    if train.fp8 is None:
        return
    if parallel.tp_comm_overlap:
        raise ConfigError("train.fp8 does not combine with parallel.tp_comm_overlap: its fused all-gather/"
                          "reduce-scatter GEMMs are bf16; leave one off")
    if parallel.pipeline_schedule == "zb-h1":
        raise ConfigError("train.fp8 does not combine with parallel.pipeline_schedule='zb-h1' (the deferred weight "
                          "gradients are bf16 GEMMs); use 1f1b or interleaved")
    if train.cuda_graph and train.fp8_recipe == "delayed":
        raise ConfigError("train.fp8_recipe='delayed' switches from current to historical scales after the first "
                          "step, which a CUDA graph captured then would never see: use tensorwise with "
                          "train.cuda_graph")


def check_experts(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> None:
    """What a mixture of experts needs of the layout and the loop (the layout's dp x cp, which
    ep must divide, is known once the world size is: `Mesh.build` checks that).

    Raises:
        ConfigError: naming the keys that do not fit together.
    """
    p, e = parallel, model.num_experts
    if e is None:
        if p.ep > 1:
            raise ConfigError(f"parallel.ep={p.ep} splits the experts of MoE layers, but model.num_experts is unset "
                              "(a dense model): set model.num_experts or parallel.ep=1")
        return
    if e % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.num_experts={e} (each ep rank holds the same "
                          "number of experts)")
    if model.moe_expert_capacity_factor is not None and p.cp > 1:
        raise ConfigError(f"model.moe_expert_capacity_factor caps each expert's tokens per sequence, and with "
                          f"parallel.cp={p.cp} a rank holds only chunks of each sequence: leave the factor unset "
                          "(dropless) or parallel.cp=1")
    if p.tp > 1:
        for key, width in (("moe_ffn_hidden_size", model.moe_ffn_size),
                           ("moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size)):
            if width is not None and width % p.tp:
                raise ConfigError(f"parallel.tp={p.tp} must divide model.{key}={width} (each expert's inner "
                                  "width is split over the tensor-parallel ranks)")
    if train.cuda_graph:
        raise ConfigError("train.cuda_graph cannot capture a mixture of experts (model.num_experts is set): the "
                          "expert GEMMs and the token exchange need the per-expert counts on the host; leave "
                          "train.cuda_graph off")


def check_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """What context parallelism needs of the model: a sequence that splits into 2·cp chunks (per
    tp rank too with sequence parallelism), heads that split over the all-to-all, no dropout
    (the attention blocks carry no dropout RNG; hidden dropout would draw the same mask on
    every cp rank), no pinned cuDNN or memory-efficient backend (the blocks run the flash
    kernel, which returns the log-sum-exp they merge by).

    Raises:
        ConfigError: naming the setting.
    """
    p = parallel
    if p.cp == 1:
        return
    if model.attention_dropout > 0 or model.hidden_dropout > 0:
        raise ConfigError("context parallelism has no per-rank dropout RNG: set model.attention_dropout=0 and "
                          "model.hidden_dropout=0 with parallel.cp > 1")
    if model.attention_backend in ("cudnn", "efficient"):
        raise ConfigError(f"with parallel.cp > 1 attention runs blockwise on the flash kernel (or 'math', the "
                          f"reference); model.attention_backend={model.attention_backend!r} is not used there")
    split = 2 * p.cp * (p.tp if p.sequence_parallel else 1)
    if model.seq_length % split:
        what = f"2 x cp x tp = {split}" if p.sequence_parallel else f"2 x cp = {split}"
        raise ConfigError(f"context parallelism cuts each sequence into 2 x cp chunks: model.seq_length="
                          f"{model.seq_length} must be a multiple of {what}")
    a2a = p.cp_a2a_size
    if a2a > 1:
        heads, kv = model.num_attention_heads // p.tp, model.groups // p.tp
        if heads % a2a:
            raise ConfigError(f"parallel.cp_comm_type={p.cp_comm_type!r} splits the attention heads over {a2a} "
                              f"ranks: {heads} heads per tensor-parallel rank are not a multiple of {a2a}")
        if kv % a2a and a2a % kv:
            raise ConfigError(f"parallel.cp_comm_type={p.cp_comm_type!r} over {a2a} ranks: {kv} key/value heads "
                              f"per tensor-parallel rank neither split over {a2a} ranks nor repeat evenly to them")


def check_tensor_parallel(model: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """What tensor parallelism of degree `tp` needs of the model's shapes and settings.

    JobConfig refuses these at parse time, before any rank starts; `parallel/tensor.py` checks
    again for callers that shard a model directly.

    Raises:
        ConfigError: naming parallel.tp and the model key it does not fit.
    """
    if tp == 1:
        return
    if model.num_attention_heads % tp or model.groups % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide model.num_attention_heads={model.num_attention_heads} and the "
            f"number of query groups ({model.groups}); replicating KV heads across tp ranks is not supported"
        )
    if model.ffn_size % tp:
        raise ConfigError(f"parallel.tp={tp} must divide the MLP width {model.ffn_size} (model.ffn_hidden_size)")
    if sequence_parallel and model.seq_length % tp:
        raise ConfigError(f"sequence parallelism: parallel.tp={tp} must divide model.seq_length={model.seq_length}")
    if model.attention_dropout > 0 or (sequence_parallel and model.hidden_dropout > 0):
        raise ConfigError(
            "dropout inside tensor-parallel regions needs a per-rank RNG tracker, which is not built: "
            "set model.attention_dropout=0 (and model.hidden_dropout=0 with sequence parallelism)"
        )


REMOVED_KEYS: dict[str, tuple[Any, str]] = {
    "parallel.tp_batch_split": (False, "splitting each micro-batch to hide TP's forward reductions measured "
                                       "slower at llama-1b TP=2 on two H200s"),
    "train.compile_overlap_scheduling": (False, "Inductor's overlap scheduler gained nothing at llama-1b TP=2 on "
                                                "two H200s"),
    "train.matmul_sm_carveout": (0, "leaving SMs free of matmuls for NCCL measured slower at llama-1b TP=2 on "
                                    "two H200s"),
    "parallel.tp_reduce_impl": ("nccl", "the symmetric-memory forward all-reduce was no faster than NCCL's end to "
                                        "end at llama-1b TP=2 on two H200s"),
}
"""Options that were removed: the value every config written before held (their default) and
why they went (BENCHMARKS.md has the measurements). A run directory's config.toml holds every
key and is meant to be read again (`--config RUN/config.toml`), so that value is dropped with a
warning; any other value asked for the removed behaviour and is refused."""


def _drop_removed_keys(table: dict[str, Any]) -> dict[str, Any]:
    for dotted, (old_default, why) in REMOVED_KEYS.items():
        section, _, key = dotted.partition(".")
        values = table.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        if type(values[key]) is not type(old_default) or values[key] != old_default:
            raise ConfigError(f"{dotted}={values[key]!r}: the option was removed ({why}); remove the key")
        log.warning("%s=%r: the option was removed (%s); read as absent: remove the key", dotted, old_default, why)
        table = {**table, section: {k: v for k, v in values.items() if k != key}}
    return table


def _leaves(table: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in table.items():
        out.extend(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key])
    return out


def _check_flag_keys(overrides: dict[str, Any]) -> None:
    """Refuse a mistyped `--section.key` flag here, where it can be named as the flag it was
    and matched against every key of every section (`--modle.num_layers` finds
    `--model.num_layers`), rather than later as a key of one section."""
    known = [row[0] for row in cfg.describe_keys(JobConfig)]
    allowed = set(known) | set(REMOVED_KEYS)
    for dotted in _leaves(overrides):
        parts = dotted.split(".")
        # a prefix that is a key is a table-valued field given a nested value: build checks it
        if any(".".join(parts[:i]) in allowed for i in range(1, len(parts) + 1)):
            continue
        near = cfg.close_matches(dotted, known)
        hint = (f"did you mean {' or '.join('--' + m for m in near)}?" if near
                else "`meshtrain train --help-config` lists the keys")
        raise ConfigError(f"unknown flag --{dotted}; {hint}")


def load_config(args: list[str] | None = None, base: dict[str, Any] | None = None) -> JobConfig:
    """Build a JobConfig from a TOML file and command-line overrides.

    Args:
        args: command-line words after `meshtrain train` (may include `--config FILE`).
        base: an extra table applied before the file (used by tests and tools).

    Returns:
        The validated JobConfig.
    """
    config_file, overrides = parse_overrides(list(args or []))
    _check_flag_keys(overrides)
    table: dict[str, Any] = dict(base or {})
    if config_file:
        table = cfg.deep_merge(table, cfg.load_toml(config_file))
    table = cfg.deep_merge(table, overrides)
    return cfg.build(JobConfig, _drop_removed_keys(table))


LAUNCHER_KEYS_ENV = "MESHTRAIN_LAUNCHER_KEYS"
"""Set by `meshtrain up` on the trainer it starts: the keys ("section.key", space-separated) it
pointed at its own services, whose addresses end with it; `run_dir.run_dir_toml` leaves them out."""


def replace(job: JobConfig, **sections: dict[str, Any]) -> JobConfig:
    """A copy of `job` with some section fields changed, re-validated (e.g. vocab_size)."""
    table = cfg.to_dict(job)
    for name, values in sections.items():
        table[name] = {**table[name], **values}
    return cfg.build(JobConfig, table)


def config_help() -> str:
    """Every key with its type, default and documentation, grouped by section."""
    lines = []
    for key, tp, default, doc in cfg.describe_keys(JobConfig):
        lines.append(f"  --{key}  ({tp}; default {default})")
        if doc:
            lines.extend(f"      {line}" for line in doc.splitlines())
    aliases = ", ".join(accepted_flags())
    no_effect = ", ".join(sorted(NO_EFFECT))
    return ("Config keys:\n" + "\n".join(lines) + f"\n\nMegatron aliases: {aliases}\n"
            f"\nMegatron flags accepted without effect (with a warning): {no_effect}\n")


__all__ = [
    "JobConfig", "ModelConfig", "DataConfig", "TrainConfig", "OptimConfig", "ParallelConfig",
    "CheckpointConfig", "LogConfig", "ALIASES", "load_config", "parse_overrides", "replace",
    "config_help",
]
