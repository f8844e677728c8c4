"""A plain-PyTorch LLaVA-style model, written independently of meshtrain, as the vision speed
baseline.

A ViT (patch convolution, class token, learned positions, pre-norm for CLIP, SDPA attention,
quick-GELU or tanh-GELU MLP) cut at the layer the projector reads, the projector
(Linear-GELU-Linear, or one Linear), and `baseline_gpt.BaselineGPT` as the language model, the
image features put in place of the placeholders' embeddings with `masked_scatter`: what a careful
PyTorch user writes from the LLaVA paper. It reads only shapes from a `ModelConfig` and shares no
code with `services/trainer/model`, so a benchmark against it measures meshtrain's engineering.

    model = BaselineVLM(job.model)
    loss = model(tokens, targets, images)  # targets -100 where the loss does not count
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.baseline_gpt import BaselineGPT


class ViTBlock(nn.Module):
    def __init__(self, v):
        super().__init__()
        h = v.hidden_size
        self.heads, self.clip = v.num_attention_heads, v.variant == "clip"
        self.ln1 = nn.LayerNorm(h, eps=v.norm_epsilon)
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h, eps=v.norm_epsilon)
        self.fc1 = nn.Linear(h, v.ffn_hidden_size)
        self.fc2 = nn.Linear(v.ffn_hidden_size, h)

    def forward(self, x):
        n, t, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (n, heads, t, head_dim)
        a = F.scaled_dot_product_attention(q, k, v)  # bidirectional
        x = x + self.out(a.transpose(1, 2).reshape(n, t, h))
        y = self.fc1(self.ln2(x))
        y = y * torch.sigmoid(1.702 * y) if self.clip else F.gelu(y, approximate="tanh")
        return x + self.fc2(y)


class PlainViT(nn.Module):
    """The encoder up to the projector's layer: only the `v.layers_run` blocks that run are built
    (the tower's later blocks and final norm never touch LLaVA's features)."""

    def __init__(self, v):
        super().__init__()
        h, p = v.hidden_size, v.patch_size
        self.cls_token = v.class_token
        self.keep_cls = v.select_feature == "cls_patch"
        self.patch = nn.Conv2d(3, h, p, stride=p, bias=not self.cls_token)
        self.cls = nn.Parameter(torch.randn(h) * h**-0.5) if self.cls_token else None
        self.pos = nn.Parameter(torch.randn(v.grid**2 + int(self.cls_token), h) * 0.02)
        self.pre_ln = nn.LayerNorm(h, eps=v.norm_epsilon) if v.variant == "clip" else None
        self.blocks = nn.ModuleList(ViTBlock(v) for _ in range(v.layers_run))

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)  # (n, grid*grid, hidden)
        if self.cls is not None:
            cls = self.cls.to(x.dtype).expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)  # (n, 1 + grid*grid, hidden)
        x = x + self.pos.to(x.dtype)
        if self.pre_ln is not None:
            x = self.pre_ln(x)
        for blk in self.blocks:
            x = blk(x)
        return x if self.cls is None or self.keep_cls else x[:, 1:]


class BaselineVLM(nn.Module):
    """ViT + projector + BaselineGPT. `freeze_vision`: the encoder's weights do not train and it
    runs without autograd (LLaVA-1.5's recipe, both stages)."""

    def __init__(self, c, freeze_vision: bool = False):
        super().__init__()
        v = c.vision
        if v is None:
            raise ValueError("BaselineVLM needs model.vision (a vision encoder's shapes)")
        self.image_token = v.image_token_id
        self.vit = PlainViT(v)
        bias = v.projector_bias
        if v.projector == "mlp2x_gelu":
            self.projector: nn.Module = nn.Sequential(
                nn.Linear(v.hidden_size, c.hidden_size, bias=bias),
                nn.GELU(),
                nn.Linear(c.hidden_size, c.hidden_size, bias=bias),
            )
        else:
            self.projector = nn.Linear(v.hidden_size, c.hidden_size, bias=bias)
        self.lm = BaselineGPT(c)
        self.freeze_vision = freeze_vision
        if freeze_vision:
            self.vit.requires_grad_(False)

    def forward(self, tokens, targets, images):
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_vision):
            feats = self.vit(images)
        feats = self.projector(feats)  # (n_images, tokens_per_image, hidden)
        x = self.lm.wte(tokens)  # (batch, seq, hidden)
        where = (tokens == self.image_token).unsqueeze(-1)
        x = x.masked_scatter(where, feats.to(x.dtype))
        return self.lm.loss_from_embeddings(x, targets)
