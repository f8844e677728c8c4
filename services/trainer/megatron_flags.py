"""Megatron-LM flags that do not map onto a meshtrain key: accepted without effect, or refused by name.

`flags.ALIASES` maps the Megatron flags whose feature meshtrain has. The rest of the flags of
Megatron-LM's `pretrain_gpt.py` that common scripts pass are classified here, so that a pasted
script gets an answer for each of them instead of stopping at the first unknown word:

- `NO_EFFECT`: a speed, memory or bookkeeping knob whose effect meshtrain has built in or does not
  need (`--use-flash-attn`: attention runs a fused kernel anyway). Accepted with one warning.
- `NOT_BUILT`: a feature meshtrain does not have (fp16 loss scaling, FP8, batch-size ramp-up, ...).
  Every such flag of a command line is named in one error, one line each, with the reason.
- `NOT_BUILT_PREFIXES`: whole feature families (inference, RL, vision, Mamba, ...) by flag prefix.

    classify("--use-flash-attn")  # -> ("no_effect", "attention always runs a fused SDPA kernel ...")
    classify("--fp16")            # -> ("not_built", "no fp16 mixed precision (loss scaling): use --bf16")
"""

from __future__ import annotations

# flag -> (takes a value, why it changes nothing here)
NO_EFFECT: dict[str, tuple[bool, str]] = {
    "--use-flash-attn": (False, "attention always runs a fused SDPA kernel (model.attention_backend picks it)"),
    "--use-mcore-models": (False, "meshtrain has one model implementation"),
    "--transformer-impl": (True, "meshtrain's own layers run (Transformer Engine is not a dependency)"),
    "--no-masked-softmax-fusion": (False, "the attention softmax is inside the fused attention kernel"),
    "--no-bias-gelu-fusion": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--no-bias-swiglu-fusion": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--no-bias-dropout-fusion": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--no-rope-fusion": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--no-persist-layer-norm": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--cross-entropy-loss-fusion": (False, "the loss runs the fused cross-entropy kernel (train.kernels)"),
    "--cross-entropy-fusion-impl": (True, "the loss runs meshtrain's fused cross-entropy kernel (train.kernels)"),
    "--attention-softmax-in-fp32": (False, "the fused attention kernels accumulate the softmax in fp32"),
    "--accumulate-allreduce-grads-in-fp32": (False, "gradients are accumulated and reduced in fp32 "
                                                    "(parallel.grad_reduce_dtype)"),
    "--no-async-tensor-model-parallel-allreduce": (False, "parallel.tp_async_grad_reduce sets this"),
    "--disable-bf16-reduced-precision-matmul": (False, "matmul precision follows PyTorch's defaults"),
    "--manual-gc": (False, "Python's garbage collector runs as usual"),
    "--manual-gc-interval": (True, "Python's garbage collector runs as usual"),
    "--no-manual-gc-eval": (False, "Python's garbage collector runs as usual"),
    "--empty-unused-memory-level": (True, "PyTorch's caching allocator keeps its cache"),
    "--log-throughput": (False, "tokens/s and MFU are always logged"),
    "--log-progress": (False, "metrics.jsonl and the progress display always show progress"),
    "--timing-log-level": (True, "step time is always logged; there are no per-phase timers"),
    "--timing-log-option": (True, "step time is always logged; there are no per-phase timers"),
    "--log-memory-to-tensorboard": (False, "peak memory is always logged (metrics.jsonl, TensorBoard, W&B)"),
    "--log-validation-ppl-to-tensorboard": (False, "eval loss is logged; perplexity is exp(eval_loss)"),
    "--log-timers-to-tensorboard": (False, "step time is logged with the other scalars"),
    "--log-world-size-to-tensorboard": (False, "the world size is in the run's first log lines"),
    "--tensorboard-queue-size": (True, "events are flushed at every logged step"),
    "--exit-signal-handler": (False, "SIGTERM always saves a checkpoint and stops"),
    "--num-workers": (True, "batches are prefetched by a thread (data.prefetch), not worker processes"),
    "--no-mmap-bin-files": (False, "indexed datasets are always memory-mapped"),
    "--no-create-attention-mask-in-dataloader": (False, "attention is causal in the kernel; no mask is built"),
    "--dataloader-type": (True, "batches are a pure function of (step, rank): resume is exact whatever the type"),
    "--num-dataset-builder-threads": (True, "sample indices are built by one process and cached"),
    "--ckpt-format": (True, "checkpoints are meshtrain's zarr format, which loads at any parallel layout"),
    "--auto-detect-ckpt-format": (False, "checkpoints are meshtrain's zarr format"),
    "--ckpt-fully-parallel-save": (False, "each rank writes only the shards it owns"),
    "--no-ckpt-fully-parallel-save": (False, "each rank writes only the shards it owns"),
    "--ckpt-fully-parallel-load": (False, "each rank reads only the slices it needs"),
    "--ckpt-assume-constant-structure": (False, "save buffers are prepared once in the background"),
    "--use-dist-ckpt": (False, "checkpoints are always sharded and layout-independent"),
    "--dist-ckpt-format": (True, "checkpoints are meshtrain's zarr format"),
    "--ddp-average-in-collective": (False, "gradients are averaged over the data-parallel ranks either way"),
    "--ddp-pad-buckets-for-high-nccl-busbw": (False, "bucket sizes are set by parallel.ddp_bucket_size"),
    "--no-align-grad-reduce": (False, "bucket reductions are issued as backward finishes them"),
    "--no-align-param-gather": (False, "parameter all-gathers are issued per bucket"),
    "--distributed-backend": (True, "NCCL on CUDA, gloo on CPU, chosen by the device"),
    "--local-rank": (True, "the rank comes from the launcher's environment (RANK, LOCAL_RANK)"),
    "--use-cpu-initialization": (False, "the model is built on the meta device and materialized per shard"),
    "--no-initialization": (False, "a loaded checkpoint replaces the initial weights"),
    "--init-model-with-meta-device": (False, "the model is always built on the meta device first"),
    "--disable-jit-fuser": (False, "meshtrain uses no TorchScript fusers"),
    "--no-check-for-nan-in-loss-and-grad": (False, "a non-finite loss or gradient norm is logged, not checked"),
}

_FP8 = "no FP8 or FP4 training (Transformer Engine recipes); use --bf16"
_RAMPUP = "no batch-size ramp-up: the global batch size is fixed (train.global_batch_size)"
_PROFILE = ("no built-in profiler; run the trainer under nsys or torch.profiler "
            "(step times are in metrics.jsonl)")
_OFFLOAD = "no CPU offloading of activations or optimizer state"
_FSDP = "no FSDP; ZeRO-1 is --use-distributed-optimizer"
_CKPT = "checkpoints always hold model, optimizer, RNG and data position, loaded together"
_ARCH = "no such model architecture option"
_OPTIM = "the optimizer is AdamW (optim.*)"

NOT_BUILT: dict[str, tuple[str, ...]] = {
    "no fp16 mixed precision (loss scaling): use --bf16": (
        "--fp16", "--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window",
        "--hysteresis", "--fp16-lm-cross-entropy"),
    _FP8: ("--fp8-param-gather", "--fp4-param-gather", "--te-precision-config-file", "--first-last-layers-bf16",
           "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16", "--reuse-grad-buf-for-mxfp8-param-ag",
           "--keep-fp8-transpose-cache"),
    _RAMPUP: ("--rampup-batch-size", "--step-batch-size-schedule", "--decrease-batch-size-if-needed"),
    _PROFILE: ("--profile", "--profile-step-start", "--profile-step-end", "--use-pytorch-profiler",
               "--profile-ranks", "--record-memory-history", "--memory-snapshot-path", "--record-shapes",
               "--nvtx-ranges"),
    "no time or iteration limit besides train.train_iters; the scheduler's limit sends SIGTERM, which "
    "saves and stops": ("--exit-duration-in-mins", "--exit-interval", "--exit-signal"),
    "no separate learning rate for the embedding and output layers": ("--decoupled-lr", "--decoupled-min-lr"),
    "no weight-decay schedule: optim.weight_decay is constant": (
        "--start-weight-decay", "--end-weight-decay", "--weight-decay-incr-style"),
    "no warmup start value: the warmup rises from 0": ("--lr-warmup-init",),
    "no schedule in checkpoints: the schedule is always the config's": (
        "--override-opt-param-scheduler", "--override-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"),
    _OPTIM: ("--optimizer", "--sgd-momentum", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
             "--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype",
             "--exp-avg-sq-dtype", "--optimizer-cuda-graph"),
    "meshtrain averages the loss over each micro-batch's counted tokens (no per-token sum over the step)": (
        "--calculate-per-token-loss",),
    _ARCH: ("--apply-layernorm-1p", "--apply-residual-connection-post-layernorm", "--openai-gelu",
            "--squared-relu", "--quick-geglu", "--window-size", "--window-attn-skip-freq",
            "--rotary-interleaved", "--rotary-seq-len-interpolation-factor", "--no-rope-freq",
            "--no-position-embedding", "--use-rotary-position-embeddings", "--relative-attention-num-buckets",
            "--relative-attention-max-distance", "--qk-l2-norm", "--qk-clip", "--attention-output-gate",
            "--softmax-type", "--multi-latent-attention", "--glu-linear-offset", "--activation-func-clamp-value",
            "--embedding-init-method-std", "--init-method-xavier-uniform", "--apply-query-key-layer-scaling",
            "--mtp-num-layers", "--encoder-num-layers", "--decoder-num-layers", "--encoder-seq-length",
            "--decoder-seq-length", "--padded-vocab-size", "--no-pad-vocab-size", "--vocab-extra-ids",
            "--heterogeneous-layers-config-path", "--spec", "--yaml-cfg", "--freeze-all-layers"),
    _OFFLOAD: ("--cpu-offloading-num-layers", "--fine-grained-activation-offloading", "--offload-modules"),
    "no per-module recompute list: --recompute-granularity selective recomputes the attention core": (
        "--recompute-modules", "--distribute-saved-activations"),
    _FSDP: ("--use-megatron-fsdp", "--use-torch-fsdp2", "--data-parallel-sharding-strategy",
            "--num-distributed-optimizer-instances", "--overlap-param-gather-with-optimizer-step"),
    "no encoder/decoder split or custom rank order: ranks follow tp-cp-ep-dp-pp": (
        "--use-tp-pp-dp-mapping", "--pipeline-model-parallel-layout", "--model-parallel-size",
        "--num-virtual-stages-per-pipeline-rank", "--microbatch-group-size-per-virtual-pipeline-stage"),
    "no settings for the pipeline's point-to-point transfers": (
        "--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush", "--use-ring-exchange-p2p",
        "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "--delay-wgrad-compute"),
    "no Transformer Engine userbuffers; --tp-comm-overlap uses PyTorch's symmetric-memory ops": (
        "--tp-comm-overlap-cfg", "--tp-comm-bootstrap-backend", "--tp-comm-overlap-rs-dgrad",
        "--disable-tp-comm-bulk-wgrad", "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-overlap-ag",
        "--disable-tp-comm-overlap-rs", "--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs"),
    "no CUDA graphs of Megatron's kind: --train.cuda_graph captures a whole micro-batch": (
        "--enable-cuda-graph", "--cuda-graph-warmup-steps", "--external-cuda-graph", "--cuda-graph-impl",
        "--cuda-graph-scope"),
    _CKPT: ("--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng", "--finetune",
            "--pretrained-checkpoint", "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args",
            "--override-ckpt-iteration", "--load-main-params-from-ckpt", "--exit-on-missing-checkpoint"),
    "no non-persistent (local) checkpoints; every save goes to --save": (
        "--non-persistent-save-interval", "--non-persistent-ckpt-type", "--non-persistent-global-ckpt-dir",
        "--non-persistent-local-ckpt-dir", "--non-persistent-local-ckpt-algo", "--persistent-save-interval"),
    "no checkpoint conversion inside training: use `meshtrain ckpt convert`": (
        "--ckpt-convert-format", "--ckpt-convert-save", "--ckpt-convert-update-legacy-dist-opt-format"),
    "no in-run checkpoint replication": ("--replication", "--replication-jump", "--replication-factor"),
    "no separate train/valid/test paths or split files: --data-path with --split": (
        "--train-data-path", "--valid-data-path", "--test-data-path", "--data-args-path",
        "--per-split-data-args-path", "--per-dataset-sequences-path", "--multiple-validation-sets",
        "--validation-set-names", "--full-validation"),
    "no mock (random-token) data: without --data-path the run trains on the built-in corpus": ("--mock-data",),
    "no position-id or attention-mask resets at document ends (attention crosses documents, as Megatron's "
    "default)": ("--reset-position-ids", "--reset-attention-mask", "--dataloader-inter-document-masking"),
    "no separate evaluation batch sizes or start: evaluation uses the training batch sizes from the first "
    "interval": (
        "--eval-global-batch-size", "--eval-micro-batch-size", "--start-eval-at-iter", "--skip-train",
        "--test-mode"),
    "no step skipping or deterministic-mode switches": (
        "--iterations-to-skip", "--deterministic-mode", "--check-for-large-grads", "--check-for-spiky-loss",
        "--rerun-mode", "--error-injection-rate", "--error-injection-type",
        "--check-weight-hash-across-dp-replicas-interval", "--data-parallel-random-init", "--te-rng-tracker"),
    "no such log: scalars go to metrics.jsonl, TensorBoard and W&B at log.log_interval": (
        "--tensorboard-log-interval", "--log-params-norm", "--log-num-zeros-in-grad", "--log-max-attention-logit",
        "--log-energy", "--log-memory-interval", "--log-device-memory-used", "--log-straggler",
        "--config-logger-dir", "--logging-level", "--no-log-loss-scale-to-tensorboard"),
    "no expert capacity padding, upcycling, router groups or alternative dispatchers (see docs/moe.md)": (
        "--moe-token-dispatcher-type", "--moe-router-num-groups", "--moe-router-group-topk",
        "--moe-pad-expert-input-to-capacity", "--moe-use-upcycling", "--moe-upcycling-granularity",
        "--moe-input-jitter-eps", "--moe-shared-expert-overlap", "--moe-layer-recompute", "--moe-router-dtype",
        "--moe-router-force-load-balancing", "--moe-per-layer-logging", "--moe-permute-fusion",
        "--moe-router-fusion", "--moe-apply-probs-on-input", "--moe-enable-deepep", "--moe-latent-size",
        "--moe-expert-rank-capacity-factor", "--moe-router-padding-for-fp8",
        "--moe-router-padding-for-quantization", "--overlap-moe-expert-parallel-comm"),
    "no chat templates, SFT formats or tokenizer options beyond --tokenizer-type's": (
        "--tokenizer-metadata", "--tokenizer-special-tokens", "--tokenizer-sentencepiece-legacy",
        "--tokenizer-hf-no-use-fast", "--tokenizer-hf-no-include-special-tokens", "--trust-remote-code",
        "--null-tokenizer-eod-id", "--null-tokenizer-pad-id", "--chat-template", "--sft",
        "--sft-tokenizer-prompt-format"),
    "no fault-tolerance, autoresume or straggler services: the launcher restarts from the last checkpoint": (
        "--adlr-autoresume", "--adlr-autoresume-interval", "--enable-ft-package", "--calc-ft-timeouts",
        "--run-workload-inspector-server"),
    "no SHARP, NCCL user buffers or communicator config files": (
        "--use-sharp", "--sharp-enabled-group", "--use-nccl-ub", "--nccl-communicator-config-path",
        "--high-priority-stream-groups", "--disable-gloo-process-groups", "--fake-process-group"),
}

# Flag prefixes of whole feature families.
NOT_BUILT_PREFIXES: dict[str, str] = {
    "--fp8-": _FP8, "--fp4-": _FP8, "--no-fp8-": _FP8, "--disable-fp8-": _FP8, "--kitchen-": _FP8,
    "--use-kitchen-": _FP8,
    "--inference-": "no inference server (see `meshtrain generate`)", "--rl-": "no reinforcement learning",
    "--grpo-": "no reinforcement learning", "--mamba-": "no Mamba or hybrid models",
    "--hybrid-": "no Mamba or hybrid models", "--is-hybrid-model": "no Mamba or hybrid models",
    "--mla-": _ARCH, "--q-lora-": _ARCH, "--kv-lora-": _ARCH, "--yarn-": _ARCH, "--dsa-": _ARCH,
    "--mtp-": _ARCH, "--mhc-": _ARCH, "--linear-": _ARCH, "--mup-": _ARCH, "--use-mup": _ARCH,
    "--muon-": _OPTIM, "--lion-": _OPTIM, "--vision-": "no vision models", "--dino-": "no vision models",
    "--img-": "no vision models", "--ict-": "no retrieval models", "--biencoder-": "no retrieval models",
    "--fim-": "no fill-in-the-middle data", "--inprocess-": "no in-process restart",
    "--one-logger": "no one-logger", "--otel-": "no OpenTelemetry export", "--straggler-": "no straggler detector",
    "--fault-injector-": "no fault injector", "--logits-": "no logit distillation",
    "--megatron-fsdp-": _FSDP, "--fsdp-": _FSDP, "--torch-fsdp2-": _FSDP, "--moe-hybridep-": "no HybridEP",
    "--moe-deepep-": "no DeepEP", "--moe-flex-dispatcher-": "no flex dispatcher", "--moe-paged-stash": _OFFLOAD,
    "--moe-routing-trace-": "no routing traces",
}

_NOT_BUILT_BY_FLAG = {flag: why for why, flags in NOT_BUILT.items() for flag in flags}


def classify(flag: str) -> tuple[str, str] | None:
    """("no_effect" | "not_built", why) for a Megatron flag this table knows; None otherwise."""
    if flag in NO_EFFECT:
        return "no_effect", NO_EFFECT[flag][1]
    if flag in _NOT_BUILT_BY_FLAG:
        return "not_built", _NOT_BUILT_BY_FLAG[flag]
    for prefix, why in NOT_BUILT_PREFIXES.items():
        if flag.startswith(prefix):
            return "not_built", why
    return None
