"""Checks across the job config's sections: what the model, the loop or FP8 need of the layout.

Each `check_*` refuses a combination that can be told from the config alone, naming the keys
that do not fit together; `resolve_multimodal` fills the data's image keys from model.vision,
which owns them. `JobConfig` runs them all when it is built; `parallel/tensor.py` runs
`check_tensor_parallel` again for callers that shard a model directly.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.parallel import ParallelConfig

if TYPE_CHECKING:  # sections.py imports this module: TrainConfig is named in annotations only
    from meshtrain.services.dataloader.config import DataConfig
    from meshtrain.services.trainer.config.sections import OptimConfig, TrainConfig


def check_fp8(train: TrainConfig, parallel: ParallelConfig, model: ModelConfig) -> None:
    """What FP8 does not combine with (train.fp8's own values are checked by TrainConfig), and
    what train.fp8_experts needs: train.fp8 on and a model with MoE blocks."""
    if train.fp8_experts and train.fp8 is None:
        raise ConfigError(
            "train.fp8_experts puts the MoE expert GEMMs in FP8 alongside the dense layers: it "
            "needs train.fp8 set ('e4m3' or 'hybrid'; the experts run row-scaled e4m3 either way)"
        )
    if train.fp8_experts and model.num_experts is None:
        raise ConfigError(
            "train.fp8_experts converts the MoE blocks' expert GEMMs, but the model has none "
            "(model.num_experts unset): leave train.fp8_experts off"
        )
    if train.fp8 is None:
        return
    if parallel.tp_comm_overlap:
        raise ConfigError(
            "train.fp8 does not combine with parallel.tp_comm_overlap: its fused all-gather/"
            "reduce-scatter GEMMs are bf16; leave one off"
        )
    if parallel.pipeline_schedule == "zb-h1":
        raise ConfigError(
            "train.fp8 does not combine with parallel.pipeline_schedule='zb-h1' (the deferred "
            "weight gradients are bf16 GEMMs); use 1f1b or interleaved"
        )
    if train.cuda_graph and train.fp8_recipe == "delayed":
        raise ConfigError(
            "train.fp8_recipe='delayed' switches from current to historical scales after the first "
            "step, which a CUDA graph captured then would never see: use tensorwise with "
            "train.cuda_graph"
        )


def check_fully_sharded(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> None:
    """What fully sharded data parallelism (parallel.use_torch_fsdp2) composes with so far: plain
    data parallelism, tensor (and sequence) parallelism, hybrid sharding, context parallelism
    (parameters split over dp_shard x cp), mixtures of experts with or without expert
    parallelism (each block's experts split over the ranks holding them; under pp and cp too),
    FP8 linears (weights gathered in fp32, cast in each layer's forward; under cp too),
    activation recompute, pipeline parallelism
    with the gpipe, 1f1b, none and interleaved schedules, and train.compile (each block
    compiled, FSDP2's hooks between them). The rest is refused
    by name rather than run untested.

    Raises:
        ConfigError: naming the setting that does not compose with it.
    """
    p = parallel
    if not p.fully_sharded:
        return
    what = f"parallel.data_parallel_sharding_strategy={p.data_parallel_sharding_strategy!r}"
    refused = [
        (
            p.pp > 1 and p.resolved_pipeline_schedule(model.num_layers) == "zb-h1",
            "parallel.pipeline_schedule='zb-h1'",
            "the zero-bubble schedule's deferred weight gradients (use 1f1b, gpipe or interleaved)",
        ),
        (train.cuda_graph, "train.cuda_graph", "CUDA graphs"),
        (p.tp_comm_overlap, "parallel.tp_comm_overlap", "the fused tensor-parallel GEMMs"),
        (bool(train.bf16_weight_copies), "train.bf16_weight_copies", "bf16 weight copies"),
    ]
    for bad, key, name in refused:
        if bad:
            raise ConfigError(
                f"{what} (FSDP2) does not compose with {name} yet ({key}): leave it off, or use "
                "parallel.use_distributed_optimizer (ZeRO-1), which does"
            )


def check_optimizer_offload(
    optim: OptimConfig, parallel: ParallelConfig, train: TrainConfig
) -> None:
    """What optim.optimizer_cpu_offload composes with: one process, plain data parallelism,
    ZeRO-1 (each rank offloads its slice), tensor, pipeline, context and expert parallelism
    (the optimizer sees only this rank's parameters). The rest is refused by name, and what
    optim.offload_bf16_params's bf16 device parameters do not compose with.

    Raises:
        ConfigError: naming the setting that does not compose with it.
    """
    if not optim.optimizer_cpu_offload:
        return
    refused = [
        (
            parallel.fully_sharded,
            f"parallel.data_parallel_sharding_strategy="
            f"{parallel.data_parallel_sharding_strategy!r} (FSDP2)",
            "its optimizer runs on the DTensor shards FSDP2 owns; use "
            "parallel.use_distributed_optimizer (ZeRO-1), whose slices are offloaded",
        ),
        (
            train.fp8 is not None,
            "train.fp8",
            "the FP8 layers' scaling state is not tested with the offloaded update",
        ),
        (
            train.cuda_graph,
            "train.cuda_graph",
            "the captured step's gradients and parameters are not tested with the side-stream "
            "copies",
        ),
    ]
    for bad, key, why in refused:
        if bad:
            raise ConfigError(
                f"optim.optimizer_cpu_offload (--optimizer-cpu-offload) does not compose with "
                f"{key} yet: {why}; leave one off"
            )
    if not (optim.offload_bf16_params and train.bf16):
        return
    # bf16 device parameters: their gradients go into fp32 main_grads by a backward hook
    refused = [
        (
            parallel.pp > 1 and parallel.pipeline_schedule == "zb-h1",
            "parallel.pipeline_schedule='zb-h1'",
            "its deferred weight gradients are added outside autograd",
        ),
        (
            bool(train.bf16_weight_copies),
            "train.bf16_weight_copies",
            "the parameters are bf16 already",
        ),
        (
            bool(train.gradient_accumulation_fusion),
            "train.gradient_accumulation_fusion",
            "the GEMMs add into the fp32 parameters' .grad, which bf16 parameters do not have",
        ),
    ]
    for bad, key, why in refused:
        if bad:
            raise ConfigError(
                f"optim.offload_bf16_params (bf16 device parameters under "
                f"optim.optimizer_cpu_offload and train.bf16) does not compose with {key}: {why}; "
                "set optim.offload_bf16_params=false or leave it off"
            )


def check_experts(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> None:
    """What a mixture of experts needs of the layout and the loop (the layout's dp x cp, which
    ep must divide, is known once the world size is: `Mesh.build` checks that).

    Raises:
        ConfigError: naming the keys that do not fit together.
    """
    p, e = parallel, model.num_experts
    if e is None:
        if p.ep > 1:
            raise ConfigError(
                f"parallel.ep={p.ep} splits the experts of MoE layers, but model.num_experts is "
                "unset (a dense model): set model.num_experts or parallel.ep=1"
            )
        return
    if e % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} must divide model.num_experts={e} (each ep rank holds the same "
            "number of experts)"
        )
    if model.moe_expert_capacity_factor is not None and p.cp > 1:
        raise ConfigError(
            f"model.moe_expert_capacity_factor caps each expert's tokens per sequence, and with "
            f"parallel.cp={p.cp} a rank holds only chunks of each sequence: leave the factor unset "
            "(dropless) or parallel.cp=1"
        )
    if p.tp > 1:
        for key, width in (
            ("moe_ffn_hidden_size", model.moe_ffn_size),
            ("moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size),
        ):
            if width is not None and width % p.tp:
                raise ConfigError(
                    f"parallel.tp={p.tp} must divide model.{key}={width} (each expert's inner "
                    "width is split over the tensor-parallel ranks)"
                )
    if train.cuda_graph and (p.ep > 1 or not model.moe_grouped_gemm):
        # One grouped GEMM per projection takes the per-expert counts as device offsets, so a
        # block with every expert on this GPU runs without a host synchronization; the loop over
        # the experts and the token exchange's all-to-all need the counts on the host.
        why = (
            f"parallel.ep={p.ep}: the token exchange needs the per-expert counts on the host"
            if p.ep > 1
            else "model.moe_grouped_gemm=false: the loop over the experts needs the per-expert "
            "counts on the host"
        )
        raise ConfigError(
            f"train.cuda_graph captures a mixture of experts only with model.moe_grouped_gemm=true "
            f"and parallel.ep=1 (its counts then stay on the GPU); here {why}. Set those or leave "
            "train.cuda_graph off"
        )


def check_expert_fusion(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> None:
    """What train.expert_gradient_accumulation_fusion needs: a MoE model on grouped GEMMs, the
    bf16 weight copies (so a single process: several data-parallel ranks are refused when the
    copies are built, once the world size is known) and no CUDA graph.

    Raises:
        ConfigError: naming the key that refuses it.
    """
    if not train.expert_gradient_accumulation_fusion:
        return
    layout = {k: getattr(parallel, k) for k in ("tp", "cp", "pp", "ep")}
    refused = [
        (
            model.num_experts is None,
            "model.num_experts unset (a dense model): there are no expert weights",
        ),
        (
            not model.moe_grouped_gemm,
            "model.moe_grouped_gemm=false: it replaces the grouped GEMMs' weight gradient",
        ),
        (
            not train.bf16 or train.bf16_weight_copies is False,
            "train.bf16 off or train.bf16_weight_copies=false: it adds into the fp32 gradients "
            "beside the bf16 weight copies",
        ),
        (
            any(v > 1 for v in layout.values()),
            f"parallel {layout}: the bf16 weight copies run in a single process",
        ),
        (
            train.cuda_graph,
            "train.cuda_graph: its backward reads the per-expert counts on the host, which a "
            "CUDA graph cannot capture",
        ),
    ]
    for bad, why in refused:
        if bad:
            raise ConfigError(
                f"train.expert_gradient_accumulation_fusion cannot run with {why}; set those or "
                "leave it off"
            )


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
        raise ConfigError(
            "context parallelism has no per-rank dropout RNG: set model.attention_dropout=0 and "
            "model.hidden_dropout=0 with parallel.cp > 1"
        )
    if model.attention_backend in ("cudnn", "efficient"):
        raise ConfigError(
            f"with parallel.cp > 1 attention runs blockwise on the flash kernel (or 'math', the "
            f"reference); model.attention_backend={model.attention_backend!r} is not used there"
        )
    split = 2 * p.cp * (p.tp if p.sequence_parallel else 1)
    if model.seq_length % split:
        what = f"2 x cp x tp = {split}" if p.sequence_parallel else f"2 x cp = {split}"
        raise ConfigError(
            f"context parallelism cuts each sequence into 2 x cp chunks: model.seq_length="
            f"{model.seq_length} must be a multiple of {what}"
        )
    a2a = p.cp_a2a_size
    if a2a > 1:
        heads, kv = model.num_attention_heads // p.tp, model.groups // p.tp
        if heads % a2a:
            raise ConfigError(
                f"parallel.cp_comm_type={p.cp_comm_type!r} splits the attention heads over {a2a} "
                f"ranks: {heads} heads per tensor-parallel rank are not a multiple of {a2a}"
            )
        if kv % a2a and a2a % kv:
            raise ConfigError(
                f"parallel.cp_comm_type={p.cp_comm_type!r} over {a2a} ranks: {kv} key/value heads "
                f"per tensor-parallel rank neither split over {a2a} ranks nor repeat evenly to them"
            )


def check_vision(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> None:
    """What a vision-language model (model.vision) needs of the layout and the freeze keys.

    Raises:
        ConfigError: a freeze key for a part the model lacks, every part frozen, context
            parallelism or CUDA graphs with images, or tensor parallelism the encoder's shapes
            do not fit.
    """
    v = model.vision
    if v is None:
        for key in ("freeze_vision", "freeze_projector"):
            if getattr(train, key):
                raise ConfigError(f"train.{key} freezes a part of model.vision, which is unset")
        if train.freeze_language_model:
            raise ConfigError(
                "train.freeze_language_model leaves a text-only model nothing to train"
            )
        return
    if train.freeze_vision and train.freeze_projector and train.freeze_language_model:
        raise ConfigError(
            "train.freeze_vision, train.freeze_projector and train.freeze_language_model freeze "
            "the whole model: leave at least one part to train"
        )
    if train.cuda_graph:
        raise ConfigError(
            "train.cuda_graph captures fixed-shape inputs; with model.vision the number of images "
            "changes from one micro-batch to the next: leave it off"
        )
    if parallel.cp > 1:
        raise ConfigError(
            f"model.vision with parallel.cp={parallel.cp}: image features take the place of "
            "placeholders anywhere in the sequence, which context parallelism splits; use cp=1"
        )
    tp = parallel.tp
    if v.num_attention_heads % tp or v.ffn_hidden_size % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide model.vision.num_attention_heads="
            f"{v.num_attention_heads} and model.vision.ffn_hidden_size={v.ffn_hidden_size}"
        )


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
            f"parallel.tp={tp} must divide model.num_attention_heads={model.num_attention_heads} "
            f"and the number of query groups ({model.groups}); replicating KV heads across tp "
            "ranks is not supported"
        )
    if model.ffn_size % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide the MLP width {model.ffn_size} (model.ffn_hidden_size)"
        )
    if sequence_parallel and model.seq_length % tp:
        raise ConfigError(
            f"sequence parallelism: parallel.tp={tp} must divide "
            f"model.seq_length={model.seq_length}"
        )
    if model.attention_dropout > 0 or (sequence_parallel and model.hidden_dropout > 0):
        raise ConfigError(
            "dropout inside tensor-parallel regions needs a per-rank RNG tracker, which is not "
            "built: set model.attention_dropout=0 (and model.hidden_dropout=0 with sequence "
            "parallelism)"
        )


def check_documents(data: DataConfig, parallel: ParallelConfig, train: TrainConfig) -> None:
    """What packed-document attention and positions (data.reset_attention_mask,
    data.reset_position_ids) do not combine with: the data service under context parallelism,
    which sends a rank only its chunks (the EODs before them unseen); a CUDA graph, which cannot
    take each micro-batch's FlexAttention block mask as a static input. Every
    parallel.cp_comm_type attends within documents.

    Raises:
        ConfigError: naming the settings.
    """
    keys = [
        k
        for k, on in (
            ("data.reset_attention_mask", data.reset_attention_mask),
            ("data.reset_position_ids", data.reset_position_ids),
        )
        if on
    ]
    if not keys:
        return
    p = parallel
    if p.cp > 1 and data.service_addresses:
        raise ConfigError(
            f"{' and '.join(keys)} with parallel.cp={p.cp} need the whole sample to find the "
            "documents, but data.service_addresses sends a context-parallel rank only its "
            "chunks: read the data in-process (no data.service_addresses) or set parallel.cp=1"
        )
    if data.reset_attention_mask and train.cuda_graph:
        raise ConfigError(
            "train.cuda_graph replays one captured micro-batch, but data.reset_attention_mask "
            "builds each micro-batch's FlexAttention block mask from its document ids (its "
            "sparsity differs from batch to batch): turn one of them off"
        )


def resolve_multimodal(model: ModelConfig, data: DataConfig) -> DataConfig:
    """The data section with its image keys agreeing with model.vision, which owns them.

    data.format = 'multimodal' needs model.vision. data.image_size, data.tokens_per_image and
    data.image_token_id default to the model's (model.vision.image_size, the encoder's output
    length, model.vision.image_token_id); given, they must equal them. data.image_normalization
    defaults to the variant's statistics (clip: CLIP's, siglip: 0.5/0.5) and, given, is used as
    it is. (ModelConfig refuses a placeholder past model.vocab_size; unset, the vocabulary is
    the tokenizer's grown to cover it.) Text-only data with model.vision is allowed: its
    samples have no images, and the encoder is not run.

    Raises:
        ConfigError: naming the data key and the model key that disagree.
    """
    v = model.vision
    if data.format != "multimodal":
        return data
    if v is None:
        raise ConfigError(
            "data.format='multimodal' serves images, and model.vision is unset: configure the "
            "vision encoder ([model.vision]) or read text-only data"
        )
    wanted = {
        "image_size": ("model.vision.image_size", v.image_size),
        "tokens_per_image": (
            "the encoder's output length ((model.vision.image_size / model.vision.patch_size)^2"
            + (" + 1 for the class token" if v.select_feature == "cls_patch" else "")
            + ")",
            v.tokens_per_image,
        ),
        "image_token_id": ("model.vision.image_token_id", v.image_token_id),
    }
    resolved: dict[str, object] = {}
    for key, (owner, value) in wanted.items():
        given = getattr(data, key)
        if given is not None and given != value:
            raise ConfigError(
                f"data.{key}={given} does not match {owner}={value}: the data makes what the "
                f"model reads; leave data.{key} unset (it follows the model) or make them equal"
            )
        resolved[key] = value
    if data.image_normalization is None:
        resolved["image_normalization"] = v.variant  # the variants and statistics share names
    return dataclasses.replace(data, **resolved)  # type: ignore[arg-type]
