"""The vision side of a LLaVA-style model on one device: a ViT encoder, the projector, the merge.

`VisionEncoder` turns images (n, 3, H, W) into the features of one of its layers
(`model.vision.select_layer`), CLIP-style (class token, pre-LayerNorm, quick-GELU) or
SigLIP-style (no class token, no pre-norm, tanh GELU); its learned position table is
interpolated bicubically for images of another size. `Projector` maps those features to the
language model's width (LLaVA-1.5's Linear-GELU-Linear, or one Linear). `merge_image_features`
puts them in place of the image placeholder tokens' embeddings, image after image in reading
order. `GPT` builds the two modules when `ModelConfig.vision` is set (parameter names
`vision.*`, `projector.*`), and `freeze` marks the parts a training stage leaves alone.

    encoder = VisionEncoder(config.vision)
    feats = Projector(config)(encoder(images))       # (n_images, tokens_per_image, hidden)
    x = merge_image_features(embeds, tokens, feats, config.vision.image_token_id)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from meshtrain.services.common.model_config import ModelConfig, VisionConfig


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention; `qkv` holds [q_h; k_h; v_h] per head (rows), the
    order a tensor-parallel split by heads keeps whole."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads  # this rank's (tensor parallelism divides it)
        self.head_dim = h // config.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, tokens, hidden) -> (n, tokens, hidden)."""
        n, t, _ = x.shape
        qkv = self.qkv(x).view(n, t, self.heads, 3, self.head_dim)  # (n, t, heads, 3, d)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (n, heads, t, d)
        y = F.scaled_dot_product_attention(q, k, v)  # (n, heads, t, d)
        return self.proj(y.transpose(1, 2).reshape(n, t, self.heads * self.head_dim))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's GELU approximation, x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


class VisionMLP(nn.Module):
    """fc1 -> GELU (quick for CLIP, tanh for SigLIP) -> fc2."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)
        self.clip = config.variant == "clip"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (n, t, ffn)
        h = quick_gelu(h) if self.clip else F.gelu(h, approximate="tanh")
        return self.fc2(h)


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.input_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)
        self.attention = VisionAttention(config)
        self.pre_mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x))
        return x + self.mlp(self.pre_mlp_norm(x))


class VisionEncoder(nn.Module):
    """ViT: patch convolution, class token (CLIP), learned positions, pre-norm (CLIP), blocks.

    `forward` returns the features the projector reads: the output of `config.layers_run`
    blocks, class token dropped unless `select_feature='cls_patch'`. Blocks past those and the
    final `post_norm` are kept (checkpoints and Hugging Face exports hold the whole tower) but
    never run; `freeze` marks them untrained.
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        p = config.patch_size
        self.patch_embedding = nn.Conv2d(3, h, p, stride=p, bias=config.variant == "siglip")
        self.class_embedding = nn.Parameter(torch.zeros(h)) if config.class_token else None
        positions = config.grid**2 + int(config.class_token)
        self.position_embeddings = nn.Embedding(positions, h)
        self.pre_norm = (
            nn.LayerNorm(h, eps=config.norm_epsilon) if config.variant == "clip" else None
        )
        self.layers = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        # The tower's final LayerNorm: LLaVA's features (hidden states) never pass through it,
        # but pretrained towers have one, kept so an export writes it back (never trained).
        self.post_norm = nn.LayerNorm(h, eps=config.norm_epsilon)
        self.recompute = False  # set by parallel.recompute.apply: each block recomputed

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """(tokens, hidden) position embeddings for a rows x cols patch grid: the stored table,
        or its patch part resized bicubically (the class token's row kept)."""
        table = self.position_embeddings.weight
        grid = self.config.grid
        if (rows, cols) == (grid, grid):
            return table
        cls, patches = table[: int(self.config.class_token)], table[int(self.config.class_token) :]
        square = patches.reshape(1, grid, grid, -1).permute(0, 3, 1, 2)  # (1, hidden, grid, grid)
        resized = F.interpolate(square, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat([cls, resized.permute(0, 2, 3, 1).reshape(rows * cols, -1)])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (n, 3, H, W), H and W multiples of patch_size -> (n, tokens, hidden) features."""
        p = self.config.patch_size
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[2] % p or images.shape[3] % p:
            raise ValueError(
                f"images must be (n, 3, H, W) with H and W multiples of model.vision.patch_size="
                f"{p}, got {tuple(images.shape)}"
            )
        weight = self.patch_embedding.weight
        x = self.patch_embedding(images.to(weight.dtype))  # (n, hidden, rows, cols)
        rows, cols = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)  # (n, rows*cols, hidden)
        if self.class_embedding is not None:
            cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)  # (n, 1 + rows*cols, hidden)
        x = x + self.positions(rows, cols).to(x.dtype)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        for layer in self.layers[: self.config.layers_run]:
            if self.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        if self.class_embedding is not None and self.config.select_feature == "patch":
            x = x[:, 1:]  # (n, rows*cols, hidden)
        return x


class Projector(nn.Module):
    """Vision features -> the language model's width: fc1 (and GELU, fc2 for mlp2x_gelu)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.vision is not None
        v, h = config.vision, config.hidden_size
        self.fc1 = nn.Linear(v.hidden_size, h, bias=v.projector_bias)
        self.fc2 = nn.Linear(h, h, bias=v.projector_bias) if v.projector == "mlp2x_gelu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, tokens, vision hidden) -> (n, tokens, hidden)."""
        x = self.fc1(x)
        if self.fc2 is None:
            return x
        return self.fc2(F.gelu(x))


def merge_image_features(
    embeds: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, image_token_id: int
) -> torch.Tensor:
    """The token embeddings with each placeholder's replaced by the next image feature.

    Args:
        embeds: (batch, seq, hidden) token embeddings.
        tokens: (batch, seq) token ids.
        features: (n_images, tokens_per_image, hidden), in the placeholders' reading order
            (sample by sample, left to right).
        image_token_id: the placeholder id.

    Raises:
        ValueError: the placeholders are not n_images x tokens_per_image (CPU tensors; on CUDA
            a device-side assertion, checked without a host sync).
    """
    mask = tokens == image_token_id  # (batch, seq)
    want = features.shape[0] * features.shape[1]
    if tokens.is_cuda:
        # counted on the device: reading the count back would stall every micro-batch (and
        # break a compiled graph); the trainer checks its batches on the host before the upload
        torch._assert_async(mask.sum() == want, "image placeholders != image tokens")
    elif (have := int(mask.sum())) != want:
        raise ValueError(
            f"the micro-batch has {have} image placeholder tokens (id {image_token_id}) for "
            f"{features.shape[0]} images of {features.shape[1]} tokens each ({want})"
        )
    flat = features.reshape(-1, features.shape[-1]).to(embeds.dtype)  # (n*tokens, hidden)
    return embeds.masked_scatter(mask.unsqueeze(-1), flat)


def freeze(
    model: nn.Module, vision: bool = False, projector: bool = False, language_model: bool = False
) -> int:
    """Mark the parts of a (possibly sharded or pipelined) model that training leaves alone:
    requires_grad off, so the optimizer, the gradient reduction and the gradient norm skip them.
    The encoder blocks past `select_layer` and its post-norm never run and are always frozen.
    Returns the number of parameters (tensors) frozen."""
    config = getattr(model, "config", None)
    run = config.vision.layers_run if config is not None and config.vision is not None else None
    frozen = 0
    for name, p in model.named_parameters():
        part = name.split(".", 1)[0]
        stop = {"vision": vision, "projector": projector}.get(part, language_model)
        if part == "vision" and name.startswith("vision.layers.") and run is not None:
            stop = stop or int(name.split(".")[2]) >= run
        stop = stop or name.startswith("vision.post_norm.")
        if stop and p.requires_grad:
            p.requires_grad_(False)
            frozen += 1
    return frozen


def image_features(
    encoder: VisionEncoder, projector: Projector, images: torch.Tensor
) -> torch.Tensor:
    """images (n, 3, H, W) -> (n, tokens_per_image, hidden): encoder then projector. A frozen
    encoder runs without autograd (nothing of it is kept for a backward)."""
    trains = any(p.requires_grad for p in encoder.parameters())
    with torch.set_grad_enabled(torch.is_grad_enabled() and trains):
        x = encoder(images)
    return projector(x)
