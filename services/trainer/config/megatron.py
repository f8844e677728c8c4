"""Megatron-LM flags without a meshtrain key: accepted without effect, or refused by name.

`flags.ALIASES` (and the few flags `flags.py` reads together with others) maps the Megatron flags
whose feature meshtrain has. Every other flag of Megatron-LM's `pretrain_gpt.py` parser (checked
against Megatron-LM at commit d98e8a6, August 2026: 877 flags) is classified here, so that a
pasted script gets an answer for each of them instead of stopping at the first unknown word:

- `NO_EFFECT`: a speed, memory or bookkeeping knob whose effect meshtrain has built in or does not
  need (`--use-flash-attn`: attention runs a fused kernel anyway). Accepted with one warning.
- `NOT_BUILT`: a feature meshtrain does not have (fp16 loss scaling, FP8, batch-size ramp-up, ...).
  Every such flag of a command line is named in one error, one line each, with the reason.
- `NOT_BUILT_PREFIXES`: whole feature families (inference, RL, vision, Mamba, ...) by flag prefix.

    classify("--use-flash-attn")  # -> ("no_effect", "attention always runs a fused SDPA ...")
    classify("--fp16")            # -> ("not_built", "no fp16 mixed precision (loss scaling) ...")
"""

from __future__ import annotations

# flag -> (takes a value, why it changes nothing here)
NO_EFFECT: dict[str, tuple[bool, str]] = {
    "--use-torch-optimizer-for-cpu-offload": (
        False,
        "the offloaded update always runs PyTorch's fused CPU AdamW (optim.optimizer_cpu_offload)",
    ),
    "--use-flash-attn": (
        False,
        "attention always runs a fused SDPA kernel (model.attention_backend picks it)",
    ),
    "--use-mcore-models": (False, "meshtrain has one model implementation"),
    "--transformer-impl": (
        True,
        "meshtrain's own layers run (Transformer Engine is not a dependency)",
    ),
    "--no-masked-softmax-fusion": (
        False,
        "the attention softmax is inside the fused attention kernel",
    ),
    "--no-bias-gelu-fusion": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--no-bias-swiglu-fusion": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--no-bias-dropout-fusion": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--no-rope-fusion": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--no-persist-layer-norm": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--cross-entropy-loss-fusion": (
        False,
        "the loss runs the fused cross-entropy kernel (train.kernels)",
    ),
    "--cross-entropy-fusion-impl": (
        True,
        "the loss runs meshtrain's fused cross-entropy kernel (train.kernels)",
    ),
    "--attention-softmax-in-fp32": (
        False,
        "the fused attention kernels accumulate the softmax in fp32",
    ),
    "--accumulate-allreduce-grads-in-fp32": (
        False,
        "gradients are accumulated and reduced in fp32 (parallel.grad_reduce_dtype)",
    ),
    "--disable-bf16-reduced-precision-matmul": (
        False,
        "matmul precision follows PyTorch's defaults",
    ),
    "--manual-gc": (False, "Python's garbage collector runs as usual"),
    "--manual-gc-interval": (True, "Python's garbage collector runs as usual"),
    "--no-manual-gc-eval": (False, "Python's garbage collector runs as usual"),
    "--empty-unused-memory-level": (True, "PyTorch's caching allocator keeps its cache"),
    "--log-throughput": (False, "tokens/s and MFU are always logged"),
    "--log-progress": (False, "metrics.jsonl and the progress display always show progress"),
    "--timing-log-level": (True, "step time is always logged; there are no per-phase timers"),
    "--timing-log-option": (True, "step time is always logged; there are no per-phase timers"),
    "--log-memory-to-tensorboard": (
        False,
        "peak memory is always logged (metrics.jsonl, TensorBoard, W&B)",
    ),
    "--log-validation-ppl-to-tensorboard": (
        False,
        "eval loss is logged; perplexity is exp(eval_loss)",
    ),
    "--log-timers-to-tensorboard": (False, "step time is logged with the other scalars"),
    "--log-world-size-to-tensorboard": (False, "the world size is in the run's first log lines"),
    "--tensorboard-queue-size": (True, "events are flushed at every logged step"),
    "--exit-signal-handler": (False, "SIGTERM always saves a checkpoint and stops"),
    "--num-workers": (
        True,
        "batches are prefetched by a thread (data.prefetch), not worker processes",
    ),
    "--no-mmap-bin-files": (False, "indexed datasets are always memory-mapped"),
    "--no-create-attention-mask-in-dataloader": (
        False,
        "attention is causal in the kernel; no mask is built",
    ),
    "--dataloader-type": (
        True,
        "batches are a pure function of (step, rank): resume is exact whatever the type",
    ),
    "--num-dataset-builder-threads": (True, "sample indices are built by one process and cached"),
    "--ckpt-format": (
        True,
        "checkpoints are meshtrain's zarr format, which loads at any parallel layout",
    ),
    "--auto-detect-ckpt-format": (False, "checkpoints are meshtrain's zarr format"),
    "--ckpt-fully-parallel-save": (False, "each rank writes only the shards it owns"),
    "--no-ckpt-fully-parallel-save": (False, "each rank writes only the shards it owns"),
    "--ckpt-fully-parallel-load": (False, "each rank reads only the slices it needs"),
    "--ckpt-assume-constant-structure": (False, "save buffers are prepared once in the background"),
    "--use-dist-ckpt": (False, "checkpoints are always sharded and layout-independent"),
    "--dist-ckpt-format": (True, "checkpoints are meshtrain's zarr format"),
    "--ddp-average-in-collective": (
        False,
        "gradients are averaged over the data-parallel ranks either way",
    ),
    "--ddp-pad-buckets-for-high-nccl-busbw": (
        False,
        "bucket sizes are set by parallel.ddp_bucket_size",
    ),
    "--no-align-grad-reduce": (False, "bucket reductions are issued as backward finishes them"),
    "--no-align-param-gather": (False, "parameter all-gathers are issued per bucket"),
    "--distributed-backend": (True, "NCCL on CUDA, gloo on CPU, chosen by the device"),
    "--local-rank": (True, "the rank comes from the launcher's environment (RANK, LOCAL_RANK)"),
    "--use-cpu-initialization": (
        False,
        "the model is built on the meta device and materialized per shard",
    ),
    "--no-initialization": (False, "a loaded checkpoint replaces the initial weights"),
    "--init-model-with-meta-device": (False, "the model is always built on the meta device first"),
    "--disable-jit-fuser": (False, "meshtrain uses no TorchScript fusers"),
    "--no-check-for-nan-in-loss-and-grad": (
        False,
        "a non-finite loss or gradient norm is logged, not checked",
    ),
    "--no-clone-scatter-output-in-embedding": (False, "the embedding's output is not cloned"),
    "--disable-clone-scatter-output-in-embedding": (False, "the embedding's output is not cloned"),
    "--use-te-activation-func": (False, "activations run meshtrain's kernels (train.kernels)"),
    "--use-transformer-engine-op-fuser": (
        False,
        "kernel fusion is chosen by train.kernels / train.compile",
    ),
    "--fused-residual-rmsnorm": (False, "kernel fusion is chosen by train.kernels / train.compile"),
    "--flash-attention-version": (True, "the flash kernel is PyTorch's SDPA one"),
    "--train-sync-interval": (True, "the host syncs with the device once per logged step"),
    "--exit-signal-handler-for-dataloader": (False, "SIGTERM always saves a checkpoint and stops"),
    "--exit-signal-handler-for-training": (False, "SIGTERM always saves a checkpoint and stops"),
    "--disable-manual-gc-eval": (False, "Python's garbage collector runs as usual"),
    "--async-strategy": (
        True,
        "an asynchronous save is written by a background thread (checkpoint.async_save)",
    ),
    "--use-persistent-ckpt-worker": (
        False,
        "an asynchronous save is written by a background thread",
    ),
    "--async-ckpt-cpu-priority": (True, "an asynchronous save is written by a background thread"),
    "--async-ckpt-io-priority": (True, "an asynchronous save is written by a background thread"),
    "--async-ckpt-use-cpu-shm": (False, "an asynchronous save is written by a background thread"),
    "--ckpt-fully-parallel-load-exchange-algo": (True, "each rank reads only the slices it needs"),
    "--ckpt-fully-parallel-load-per-rank-objects": (
        False,
        "each rank reads only the slices it needs",
    ),
    "--ckpt-fully-parallel-save-process-group": (True, "each rank writes only the shards it owns"),
    "--ckpt-fully-parallel-load-process-group": (True, "each rank reads only the slices it needs"),
    "--ckpt-pg-tensors-cache-path": (True, "save buffers are prepared once in the background"),
    "--ckpt-pg-tensors-cache-create": (False, "save buffers are prepared once in the background"),
    "--dist-ckpt-save-pre-mcore-014": (False, "checkpoints are meshtrain's zarr format"),
    "--dist-ckpt-optim-fully-reshardable": (
        False,
        "optimizer state is stored per parameter: any layout loads it",
    ),
    "--distrib-optim-fully-reshardable-mem-efficient": (
        False,
        "optimizer state is stored per parameter: any layout loads it",
    ),
    "--no-save-tokenizer-assets": (
        False,
        "checkpoints hold no tokenizer files (the config names the tokenizer)",
    ),
    "--disable-save-tokenizer-assets": (
        False,
        "checkpoints hold no tokenizer files (the config names the tokenizer)",
    ),
    "--dist-ckpt-workers": (True, "each rank writes its shards with its own I/O threads"),
    "--ckpt-drop-redundant-extra-state": (
        False,
        "checkpoints hold no Transformer Engine extra state",
    ),
    "--disable-align-grad-reduce": (
        False,
        "bucket reductions are issued as backward finishes them",
    ),
    "--disable-symmetric-registration": (False, "no NCCL buffer registration is made"),
    "--create-all-gather-group": (False, "parameter all-gathers share the data-parallel group"),
    "--no-gradient-reduce-div-fusion": (
        False,
        "gradients are averaged over the data-parallel ranks either way",
    ),
    "--dataloader-fast-cache-load": (False, "sample indices are built once and cached"),
    "--dataloader-defer-npy-index-mmap": (False, "sample indices are built once and cached"),
    "--mid-level-dataset-surplus": (
        True,
        "blending picks exactly the dataset furthest behind its share",
    ),
    "--no-log-loss-scale-to-tensorboard": (False, "there is no loss scale (no fp16 training)"),
    "--disable-log-loss-scale-to-tensorboard": (False, "there is no loss scale (no fp16 training)"),
    "--no-barrier-with-level-1-timing": (False, "there are no per-phase timers"),
    "--no-ckpt-load-validate-sharding-integrity": (
        False,
        "loading reads the manifest's arrays either way",
    ),
    "--disable-ckpt-load-validate-sharding-integrity": (
        False,
        "loading reads the manifest's arrays either way",
    ),
}

_FP8 = (
    "not built: FP8 is train.fp8 (--fp8-format, --fp8-recipe tensorwise|rowwise|delayed); "
    "Transformer Engine's other FP8/FP4 options are not"
)
_RAMPUP = "no batch-size ramp-up: the global batch size is fixed (train.global_batch_size)"
_PROFILE = (
    "no built-in profiler; run the trainer under nsys or torch.profiler "
    "(step times are in metrics.jsonl)"
)
_OFFLOAD = "no CPU offloading of activations"
_OPTIM_OFFLOAD = (
    "the CPU optimizer (--optimizer-cpu-offload) offloads the whole optimizer state with pinned "
    "gradient and parameter buffers; no fraction of it, no unpinned buffers"
)
_FSDP = (
    "no Megatron-FSDP: fully sharded data parallelism is torch FSDP2 (--use-torch-fsdp2, "
    "--data-parallel-sharding-strategy)"
)
_CKPT = (
    "checkpoints always hold model, optimizer, RNG and data position (what a run loads of them: "
    "--finetune, --no-load-optim, --no-load-rng)"
)
_ARCH = "no such model architecture option"
_OPTIM = "the optimizer is AdamW (optim.*) with weight decay on matrices alone"
_INFERENCE = "no inference server (see `meshtrain generate`)"
_RECORDER = (
    "no NCCL flight-recorder settings (PyTorch's TORCH_NCCL_* environment variables set them)"
)

NOT_BUILT: dict[str, tuple[str, ...]] = {
    "no fp16 mixed precision (loss scaling): use --bf16": (
        "--fp16",
        "--loss-scale",
        "--initial-loss-scale",
        "--min-loss-scale",
        "--loss-scale-window",
        "--hysteresis",
        "--fp16-lm-cross-entropy",
    ),
    _FP8: (
        "--fp8-param-gather",
        "--fp4-param-gather",
        "--te-precision-config-file",
        "--reuse-grad-buf-for-mxfp8-param-ag",
        "--keep-fp8-transpose-cache",
    ),
    _RAMPUP: (
        "--rampup-batch-size",
        "--step-batch-size-schedule",
        "--decrease-batch-size-if-needed",
    ),
    _PROFILE: (
        "--profile",
        "--profile-step-start",
        "--profile-step-end",
        "--use-pytorch-profiler",
        "--profile-ranks",
        "--record-memory-history",
        "--pytorch-profiler-collect-shapes",
        "--pytorch-profiler-collect-callstack",
        "--pytorch-profiler-collect-chakra",
        "--memory-snapshot-path",
        "--record-shapes",
        "--nvtx-ranges",
    ),
    "no time or iteration limit besides train.train_iters; the scheduler's limit sends SIGTERM, "
    "which saves and stops": ("--exit-duration-in-mins", "--exit-interval", "--exit-signal"),
    "no separate learning rate for the embedding and output layers": (
        "--decoupled-lr",
        "--decoupled-min-lr",
    ),
    "no weight-decay schedule: optim.weight_decay is constant": (
        "--start-weight-decay",
        "--end-weight-decay",
        "--weight-decay-incr-style",
    ),
    "no warmup start value: the warmup rises from 0": ("--lr-warmup-init",),
    "no schedule in checkpoints: the schedule is always the config's": (
        "--override-opt-param-scheduler",
        "--override-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
    ),
    _OPTIM: (
        "--optimizer",
        "--sgd-momentum",
        "--no-weight-decay-cond-type",
        "--apply-wd-to-qk-layernorm",
        "--use-precision-aware-optimizer",
        "--main-grads-dtype",
        "--main-params-dtype",
        "--exp-avg-dtype",
        "--exp-avg-sq-dtype",
        "--optimizer-cuda-graph",
    ),
    "meshtrain averages the loss over each micro-batch's counted tokens (no per-token sum over "
    "the step)": ("--calculate-per-token-loss",),
    _ARCH: (
        "--apply-layernorm-1p",
        "--apply-residual-connection-post-layernorm",
        "--squared-relu",
        "--quick-geglu",
        "--window-size",
        "--window-attn-skip-freq",
        "--rotary-interleaved",
        "--rotary-seq-len-interpolation-factor",
        "--no-rope-freq",
        "--no-position-embedding",
        "--use-rotary-position-embeddings",
        "--relative-attention-num-buckets",
        "--relative-attention-max-distance",
        "--qk-l2-norm",
        "--qk-clip",
        "--attention-output-gate",
        "--softmax-type",
        "--multi-latent-attention",
        "--glu-linear-offset",
        "--activation-func-clamp-value",
        "--embedding-init-method-std",
        "--init-method-xavier-uniform",
        "--apply-query-key-layer-scaling",
        "--mtp-num-layers",
        "--encoder-num-layers",
        "--decoder-num-layers",
        "--encoder-seq-length",
        "--decoder-seq-length",
        "--padded-vocab-size",
        "--no-pad-vocab-size",
        "--vocab-extra-ids",
        "--heterogeneous-layers-config-path",
        "--spec",
        "--yaml-cfg",
        "--freeze-all-layers",
        "--qk-clip-alpha",
        "--qk-clip-threshold",
        "--experimental-attention-variant",
        "--mrope-section",
        "--rope-type",
        "--onnx-safe",
        "--bert-no-binary-head",
        "--enable-mhc-connections",
        "--use-fused-weighted-squared-relu",
        "--output-logit-dtype",
        "--disable-pad-vocab-size",
    ),
    _OFFLOAD: (
        "--cpu-offloading-num-layers",
        "--fine-grained-activation-offloading",
        "--offload-modules",
        "--cpu-offloading-retain-pinned-cpu-buffers",
        "--min-offloaded-tensor-size",
        "--delay-offload-until-cuda-graph",
        "--delta-offload-bytes-across-pp-ranks",
        "--activation-offload-fraction",
        "--fine-grained-offloading-max-inflight-offloads",
    ),
    _OPTIM_OFFLOAD: (
        "--optimizer-offload-fraction",
        "--no-pin-cpu-grads",
        "--no-pin-cpu-params",
    ),
    "no per-module recompute list: --recompute-granularity selective recomputes the attention "
    "core": (
        "--recompute-modules",
        "--distribute-saved-activations",
    ),
    _FSDP: (
        "--use-megatron-fsdp",
        "--no-use-layer-wise-param-layout",
        "--outer-dp-sharding-strategy",
        "--suggested-communication-unit-size",
        "--enable-full-sharding-in-hsdp",
        "--num-distributed-optimizer-instances",
        "--overlap-param-gather-with-optimizer-step",
    ),
    "no encoder/decoder split or custom rank order: ranks follow tp-cp-ep-dp-pp; pipeline stages "
    "split the blocks alone (--decoder-first/last-pipeline-num-layers, parallel.pipeline_layout)": (
        "--use-tp-pp-dp-mapping",
        "--pipeline-model-parallel-layout",
        "--model-parallel-size",
        "--num-virtual-stages-per-pipeline-rank",
        "--microbatch-group-size-per-virtual-pipeline-stage",
        "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
        "--pipeline-model-parallel-comm-backend",
        "--lazy-mpu-init",
    ),
    "no generalized tensor parallelism or variable-length sequences: weights split over "
    "--tensor-model-parallel-size only": (
        "--tensor-parallel-num-weight-shards",
        "--expert-tensor-parallel-num-weight-shards",
        "--max-seqlen-per-dp-cp-rank",
        "--hybrid-context-parallel",
    ),
    "no settings for the pipeline's point-to-point transfers": (
        "--no-overlap-p2p-communication",
        "--overlap-p2p-communication-warmup-flush",
        "--use-ring-exchange-p2p",
        "--defer-embedding-wgrad-compute",
        "--wgrad-deferral-limit",
        "--delay-wgrad-compute",
    ),
    "no Transformer Engine userbuffers; --tp-comm-overlap uses PyTorch's symmetric-memory ops": (
        "--tp-comm-overlap-cfg",
        "--tp-comm-bootstrap-backend",
        "--tp-comm-overlap-rs-dgrad",
        "--disable-tp-comm-bulk-wgrad",
        "--disable-tp-comm-bulk-dgrad",
        "--disable-tp-comm-overlap-ag",
        "--disable-tp-comm-overlap-rs",
        "--disable-tp-comm-split-ag",
        "--disable-tp-comm-split-rs",
        "--no-tp-comm-bulk-wgrad",
        "--no-tp-comm-bulk-dgrad",
        "--no-tp-comm-overlap-ag",
        "--no-tp-comm-overlap-rs",
        "--no-tp-comm-split-ag",
        "--no-tp-comm-split-rs",
    ),
    "no CUDA graphs of Megatron's kind: --train.cuda_graph captures a whole micro-batch": (
        "--enable-cuda-graph",
        "--cuda-graph-warmup-steps",
        "--external-cuda-graph",
        "--cuda-graph-impl",
        "--cuda-graph-scope",
    ),
    _CKPT: (
        "--no-save-optim",
        "--no-save-rng",
        "--pretrained-checkpoint",
        "--use-checkpoint-args",
        "--use-mp-args-from-checkpoint-args",
        "--override-ckpt-iteration",
        "--load-main-params-from-ckpt",
        "--exit-on-missing-checkpoint",
        "--no-use-tokenizer-model-from-checkpoint-args",
        "--disable-use-tokenizer-model-from-checkpoint-args",
        "--dist-ckpt-strictness",
        "--verify-integrity",
    ),
    "no dumps of activations, gradients or parameters besides checkpoints; retention is "
    "checkpoint.keep_last and checkpoint.keep_every": (
        "--save-params-interval",
        "--save-activations-interval",
        "--save-tokens-per-expert-interval",
        "--save-wgrads-interval",
        "--save-dgrads-interval",
        "--save-retain-interval",
    ),
    "no non-persistent (local) checkpoints; every save goes to --save": (
        "--non-persistent-save-interval",
        "--non-persistent-ckpt-type",
        "--non-persistent-global-ckpt-dir",
        "--non-persistent-local-ckpt-dir",
        "--non-persistent-local-ckpt-algo",
        "--persistent-save-interval",
    ),
    "no checkpoint conversion inside training: use `meshtrain ckpt convert`": (
        "--ckpt-convert-format",
        "--ckpt-convert-save",
        "--ckpt-convert-update-legacy-dist-opt-format",
    ),
    "no in-run checkpoint replication": (
        "--replication",
        "--replication-jump",
        "--replication-factor",
    ),
    "no separate train/valid/test paths or split files: --data-path with --split": (
        "--train-data-path",
        "--valid-data-path",
        "--test-data-path",
        "--data-args-path",
        "--per-split-data-args-path",
        "--per-dataset-sequences-path",
        "--multiple-validation-sets",
        "--validation-set-names",
        "--full-validation",
    ),
    "no mock (random-token) data: without --data-path the run trains on the built-in corpus": (
        "--mock-data",
    ),
    "no inter-document masking switch of the data loader: --reset-attention-mask masks "
    "attention at document ends": ("--dataloader-inter-document-masking",),
    "no separate evaluation batch sizes or start: evaluation uses the training batch sizes from "
    "the first interval": (
        "--eval-global-batch-size",
        "--eval-micro-batch-size",
        "--start-eval-at-iter",
        "--skip-train",
        "--test-mode",
    ),
    "no step skipping or deterministic-mode switches": (
        "--iterations-to-skip",
        "--deterministic-mode",
        "--batch-invariant-mode",
        "--batch-invariant-backend",
        "--result-rejected-tracker-filename",
        "--check-for-large-grads",
        "--check-for-spiky-loss",
        "--rerun-mode",
        "--error-injection-rate",
        "--error-injection-type",
        "--check-weight-hash-across-dp-replicas-interval",
        "--data-parallel-random-init",
        "--te-rng-tracker",
    ),
    "no such log: scalars go to metrics.jsonl, TensorBoard and W&B at log.log_interval": (
        "--tensorboard-log-interval",
        "--log-params-norm",
        "--log-num-zeros-in-grad",
        "--log-max-attention-logit",
        "--log-energy",
        "--log-memory-interval",
        "--log-device-memory-used",
        "--log-straggler",
        "--config-logger-dir",
        "--logging-level",
        "--dump-param-to-param-group-map",
        "--gpu-sniff-test-interval",
    ),
    "no expert capacity padding, upcycling, router groups or alternative dispatchers (see "
    "docs/moe.md)": (
        "--moe-token-dispatcher-type",
        "--moe-router-num-groups",
        "--moe-router-group-topk",
        "--moe-pad-expert-input-to-capacity",
        "--moe-use-upcycling",
        "--moe-upcycling-granularity",
        "--moe-input-jitter-eps",
        "--moe-shared-expert-overlap",
        "--moe-layer-recompute",
        "--moe-router-dtype",
        "--moe-router-force-load-balancing",
        "--moe-per-layer-logging",
        "--moe-permute-fusion",
        "--moe-router-fusion",
        "--moe-apply-probs-on-input",
        "--moe-enable-deepep",
        "--moe-latent-size",
        "--moe-expert-rank-capacity-factor",
        "--moe-router-padding-for-fp8",
        "--moe-router-padding-for-quantization",
        "--overlap-moe-expert-parallel-comm",
        "--overlap-dispatch-backward-with-experts-wgrad",
        "--ep-overlap-early-attn-memory-release",
        "--high-priority-a2a-comm-stream",
        "--use-grouped-gemm-for-shared-expert",
        "--moe-shared-expert-glu-interleave-size",
        "--moe-enable-routing-replay",
        "--moe-router-quantile-balancing-ema",
        "--moe-router-force-biased",
        "--use-grouped-gemm-for-dense-mlp",
        "--moe-use-grouped-tensor",
        "--moe-single-grouped-weight",
        "--moe-single-grouped-bias",
        "--moe-permute-fusion-into-hybridep",
        "--moe-pad-experts-for-cuda-graph-inference",
        "--moe-ncclep-zero-copy",
        "--moe-dispatch-fwd-dtype",
        "--moe-combine-bwd-dtype",
        "--moe-mlp-glu-interleave-size",
    ),
    "no tokenizer options beyond --tokenizer-type's; a chat template is chosen when the SFT "
    "data is made (`meshtrain data preprocess --chat --chat-template`)": (
        "--tokenizer-metadata",
        "--tokenizer-special-tokens",
        "--tokenizer-sentencepiece-legacy",
        "--tokenizer-hf-no-use-fast",
        "--tokenizer-hf-no-include-special-tokens",
        "--trust-remote-code",
        "--null-tokenizer-eod-id",
        "--null-tokenizer-pad-id",
        "--chat-template",
        "--sft-tokenizer-prompt-format",
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
        "--use-gigatoken",
        "--allow-ambiguous-pad-tokens",
    ),
    "no fault-tolerance, autoresume or straggler services: the launcher restarts from the last "
    "checkpoint": (
        "--adlr-autoresume",
        "--adlr-autoresume-interval",
        "--enable-ft-package",
        "--calc-ft-timeouts",
        "--run-workload-inspector-server",
    ),
    "no SHARP, NCCL user buffers or communicator config files": (
        "--use-sharp",
        "--sharp-enabled-group",
        "--use-nccl-ub",
        "--nccl-communicator-config-path",
        "--high-priority-stream-groups",
        "--disable-gloo-process-groups",
        "--fake-process-group",
        "--distributed-timeout-seconds-after-init",
        "--ddp-num-buckets",
        "--ddp-reduce-scatter-with-fp32-accumulation",
        "--ddp-param-name-patterns-for-fp32-local-accumulation",
    ),
    "no BERT or T5 data: meshtrain trains GPT models": (
        "--sample-rate",
        "--mask-prob",
        "--short-seq-prob",
    ),
    "no blend phases or object-storage dataset cache: --data-path's blend holds for the whole "
    "run": (
        "--phase-transition-iterations",
        "--object-storage-cache-path",
    ),
    "no retrieval or vision models: meshtrain trains GPT models": (
        "--bert-load",
        "--titles-data-path",
        "--query-in-block-prob",
        "--use-one-sent-docs",
        "--evidence-data-path",
        "--retriever-report-topk-accuracies",
        "--retriever-score-scaling",
        "--block-data-path",
        "--embedding-path",
        "--indexer-batch-size",
        "--indexer-log-interval",
        "--num-classes",
        "--num-channels",
        "--patch-dim",
        "--classes-fraction",
        "--data-per-class-fraction",
        "--no-data-sharding",
        "--head-lr-mult",
        "--swin-backbone-type",
        "--mask-type",
        "--mask-factor",
        "--iter-per-epoch",
        "--output-bert-embeddings",
        "--bert-embedder-type",
    ),
    _ARCH + " (multi-latent attention)": (
        "--qk-head-dim",
        "--qk-pos-emb-head-dim",
        "--v-head-dim",
        "--rotary-scaling-factor",
        "--mscale",
        "--mscale-all-dim",
        "--cache-mla-latents",
        "--heterogeneous-layers-config-encoded-json",
    ),
    _INFERENCE: (
        "--max-tokens-to-oom",
        "--cuda-graph-modules",
        "--use-legacy-static-engine",
        "--decode-only-cuda-graphs",
        "--enable-chunked-prefill",
        "--num-speculative-tokens",
        "--use-same-sampling-seed-across-dp-ranks",
    ),
    "no reinforcement learning": ("--perform-rl-step", "--langrl-env-config", "--refit-method"),
    "no multi-storage client: --save and --load take file://, s3:// and memory:// URLs": (
        "--enable-msc",
        "--disable-msc",
    ),
    "no one-logger, fault-tolerance package or straggler detector": (
        "--no-one-logger",
        "--app-tag-run-name",
        "--app-tag-run-version",
        "--ft-num-warmup-iters",
        "--disable-straggler-on-startup",
    ),
    "no experimental Megatron-LM features": ("--enable-experimental",),
    "--warmup is Megatron's retired warmup flag: use --lr-warmup-iters or --lr-warmup-fraction": (
        "--warmup",
    ),
}

# The flags of those families that meshtrain has (train.fp8*: flags.ALIASES maps them).
FAMILY_FLAGS_BUILT = frozenset(
    {
        "--fp8-format",
        "--fp8-recipe",
        "--fp8-margin",
        "--fp8-amax-history-len",
        "--fp8-amax-compute-algo",
    }
)

# Flag prefixes of whole feature families.
NOT_BUILT_PREFIXES: dict[str, str] = {
    "--fp8-": _FP8,
    "--fp4-": _FP8,
    "--no-fp8-": _FP8,
    "--disable-fp8-": _FP8,
    "--kitchen-": _FP8,
    "--use-kitchen-": _FP8,
    "--inference-": _INFERENCE,
    "--no-inference-": _INFERENCE,
    "--no-rl-": "no reinforcement learning",
    "--rl-": "no reinforcement learning",
    "--grpo-": "no reinforcement learning",
    "--mamba-": "no Mamba or hybrid models",
    "--hybrid-": "no Mamba or hybrid models",
    "--is-hybrid-model": "no Mamba or hybrid models",
    "--mla-": _ARCH,
    "--q-lora-": _ARCH,
    "--kv-lora-": _ARCH,
    "--yarn-": _ARCH,
    "--dsa-": _ARCH,
    "--mtp-": _ARCH,
    "--mhc-": _ARCH,
    "--linear-": _ARCH,
    "--mup-": _ARCH,
    "--use-mup": _ARCH,
    "--muon-": _OPTIM,
    "--lion-": _OPTIM,
    "--vision-": "no vision models",
    "--dino-": "no vision models",
    "--img-": "no vision models",
    "--ict-": "no retrieval models",
    "--biencoder-": "no retrieval models",
    "--fim-": "no fill-in-the-middle data",
    "--inprocess-": "no in-process restart",
    "--one-logger": "no one-logger",
    "--otel-": "no OpenTelemetry export",
    "--straggler-": "no straggler detector",
    "--fault-injector-": "no fault injector",
    "--logits-": "no logit distillation",
    "--megatron-fsdp-": _FSDP,
    "--no-strict-fsdp-": _FSDP,
    "--disable-strict-fsdp-": _FSDP,
    "--fsdp-": _FSDP,
    "--torch-fsdp2-": _FSDP,
    "--moe-hybridep-": "no HybridEP",
    "--moe-deepep-": "no DeepEP",
    "--moe-flex-dispatcher-": "no flex dispatcher",
    "--moe-paged-stash": _OFFLOAD,
    "--moe-routing-trace-": "no routing traces",
    "--gtp-": "no generalized tensor parallelism",
    "--gdp-": "no Mamba or hybrid models",
    "--disable-mamba-": "no Mamba or hybrid models",
    "--no-dsa-": _ARCH,
    "--disable-dsa-": _ARCH,
    "--no-yarn-": _ARCH,
    "--mlp-chunks-for-": _ARCH,
    "--flight-recorder-": _RECORDER,
    "--no-flight-recorder-": _RECORDER,
    "--disable-flight-recorder-": _RECORDER,
    "--flash-decode": _INFERENCE,
    "--nccl-all-reduce-for-prefill": _INFERENCE,
    "--symmetric-ar-type": _INFERENCE,
}

_NOT_BUILT_BY_FLAG = {flag: why for why, flags in NOT_BUILT.items() for flag in flags}


def classify(flag: str) -> tuple[str, str] | None:
    """("no_effect" | "not_built", why) for a Megatron flag this table knows; None otherwise."""
    if flag in NO_EFFECT:
        return "no_effect", NO_EFFECT[flag][1]
    if flag in _NOT_BUILT_BY_FLAG:
        return "not_built", _NOT_BUILT_BY_FLAG[flag]
    for prefix, why in NOT_BUILT_PREFIXES.items():
        if flag.startswith(prefix) and flag not in FAMILY_FLAGS_BUILT:
            return "not_built", why
    return None
