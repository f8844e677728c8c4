"""The model's architecture config, shared by the trainer and the checkpoint service.

The trainer builds its GPT from a `ModelConfig`; the checkpoint service's Hugging Face import and
export and `ckpt convert` read and write the same settings, so the config lives below both (the
services never import the trainer). It is the `model` section of the trainer's job config
(`meshtrain.services.trainer.config.sections.JobConfig`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from meshtrain.services.common.errors import ConfigError, NotBuiltError


@dataclass
class VisionConfig:
    """A vision encoder (ViT) and the projector that maps its features into the language model's
    embedding space (LLaVA): the `model.vision` section. Unset, the model is text-only.

    CLIP-style: a class token, a LayerNorm before the blocks (`pre_layrnorm`), a bias-free patch
    convolution, quick-GELU. SigLIP-style: no class token, no pre-norm, a patch convolution with
    a bias, tanh-approximate GELU. Both: pre-norm bidirectional blocks with LayerNorm.
    """

    variant: Literal["clip", "siglip"] = "clip"
    """The encoder's style (see above)."""
    image_size: int = 224
    """Side of the square images the position table was made for; other sizes (a multiple of
    patch_size) interpolate it bicubically."""
    patch_size: int = 14
    """Side of each square patch (the patch convolution's kernel and stride)."""
    hidden_size: int = 1024
    """The encoder's width."""
    num_layers: int = 24
    """The encoder's blocks (all stored; those past select_layer are never run)."""
    num_attention_heads: int = 16
    """The encoder's attention heads."""
    ffn_hidden_size: int = 4096
    """The encoder's MLP inner width."""
    norm_epsilon: float = 1e-5
    """Epsilon of the encoder's LayerNorms (CLIP: 1e-5, SigLIP: 1e-6)."""
    select_layer: int = -2
    """Whose output the projector reads: k >= 0 is the output of k blocks (0: the embeddings),
    negative counts from the last (-1: the last block's output, -2: the one before, as
    LLaVA-1.5). Hugging Face's vision_feature_layer."""
    select_feature: Literal["patch", "cls_patch"] = "patch"
    """Which of the selected tokens become image features: the patches only (LLaVA's 'default'),
    or the class token and the patches ('full'; CLIP only)."""
    projector: Literal["mlp2x_gelu", "linear"] = "mlp2x_gelu"
    """The projector: LLaVA-1.5's Linear-GELU-Linear, or one Linear (LLaVA-1)."""
    projector_bias: bool = True
    """Biases in the projector's linear layers."""
    image_token_id: int = 0
    """The placeholder token id: each image's features replace exactly tokens_per_image copies of
    it in the sequence (the data expands them)."""

    def __post_init__(self) -> None:
        for key in ("image_size", "patch_size", "hidden_size", "num_layers"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.vision.{key} must be positive, got {getattr(self, key)}")
        for key in ("num_attention_heads", "ffn_hidden_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.vision.{key} must be positive, got {getattr(self, key)}")
        if self.image_size % self.patch_size:
            raise ConfigError(
                f"model.vision.image_size={self.image_size} must be a multiple of "
                f"model.vision.patch_size={self.patch_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.vision.hidden_size={self.hidden_size} must be divisible by "
                f"model.vision.num_attention_heads={self.num_attention_heads}"
            )
        if not -(self.num_layers + 1) <= self.select_layer <= self.num_layers:
            raise ConfigError(
                f"model.vision.select_layer={self.select_layer} is outside "
                f"[-{self.num_layers + 1}, {self.num_layers}] (model.vision.num_layers="
                f"{self.num_layers})"
            )
        if self.select_feature == "cls_patch" and self.variant != "clip":
            raise ConfigError(
                "model.vision.select_feature='cls_patch' keeps the class token, which only the "
                f"'clip' variant has (model.vision.variant={self.variant!r})"
            )
        if not 0 <= self.norm_epsilon < math.inf:
            raise ConfigError(f"model.vision.norm_epsilon must be >= 0, got {self.norm_epsilon}")
        if self.image_token_id < 0:
            raise ConfigError(
                f"model.vision.image_token_id={self.image_token_id} is not a token id (>= 0)"
            )

    @property
    def grid(self) -> int:
        """Patches along each side of an image_size image."""
        return self.image_size // self.patch_size

    @property
    def class_token(self) -> bool:
        """Whether the encoder prepends a class token (CLIP)."""
        return self.variant == "clip"

    @property
    def layers_run(self) -> int:
        """Blocks the encoder runs to reach select_layer."""
        return self.select_layer % (self.num_layers + 1)

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and features) per image_size image."""
        return self.grid**2 + (self.select_feature == "cls_patch")


@dataclass
class ModelConfig:
    """Architecture of the GPT family (GPT-2 style and Llama style are both settings of it)."""

    num_layers: int = 2
    """Number of transformer blocks."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_attention_heads: int = 4
    """Query heads per attention layer."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; unset means one per query head (MHA)."""
    kv_channels: int | None = None
    """Width of each attention head (--kv-channels); unset: hidden_size / num_attention_heads. Set,
    the heads need not tile the hidden size (Qwen3: 128-wide heads with hidden_size 1024 and 16
    heads)."""
    qkv_bias: bool = False
    """Biases on the query/key/value projection alone (--add-qkv-bias; Qwen2), where
    add_bias_linear is off; with add_bias_linear on, every linear layer has one already."""
    qk_norm: bool = False
    """Normalize each query and key head over its width before RoPE (--qk-layernorm; Qwen3), with
    the model's normalization and a learned (head_dim,) weight per layer shared by the heads."""
    ffn_hidden_size: int | None = None
    """MLP inner width; unset: 4*hidden for GELU, 8/3*hidden rounded down to 64 for SwiGLU
    (Megatron-LM's rule for --swiglu, so the same flags build the same shapes)."""
    seq_length: int = 256
    """Tokens per training sample."""
    max_position_embeddings: int | None = None
    """Learned positions: rows of the position table. RoPE: the context the weights were made for,
    written as Hugging Face's max_position_embeddings on export (an import at a shorter seq_length
    keeps the model's own here). Unset: seq_length."""
    vocab_size: int | None = None
    """Vocabulary size; unset: taken from the tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding/output rows to a multiple of this (padding never reaches the loss)."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """LayerNorm (GPT-2) or RMSNorm (Llama)."""
    norm_epsilon: float = 1e-5
    """Epsilon inside the normalization."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP activation: GELU (GPT-2) or SwiGLU with fused gate/up projection (Llama)."""
    position_embedding_type: Literal["learned", "rope"] = "learned"
    """Learned absolute positions (GPT-2) or rotary embeddings (Llama)."""
    rotary_base: float = 10000.0
    """RoPE base frequency."""
    rope_scaling_factor: float | None = None
    """Llama 3 RoPE scaling (--use-rope-scaling, --rope-scaling-factor): frequencies whose
    wavelength exceeds original_max_positions / low_freq_factor are divided by this factor, those
    shorter than original_max_positions / high_freq_factor kept, those between blended smoothly;
    unset: plain RoPE. Llama 3.1/3.3: 8, Llama 3.2: 32."""
    rope_scaling_low_freq_factor: float = 1.0
    """Llama 3 RoPE scaling: the long-wavelength bound is original_max_positions / this."""
    rope_scaling_high_freq_factor: float = 4.0
    """Llama 3 RoPE scaling: the short-wavelength bound is original_max_positions / this (greater
    than rope_scaling_low_freq_factor)."""
    rope_scaling_original_max_positions: int = 8192
    """Llama 3 RoPE scaling: the context length the model was first trained at."""
    add_bias_linear: bool = True
    """Biases in the linear layers (GPT-2: true, Llama: false)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output projection instead of reusing the word embedding (Llama: true)."""
    reward_head: bool = False
    """A scalar head (`score.weight`, a bias-free hidden -> 1 linear, TRL's and Hugging Face's
    `score`) on the final-norm hidden states: a reward model (set by train.objective='reward').
    The LM output projection is kept, frozen, so LM checkpoints load into it."""
    init_method_std: float = 0.02
    """Std of the normal init; residual output projections use std/sqrt(2*num_layers)."""
    hidden_dropout: float = 0.0
    """Dropout on the residual branches."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA backend of the attention core: 'auto' lets PyTorch pick; the others pin one (and
    fail where it cannot run the shape). Backends without native grouped-query support get
    the key/value heads expanded. See benchmarks/attention_backends.py for the trade."""
    fp32_residual_connection: bool = False
    """Under train.bf16, keep the residual stream (embedding output, block sums, their gradients)
    in fp32, as plain autocast does. Off (the default, as in Megatron-LM) it is stored in bf16,
    computed in fp32: half the bytes read and written, faster at the same loss curve (measured:
    BENCHMARKS.md, 'Training throughput, one GPU'). Without autocast: no effect."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer backend: meshtrain's own layers, or Transformer Engine (not built)."""
    num_experts: int | None = None
    """Experts per mixture-of-experts layer (--num-experts); unset: every feed-forward block is
    dense."""
    moe_layer_freq: int | list[int] = 1
    """Which blocks are MoE (--moe-layer-freq): an int k makes every k-th block MoE (blocks 0, k,
    2k, ...); a list of num_layers 0/1 entries names them one by one (1: MoE)."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's inner width (--moe-ffn-hidden-size); unset: model.ffn_size."""
    moe_router_topk: int = 2
    """Experts each token is routed to (--moe-router-topk)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts (Mixtral, Qwen-MoE) or a sigmoid per expert
    (DeepSeek-V3; the chosen scores are renormalized to sum to 1 when topk > 1)."""
    moe_router_pre_softmax: bool = False
    """Softmax: over all experts before the top-k (Qwen-MoE: weights need not sum to 1); off, the
    top-k logits are softmaxed among themselves (Mixtral: weights sum to 1)."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiply the routing weights by this (DeepSeek-V3's routed_scaling_factor); unset: 1."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient (Switch/GShard form: E * sum_i f_i * P_i, with f_i the
    share of routed tokens and P_i the mean score of expert i over the global batch)."""
    moe_z_loss_coeff: float | None = None
    """Router z-loss coefficient (mean squared logsumexp of the router logits); unset: none."""
    moe_expert_capacity_factor: float | None = None
    """Unset: dropless (every routed token is computed). Set: each expert takes at most
    ceil(factor * tokens * topk / experts) tokens per micro-batch and rank; the rest are dropped
    by moe_token_drop_policy (their residual passes through)."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Under a capacity: an expert keeps its highest-scored tokens (probs) or its earliest
    (position)."""
    moe_router_enable_expert_bias: bool = False
    """Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the scores for
    choosing experts only, moved by moe_router_bias_update_rate after every optimizer step
    toward balance (up for experts under their mean load, down for those over)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update (--moe-router-bias-update-rate)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token also passes through (Qwen-MoE, DeepSeek);
    unset: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w) of a learned (1, hidden) gate
    (Qwen2-MoE)."""
    moe_grouped_gemm: bool = True
    """Experts as grouped GEMMs (torch._grouped_mm on CUDA bf16 where the device supports it);
    off, or where it cannot run, a loop over the experts computes the same."""
    vision: VisionConfig | None = None
    """A vision encoder and projector in front of the language model (`[model.vision]`: a
    LLaVA-style vision-language model); unset: text-only."""
    hf_model_type: (
        Literal["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "gpt2", "llava"]
        | None
    ) = None
    """The Hugging Face model_type the weights were imported from (`ckpt import --format hf`
    sets it and the model.hf_* keys below; a resume that leaves them unset takes them from the
    checkpoint). `ckpt export` writes this architecture again unless --architecture names
    another, or the settings no longer fit it (then the one they name, with a warning). Unset:
    the architecture the settings name (a Llama-shaped model exports as Llama)."""
    hf_bos_token_id: int | None = None
    """The imported config.json's bos_token_id, written back by the export while the run's
    tokenizer is the imported one (model.hf_tokenizer_sha256); another tokenizer gets its own
    end-of-document id. Unset with model.hf_model_type set: the imported config had none."""
    hf_eos_token_id: int | list[int] | None = None
    """The imported config.json's eos_token_id (one id or a list), kept as
    model.hf_bos_token_id is."""
    hf_pad_token_id: int | None = None
    """The imported config.json's pad_token_id, kept as model.hf_bos_token_id is."""
    hf_tokenizer_sha256: str | None = None
    """sha256 of the tokenizer.json imported with the model: the tokenizer the model.hf_*_token_id
    keys belong to. Unset: the import had no tokenizer.json, and the ids are kept whatever the
    run's tokenizer."""
    hf_sliding_window: int | None = None
    """Mistral's and Mixtral's sliding_window, written back by the export. meshtrain attends to
    the whole sequence, which the window then covers: it must be at least seq_length (unset it
    to train longer sequences; the export then has no window)."""
    hf_torch_dtype: Literal["float32", "float16", "bfloat16"] | None = None
    """The imported weights' dtype. The export writes the checkpoint's own (training keeps fp32
    weights) and says so where it differs; `meshtrain ckpt convert --dtype` casts back first."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.kv_channels is not None and self.kv_channels <= 0:
            raise ConfigError(
                f"model.kv_channels must be positive (unset: hidden_size / num_attention_heads), "
                f"got {self.kv_channels}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} must be divisible by "
                f"model.num_attention_heads={self.num_attention_heads} (or set model.kv_channels)"
            )
        if self.num_query_groups is not None and self.num_query_groups <= 0:  # 0 read as unset: MHA
            raise ConfigError(
                f"model.num_query_groups must be positive (unset for one per head), "
                f"got {self.num_query_groups}"
            )
        if self.make_vocab_size_divisible_by <= 0:
            raise ConfigError(
                f"model.make_vocab_size_divisible_by must be positive, "
                f"got {self.make_vocab_size_divisible_by}"
            )
        groups = self.groups
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"model.num_query_groups={self.num_query_groups} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.ffn_size <= 0:
            raise ConfigError(
                f"model.ffn_hidden_size must be positive, got {self.ffn_size}"
                + (
                    ""
                    if self.ffn_hidden_size is not None
                    else f" (8/3 of hidden_size={self.hidden_size}, rounded down to 64: set it)"
                )
            )
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ConfigError(f"model: RoPE needs an even head dim, got {self.head_dim}")
        if (
            self.max_position_embeddings is not None
            and self.max_position_embeddings < self.seq_length
        ):
            raise ConfigError(
                f"model.max_position_embeddings={self.max_position_embeddings} is shorter than "
                f"model.seq_length={self.seq_length}"
            )
        # Ranges the layers and torch's AdamW enforce only once the model is built (a traceback
        # after the data is ready), or not at all (a rotary base <= 0 trains on NaN).
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(
                    f"model.{key} is a probability: it must be in [0, 1], got {getattr(self, key)}"
                )
        if not 0 <= self.init_method_std < math.inf:
            raise ConfigError(f"model.init_method_std must be >= 0, got {self.init_method_std}")
        if not 0 < self.rotary_base < math.inf:
            raise ConfigError(f"model.rotary_base must be positive, got {self.rotary_base}")
        if not 0 <= self.norm_epsilon < math.inf:
            raise ConfigError(f"model.norm_epsilon must be >= 0, got {self.norm_epsilon}")
        self._check_rope_scaling()
        self._check_moe()
        self._check_hf()
        if self.vision is not None and self.vocab_size is not None:
            if self.vision.image_token_id >= self.vocab_size:
                raise ConfigError(
                    f"model.vision.image_token_id={self.vision.image_token_id} is outside the "
                    f"vocabulary of {self.vocab_size} tokens"
                )
        if self.transformer_impl != "local":
            raise NotBuiltError(
                "model.transformer_impl='transformer_engine' is not built yet (Transformer Engine "
                "layers are not wired in); use 'local'"
            )

    def _check_rope_scaling(self) -> None:
        factor = self.rope_scaling_factor
        if factor is None:
            return
        if self.position_embedding_type != "rope":
            raise ConfigError(
                "model.rope_scaling_factor scales RoPE: it needs "
                "model.position_embedding_type='rope'"
            )
        if not 1 <= factor < math.inf:
            raise ConfigError(
                f"model.rope_scaling_factor must be >= 1 (unset: plain RoPE), got {factor}"
            )
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        if not 0 < low < high < math.inf:
            raise ConfigError(
                f"model.rope_scaling_low_freq_factor={low} and model.rope_scaling_high_freq_factor="
                f"{high} must satisfy 0 < low < high"
            )
        if self.rope_scaling_original_max_positions <= 0:
            raise ConfigError(
                f"model.rope_scaling_original_max_positions must be positive, "
                f"got {self.rope_scaling_original_max_positions}"
            )

    def _check_moe(self) -> None:
        if self.num_experts is None:
            return
        if self.num_experts <= 0:
            raise ConfigError(
                f"model.num_experts must be positive (unset: dense), got {self.num_experts}"
            )
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ConfigError(
                f"model.moe_router_topk={self.moe_router_topk} must be in [1, "
                f"model.num_experts={self.num_experts}]"
            )
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq <= 0:
                raise ConfigError(f"model.moe_layer_freq must be positive, got {freq}")
        elif len(freq) != self.num_layers or any(v not in (0, 1) for v in freq):
            raise ConfigError(
                f"model.moe_layer_freq as a list needs num_layers={self.num_layers} entries of 0 "
                f"or 1, got {freq}"
            )
        for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            v = getattr(self, key)
            if v is not None and v <= 0:
                raise ConfigError(f"model.{key} must be positive, got {v}")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError(
                "model.moe_shared_expert_gate gates the shared expert: it needs "
                "model.moe_shared_expert_intermediate_size"
            )
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
            v = getattr(self, key)
            if v is not None and not 0 <= v < math.inf:
                raise ConfigError(f"model.{key} must be >= 0, got {v}")
        cf = self.moe_expert_capacity_factor
        if cf is not None and not 0 < cf < math.inf:
            raise ConfigError(
                f"model.moe_expert_capacity_factor must be positive (unset: dropless), got {cf}"
            )
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise ConfigError(
                "model.moe_router_pre_softmax applies to the softmax score function only"
            )

    def _check_hf(self) -> None:
        ids = {
            "hf_bos_token_id": self.hf_bos_token_id,
            "hf_eos_token_id": self.hf_eos_token_id,
            "hf_pad_token_id": self.hf_pad_token_id,
        }
        for key, value in ids.items():
            values = value if isinstance(value, list) else [] if value is None else [value]
            if any(v < 0 for v in values):
                raise ConfigError(f"model.{key}={value} is not a token id (ids are >= 0)")
        window = self.hf_sliding_window
        if window is not None and window < self.seq_length:
            raise ConfigError(
                f"model.hf_sliding_window={window} is shorter than model.seq_length="
                f"{self.seq_length}: meshtrain attends to the whole sequence, which an exported "
                "model with this window would mask; unset model.hf_sliding_window to train longer "
                "sequences (the export then has no window)"
            )
        if self.hf_tokenizer_sha256 is not None and not re.fullmatch(
            "[0-9a-f]{64}", self.hf_tokenizer_sha256
        ):
            raise ConfigError(
                f"model.hf_tokenizer_sha256={self.hf_tokenizer_sha256!r} is not a sha256 digest "
                "(64 lowercase hex digits)"
            )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global block `layer` has a mixture of experts instead of the dense MLP."""
        if self.num_experts is None:
            return False
        freq = self.moe_layer_freq
        return layer % freq == 0 if isinstance(freq, int) else bool(freq[layer])

    @property
    def moe_ffn_size(self) -> int:
        """Each expert's inner width."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    @property
    def head_dim(self) -> int:
        """Width of each attention head (kv_channels, or hidden_size / num_attention_heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def groups(self) -> int:
        """Key/value heads (num_query_groups, or num_attention_heads for plain MHA)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 8 * self.hidden_size // 3 // 64 * 64
        return 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self) -> int:
        assert self.vocab_size is not None, "vocab_size is resolved from the tokenizer first"
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m
