"""The trainer's job config sections: the loop, the optimizer, the run directory, and the job.

`TrainConfig` (batch sizes, length, evaluation, precision, device, compilation, FP8),
`OptimConfig` (AdamW and the learning-rate schedule), `LogConfig` (the run directory and what is
written to it) and `JobConfig`, which gathers every section (`model`, `data`, `train`, `optim`,
`parallel`, `checkpoint`, `log`, `dpo`, `reward`, `grpo`, `auth`) and runs the cross-section
checks of `checks.py` when it is built. Each component receives only its own section; `load.py`
builds a JobConfig from a TOML file and the command line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from meshtrain.services.checkpoint.config import CheckpointConfig
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.common.security import AuthConfig
from meshtrain.services.dataloader.config import DataConfig
from meshtrain.services.trainer.config.checks import (
    check_context_parallel,
    check_documents,
    check_expert_fusion,
    check_experts,
    check_fp8,
    check_fully_sharded,
    check_optimizer_offload,
    check_tensor_parallel,
    check_vision,
    resolve_multimodal,
)
from meshtrain.services.trainer.config.dpo import DPOConfig
from meshtrain.services.trainer.config.grpo import GRPOConfig
from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.config.reward import RewardConfig

KERNEL_OPS = (
    "rms_norm",
    "layer_norm",
    "gelu",
    "swiglu",
    "rope",
    "cross_entropy",
    "linear_cross_entropy",
)
"""The fused ops `meshtrain.kernels.dispatch.OPS` (kept here so the config needs no torch)."""


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
    The same values as autocast, less memory traffic per micro-batch: faster on llama-1b,
    gpt2-125m unchanged (measured: BENCHMARKS.md, 'Training throughput, one GPU').
    Unset: on wherever it applies (train.bf16 in a single process; with several ranks the
    gradient reductions hook the fp32 parameters); true asks for it, false turns it off."""
    gradient_accumulation_fusion: bool | None = None
    """With train.bf16_weight_copies: add each linear layer's weight gradient into its fp32 .grad
    inside the weight-gradient GEMM (cuBLAS, fp32 output, beta=1), as Megatron-LM's
    --gradient-accumulation-fusion, instead of writing a bf16 gradient and adding it after: less
    memory traffic, no bf16 rounding of each micro-batch's gradient (off CUDA the same sums run as
    an fp32 matmul and an add, no faster). Faster than the run without it on every config
    measured (measured: BENCHMARKS.md, 'Training throughput, one GPU').
    Unset: on wherever the copies are on and the device is CUDA; true asks for it (on any
    device), false turns it off."""
    expert_gradient_accumulation_fusion: bool = False
    """With train.bf16_weight_copies in a MoE model: add each expert's weight gradient into the
    stacked expert weight's fp32 .grad inside a GEMM of its own (fp32 output, beta=1), as
    Transformer Engine's grouped linear with host-side split sizes, instead of the grouped GEMM
    writing a bf16 gradient that a hook then adds (services/trainer/weight_copies.py): no bf16
    rounding of each micro-batch's expert gradient, less memory traffic, but one GEMM per expert
    and the per-expert counts read on the host in the backward (a device synchronization per MoE
    layer, projection and micro-batch). Off by default: not yet timed on a GPU. Needs
    model.moe_grouped_gemm and a single process; refused with train.cuda_graph."""
    fp8: Literal["e4m3", "hybrid"] | None = None
    """Train the transformer blocks' dense linear layers on FP8 GEMMs (--fp8-format): 'e4m3'
    everywhere, or 'hybrid' (e4m3 activations and weights, e5m2 gradients). Needs train.bf16:
    everything else stays bf16 autocast with fp32 master weights and optimizer state (the output
    layer, embeddings, norms, attention and MoE experts too, unless train.fp8_experts), so
    checkpoints are the same as a bf16 run's and load either way (services/trainer/fp8/).
    Unset: off."""
    fp8_recipe: Literal["tensorwise", "rowwise", "delayed"] = "tensorwise"
    """FP8 scaling (--fp8-recipe): 'tensorwise' scales each tensor by its current amax; 'rowwise'
    each row of every GEMM operand along the summed dimension (finer, slower; train.fp8='e4m3'
    only); 'delayed' by the amax of earlier steps (Transformer Engine's DelayedScaling; its first
    step, and a resumed run's, scale by the current amax)."""
    fp8_amax_history_len: int = 1
    """'delayed': steps of amax history (--fp8-amax-history-len; Megatron's default, 1: the
    previous step's amax)."""
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "most_recent"
    """'delayed': scale from the history's newest amax (Megatron's default) or its largest,
    'max' (--fp8-amax-compute-algo; Transformer Engine's own default is 'max' over 1024 steps,
    compared in docs/performance.md, "FP8")."""
    fp8_margin: int = 0
    """Scale down by 2^margin below the format's largest value (--fp8-margin)."""
    fp8_bf16_first_last: bool = False
    """Keep the first fp8_bf16_layers_at_start and last fp8_bf16_layers_at_end blocks in bf16
    (--first-last-layers-bf16)."""
    fp8_bf16_layers_at_start: int = 1
    """With fp8_bf16_first_last: blocks at the start kept bf16 (--num-layers-at-start-in-bf16)."""
    fp8_bf16_layers_at_end: int = 1
    """With fp8_bf16_first_last: blocks at the end kept bf16 (--num-layers-at-end-in-bf16)."""
    fp8_fused_casts: bool = True
    """FP8 casts in fused kernels on CUDA (kernels/fp8_cast.py): one pass writes a tensor's FP8
    copy and the transposed copy the weight gradient needs (and, delayed, the amax for the next
    step's scale), where separate amax, cast and transpose kernels each read the tensor again.
    The norms and activations before the FP8 linears also write their output's FP8 copy (or,
    current scaling, its amax) in their own kernel (fp8/fused_inputs.py; eager layers).
    The same FP8 values bit for bit; false: the separate torch ops (for A/B timing)."""
    fp8_fused_casts_compiled: bool = False
    """With fp8_fused_casts and train.compile: the cast kernels inside the compiled regions too,
    launched by Inductor as they are. Off (the default), a compiled region traces the torch
    casts and Inductor generates and fuses them with their neighbours; the norms and activations
    that write FP8 copies serve eager layers either way."""
    fp8_experts: bool = False
    """With train.fp8 (any format and recipe): the MoE blocks' grouped expert GEMMs (fc1, fc2) in
    FP8 too, always row-scaled e4m3, which is what Hopper's grouped FP8 GEMM
    (`torch._scaled_grouped_mm`) takes: the forward and input-gradient GEMMs in FP8, the weight
    gradient in bf16 (fp8/experts.py says why). Routers and shared experts stay bf16, and
    parameters and checkpoints do not change. Off Hopper (CUDA sm90), with
    model.moe_grouped_gemm=false, or where an expert weight's local width is not a multiple of
    16, the same FP8 values run an emulation (dequantized fp32 GEMMs, slow: for tests). Under
    train.bf16_weight_copies the expert weights are quantized once per optimizer step
    (fp8/weights.py), else in every micro-batch, to the same values."""
    fp8_all_gather: bool = True
    """Under sequence parallelism, the FP8 column-parallel layers (QKV, fc1) cast their input
    chunk to FP8 before the sequence all-gather: half the bytes of the bf16 gather, the same
    values reach the GEMM, and the cast and amax run on the chunk only (tensorwise and delayed;
    rowwise gathers in bf16). false: gather in bf16, then cast."""
    freeze_vision: bool = False
    """With model.vision: leave the vision encoder's weights as they are (LLaVA's stages 1 and 2):
    no gradient, no optimizer state, no gradient reduction, and the encoder runs without
    autograd."""
    freeze_projector: bool = False
    """With model.vision: leave the projector's weights as they are."""
    freeze_language_model: bool = False
    """Leave the language model's weights as they are (embeddings, blocks, final norm, output
    layer): LLaVA's stage 1 trains the projector alone (freeze_vision and freeze_language_model);
    its stage 2 the projector and the language model (freeze_vision)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' picks CUDA when present."""
    cuda_graph: bool = False
    """CUDA, one process: capture one micro-batch's forward and backward (gradients accumulated
    inside it) as a CUDA graph at the first step and replay it for every micro-batch, launching
    its thousands of kernels with one call (services/trainer/cuda_graphs.py). Gradients are then
    zeroed in place instead of dropped; the graph holds one micro-batch's activations for the
    whole run, and every micro-batch must have the same shape (it does: fixed micro-batch size
    and sequence length). It trained gpt2-125m faster at micro-batch 4, where the host cannot
    keep up; at the configs' micro-batches, where the GPU is the bottleneck, it changed nothing
    measurable (measured: BENCHMARKS.md, 'Levers tried and dropped')."""
    compile: bool = False
    """Wrap the model in torch.compile; with a pipeline, FSDP2, parallel.overlap_param_gather or
    full recompute, compile each block and the loss head in place instead (so a recomputed
    block keeps only its input, as in eager)."""
    compile_coordinate_descent_tuning: bool = False
    """Under train.compile on CUDA: Inductor tunes each Triton kernel it generates for the model
    (the fused norm, activation, cast and loss kernels) by coordinate descent over its launch
    settings, timing them on the device (torch._inductor.config.coordinate_descent_tuning, for
    this model's graphs only). Costs minutes of compile time at the first step and gained little
    end to end (measured: BENCHMARKS.md, 'Levers tried and dropped'), so it is off by default."""
    kernels: Literal["auto", "reference", "triton"] = "auto"
    """Fused-op implementation: 'auto' takes the Triton kernels on CUDA in eager mode, and
    under train.compile the plain-torch reference (Inductor fuses it with its neighbours: faster
    end to end than every op on Triton; measured: BENCHMARKS.md, 'Levers tried and dropped')
    except for the ops in
    train.compiled_triton_ops; off CUDA the reference. 'triton' forces the kernels everywhere
    (under compile too: each is a triton_op that Inductor launches itself), 'reference' the
    reference. $MESHTRAIN_KERNELS overrides."""
    compiled_triton_ops: list[str] = field(default_factory=lambda: ["rope", "swiglu"])
    """With kernels='auto' and train.compile on CUDA: the ops (of rms_norm, layer_norm, gelu,
    swiglu, rope, cross_entropy, linear_cross_entropy) that take their Triton kernel inside the
    compiled graph instead of Inductor's fusion of the reference; ignored with any other
    kernels setting. Default: RoPE and SwiGLU, whose kernels beat Inductor's fusions on llama-1b,
    while adding rms_norm was slower (measured: BENCHMARKS.md, 'Training throughput, one GPU'
    and 'Levers tried and dropped'). [] keeps every op on the reference. The loss:
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
    """With the control endpoint: serve Prometheus metrics (step, loss, tokens/s, ETA, RPCs) on this
    port (0: any free port, in RUN_DIR/metrics.addr); unset: $MESHTRAIN_METRICS_PORT or none."""
    objective: Literal["lm", "dpo", "reward", "grpo"] = "lm"
    """lm: the language-model loss (pretraining, SFT); dpo: preference tuning on pairs, set up
    by the [dpo] section; reward: a reward model (a scalar head, model.reward_head) trained on
    pairs, set up by [reward]; grpo: on-policy RL on sampled completions, set up by [grpo]."""

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
            raise ConfigError(
                f"train.compiled_triton_ops: unknown op {unknown[0]!r}; the ops are "
                f"{', '.join(KERNEL_OPS)}"
            )
        if self.bf16_weight_copies and not self.bf16:
            raise ConfigError(
                "train.bf16_weight_copies keeps bf16 copies of the weights for bf16 autocast: "
                "it needs train.bf16=true"
            )
        if self.gradient_accumulation_fusion and not (
            self.bf16 and self.bf16_weight_copies is not False
        ):
            raise ConfigError(
                "train.gradient_accumulation_fusion adds the bf16 weight copies' gradients into "
                "the fp32 gradients: it needs train.bf16=true and train.bf16_weight_copies left on"
            )
        if self.fp8 is not None:
            if not self.bf16:
                raise ConfigError(
                    f"train.fp8={self.fp8!r} runs the linear layers in FP8 inside bf16 autocast: "
                    "it needs train.bf16=true (--bf16)"
                )
            if self.fp8_recipe == "rowwise" and self.fp8 != "e4m3":
                raise ConfigError(
                    "train.fp8_recipe='rowwise' casts gradients to e4m3 (row-scaled FP8 GEMMs "
                    f"take e4m3 operands only): set train.fp8='e4m3', not {self.fp8!r}"
                )
            for key in (
                "fp8_amax_history_len",
                "fp8_bf16_layers_at_start",
                "fp8_bf16_layers_at_end",
                "fp8_margin",
            ):
                if getattr(self, key) < (1 if key == "fp8_amax_history_len" else 0):
                    raise ConfigError(
                        f"train.{key} must be >= {1 if key == 'fp8_amax_history_len' else 0}, "
                        f"got {getattr(self, key)}"
                    )
        if self.cuda_graph and self.device == "cpu":
            raise ConfigError(
                "train.cuda_graph captures the step as a CUDA graph: it needs a CUDA device, but "
                "train.device='cpu'"
            )
        if self.compile_coordinate_descent_tuning and not self.compile:
            raise ConfigError(
                "train.compile_coordinate_descent_tuning tunes compiled kernels: it needs "
                "train.compile=true"
            )
        if self.metrics_port is not None and self.control_port is None:
            # the metrics are served beside the control endpoint; without it nothing would be
            raise ConfigError(
                f"train.metrics_port={self.metrics_port} serves Prometheus metrics beside the "
                "control endpoint: it needs train.control_port set too (0: any free port)"
            )


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
    """With lr_decay_style='wsd' (required then): steps of the final decay, ending at
    lr_decay_iters."""
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
    optimizer_cpu_offload: bool = False
    """Keep AdamW's moments and an fp32 master copy of the parameters in (pinned) host memory and
    run the update on the CPU, PyTorch's fused CPU AdamW (--optimizer-cpu-offload; DeepSpeed's
    ZeRO-Offload). Under ZeRO-1 each rank offloads its slice (services/trainer/optim/offload.py)."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With optimizer_cpu_offload: update in chunks of cpu_offload_chunk_numel elements, each as
    soon as its gradients reach the host, its parameters copied back while the next chunk
    updates (--overlap-cpu-optimizer-d2h-h2d)."""
    cpu_offload_chunk_numel: int = 32 * 2**20
    """Elements per chunk of overlap_cpu_optimizer_d2h_h2d (a parameter is never split)."""
    offload_bf16_params: bool = True
    """With optimizer_cpu_offload and train.bf16: the device parameters are bf16 and the fp32
    master weights live on the host only (Megatron-LM's bf16 parameters with fp32 main
    parameters in the optimizer, what its --bf16 with --optimizer-cpu-offload does): each
    micro-batch's bf16 gradient is added into an fp32 main_grad, the update's fp32 masters are
    cast to bf16 and copied back, and checkpoints hold the fp32 masters. The device then holds
    2 + 4 bytes a parameter instead of 4 + 4 (+ 2 for the bf16 weight copies, which are
    pointless here and left off). False: fp32 device parameters under bf16 autocast, as
    without offload (services/trainer/optim/offload.py)."""

    def __post_init__(self) -> None:
        if not (0 <= self.min_lr <= self.lr < math.inf):
            raise ConfigError(
                f"optim: need 0 <= min_lr <= lr, got lr={self.lr} min_lr={self.min_lr}"
            )
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optim.{key} must be in [0, 1), got {getattr(self, key)}")
        if not 0 <= self.adam_eps < math.inf:
            raise ConfigError(f"optim.adam_eps must be >= 0, got {self.adam_eps}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.clip_grad < 0:
            raise ConfigError(f"optim.clip_grad must be >= 0, got {self.clip_grad}")
        if self.cpu_offload_chunk_numel <= 0:
            raise ConfigError(
                f"optim.cpu_offload_chunk_numel must be > 0, got {self.cpu_offload_chunk_numel}"
            )
        if self.overlap_cpu_optimizer_d2h_h2d and not self.optimizer_cpu_offload:
            raise ConfigError(
                "optim.overlap_cpu_optimizer_d2h_h2d overlaps the copies of the CPU optimizer: it "
                "needs optim.optimizer_cpu_offload"
            )
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"optim.lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_warmup_fraction is not None:
            if not 0 <= self.lr_warmup_fraction < 1:
                raise ConfigError(
                    f"optim.lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}"
                )
            if self.lr_warmup_iters:
                raise ConfigError(
                    "set one of optim.lr_warmup_iters and optim.lr_warmup_fraction, not both"
                )
        if self.lr_decay_style == "wsd":
            if self.lr_wsd_decay_iters is None or self.lr_wsd_decay_iters <= 0:
                raise ConfigError(
                    "optim.lr_decay_style='wsd' needs optim.lr_wsd_decay_iters, the steps of its "
                    f"final decay (--lr-wsd-decay-iters), > 0; got {self.lr_wsd_decay_iters}"
                )
        elif self.lr_wsd_decay_iters is not None:
            raise ConfigError(
                "optim.lr_wsd_decay_iters applies to lr_decay_style='wsd', not "
                f"{self.lr_decay_style!r}"
            )
        # An explicit decay length the warmup reaches would leave lr at its peak for good (the
        # schedule has nothing to decay over); 0 would silently mean "unset".
        if self.lr_decay_iters is not None and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ConfigError(
                f"optim.lr_decay_iters={self.lr_decay_iters} must be greater than "
                f"optim.lr_warmup_iters={self.lr_warmup_iters} (unset: train_iters)"
            )


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
                raise ConfigError(
                    f"log.{key} is a W&B setting: it needs log.wandb_project (--wandb-project)"
                )


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
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Preference tuning (with train.objective='dpo')."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward-model training (with train.objective='reward')."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """On-policy RL (with train.objective='grpo')."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """Tokens and TLS: what the trainer sends to the data and checkpoint services, and what its
    control endpoint requires (file paths only; no secret is part of the config)."""

    def __post_init__(self) -> None:
        # Known from the config alone: refused here, not once every rank has built its data.
        check_tensor_parallel(self.model, self.parallel.tp, self.parallel.sequence_parallel)
        check_context_parallel(self.model, self.parallel)
        check_experts(self.model, self.parallel, self.train)
        check_expert_fusion(self.model, self.parallel, self.train)
        check_fp8(self.train, self.parallel, self.model)
        check_documents(self.data, self.parallel, self.train)
        check_fully_sharded(self.model, self.parallel, self.train)
        check_optimizer_offload(self.optim, self.parallel, self.train)
        check_vision(self.model, self.parallel, self.train)
        self.data = resolve_multimodal(self.model, self.data)
        # the scalar head is part of the architecture (the checkpoint records it): a reward
        # model is trained with train.objective='reward', and only then has one
        if self.train.objective == "reward":
            self.model.reward_head = True
        elif self.model.reward_head:
            raise ConfigError(
                f"model.reward_head with train.objective={self.train.objective!r}: a reward "
                "model (a scalar head) is trained with train.objective='reward'; score with one "
                "in GRPO through grpo.reward_model"
            )
