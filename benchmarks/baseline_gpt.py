"""A plain-PyTorch GPT, written independently of meshtrain, as the speed baseline.

Same architecture family and shapes as meshtrain's model for a given ModelConfig (GPT-2
style or Llama style), built the way a careful PyTorch user would: SDPA attention, bf16
autocast, fused AdamW, torch.compile. Given packed documents' ids, attention stays inside each
document through FlexAttention with a document block mask (built each forward, as FlexAttention's
own document-masking example does; a kernel under torch.compile; off CUDA, where FlexAttention
has no backward, SDPA with a dense mask), RoPE takes each token's position in its document, and
a loss mask weights the tokens. It shares no code with `services/trainer/model`, so a
benchmark against it measures meshtrain's engineering, not a copy of itself. `convert_to_float8`
turns its blocks' linear layers into torchao's float8 training layers (the output head stays in
bf16), the FP8 baseline a PyTorch user would reach for; torchao is imported only then.
`StaticDecoder` samples from it with a preallocated key/value cache, the plain decoder the
rollout engine is measured against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


class LoopMoE(nn.Module):
    """A plain mixture of experts as a PyTorch user writes it (Mixtral's reference shape): softmax
    router, top-k renormalized, then a Python loop over the experts, each gathering its tokens
    with `torch.where`, running a SwiGLU/GELU MLP and scattering back with `index_add_`. Under
    torch.compile the data-dependent token counts are captured as dynamic shapes."""

    def __init__(self, c):
        super().__init__()
        h, f, e = c.hidden_size, c.moe_ffn_size, c.num_experts
        self.topk, self.swiglu = c.moe_router_topk, c.activation == "swiglu"
        self.gate = nn.Linear(h, e, bias=False)
        self.up = nn.ModuleList(
            nn.Linear(h, 2 * f if self.swiglu else f, bias=False) for _ in range(e)
        )
        self.down = nn.ModuleList(nn.Linear(f, h, bias=False) for _ in range(e))

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(b * s, h)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        w, sel = torch.topk(probs, self.topk, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            tok, slot = torch.where(sel == e)
            y = up(x[tok])
            if self.swiglu:
                g, u = y.chunk(2, dim=-1)
                y = F.silu(g) * u
            else:
                y = F.gelu(y, approximate="tanh")
            out.index_add_(0, tok, (down(y) * w[tok, slot, None]).to(out.dtype))
        return out.view(b, s, h)


class DenseMLP(nn.Module):
    def __init__(self, c, f: int):
        super().__init__()
        h, bias = c.hidden_size, c.add_bias_linear
        self.swiglu = c.activation == "swiglu"
        self.up = nn.Linear(h, 2 * f if self.swiglu else f, bias=bias)
        self.down = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        y = self.up(x)
        if self.swiglu:
            g, u = y.chunk(2, dim=-1)
            y = F.silu(g) * u
        else:
            y = F.gelu(y, approximate="tanh")
        return self.down(y)


class Block(nn.Module):
    def __init__(self, c, layer: int = 0):
        super().__init__()
        self.c = c
        h, d = c.hidden_size, c.head_dim
        self.nh, self.nkv, self.d = c.num_attention_heads, c.groups, d
        if c.normalization == "rmsnorm":
            norm = lambda: nn.RMSNorm(h, eps=c.norm_epsilon)  # noqa: E731
        else:
            norm = lambda: nn.LayerNorm(h)  # noqa: E731
        bias = c.add_bias_linear
        self.ln1, self.ln2 = norm(), norm()
        self.q = nn.Linear(h, self.nh * d, bias=bias)
        self.kv = nn.Linear(h, 2 * self.nkv * d, bias=bias)
        self.o = nn.Linear(self.nh * d, h, bias=bias)
        moe = c.num_experts is not None and (
            layer % c.moe_layer_freq == 0
            if isinstance(c.moe_layer_freq, int)
            else c.moe_layer_freq[layer]
        )
        self.mlp = LoopMoE(c) if moe else DenseMLP(c, c.ffn_size)

    def forward(self, x, cos, sin, block_mask=None):
        b, s, _ = x.shape
        y = self.ln1(x)
        q = self.q(y).view(b, s, self.nh, self.d).transpose(1, 2)
        k, v = self.kv(y).view(b, s, 2, self.nkv, self.d).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if cos is not None:

            def rot(t):
                t1, t2 = t.chunk(2, dim=-1)
                return t * cos + torch.cat([-t2, t1], -1) * sin

            q, k = rot(q), rot(k)
        gqa = self.nkv != self.nh
        if block_mask is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif isinstance(block_mask, torch.Tensor):  # off CUDA: a dense (b, 1, s, s) mask
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask, enable_gqa=gqa)
        else:  # not an autocast op: RoPE's fp32 tables left q and k in fp32 under autocast
            q, k = q.to(v.dtype), k.to(v.dtype)
            a = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.ln2(x))


class BaselineGPT(nn.Module):
    """`bf16_residual`: under autocast, cast the embedding output to bf16, so the residual stream
    between blocks is bf16 (plain autocast keeps it in fp32, the embeddings' dtype)."""

    def __init__(self, c, bf16_residual: bool = False):
        super().__init__()
        self.c = c
        self.bf16_residual = bf16_residual
        v = c.padded_vocab_size()
        self.wte = nn.Embedding(v, c.hidden_size)
        self.wpe = (
            nn.Embedding(c.seq_length, c.hidden_size)
            if c.position_embedding_type == "learned"
            else None
        )
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.num_layers))
        self.ln_f = (
            nn.RMSNorm(c.hidden_size)
            if c.normalization == "rmsnorm"
            else nn.LayerNorm(c.hidden_size)
        )
        self.head = nn.Linear(c.hidden_size, v, bias=False)
        if not c.untie_embeddings_and_output_weights:
            self.head.weight = self.wte.weight
        if c.position_embedding_type == "rope":
            d = c.head_dim
            inv = 1.0 / (c.rotary_base ** (torch.arange(0, d, 2).float() / d))
            ang = torch.outer(torch.arange(c.seq_length).float(), inv)
            ang = torch.cat([ang, ang], -1)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)
        else:
            self.cos = self.sin = None
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                down = name.endswith(("o.weight", "down.weight")) or ".down." in name
                std = 0.02 / math.sqrt(2 * c.num_layers) if down else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets, loss_mask=None, document_ids=None, position_ids=None):
        """Mean token loss. `loss_mask` (b, s) float weights the tokens; `document_ids` (b, s),
        non-decreasing, keeps attention inside each packed document; `position_ids` (b, s) are
        the tokens' positions (e.g. restarting at each document; default 0, 1, ...)."""
        return self.loss_from_embeddings(
            self.wte(idx), targets, loss_mask, document_ids, position_ids
        )

    def loss_from_embeddings(
        self, x, targets, loss_mask=None, document_ids=None, position_ids=None
    ):
        """The mean cross-entropy from the token embeddings x (batch, seq, hidden) on: positions,
        the blocks, the head (the arguments as `forward`'s). A vision-language model enters here
        with image features in place of its placeholders' embeddings; a target of -100 is left
        out of the mean."""
        b, s = x.shape[:2]
        pos = torch.arange(s, device=x.device) if position_ids is None else position_ids.long()
        if self.wpe is not None:
            x = x + self.wpe(pos)
        if self.bf16_residual and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.bfloat16)
        cos = sin = None
        if self.cos is not None:  # (s, d), or (b, 1, s, d) at given positions
            cos, sin = self.cos[:s], self.sin[:s]
            if position_ids is not None:
                cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        block_mask = None
        if document_ids is not None:
            docs = document_ids

            def same_document(batch, head, q, k):
                return (q >= k) & (docs[batch, q] == docs[batch, k])

            if x.is_cuda:
                block_mask = create_block_mask(same_document, b, None, s, s, device=x.device)
            else:  # FlexAttention has no backward off CUDA
                causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
                block_mask = ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]
        for blk in self.blocks:
            x = blk(x, cos, sin, block_mask)
        logits = self.head(self.ln_f(x))[..., : self.c.vocab_size]
        if loss_mask is None:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        mask = loss_mask.flatten().float()
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)


class StaticDecoder:
    """A plain decoder over a `BaselineGPT`: keys and values in one preallocated
    (layers, batch, groups, context, head_dim) buffer each, written in place."""

    def __init__(self, model, batch: int, context: int):
        self.m, self.c = model, model.c
        w = model.wte.weight
        shape = (self.c.num_layers, batch, self.c.groups, context, self.c.head_dim)
        self.k = torch.empty(shape, dtype=w.dtype, device=w.device)
        self.v = torch.empty_like(self.k)

    def forward(self, idx, start: int):
        """Logits (b, vocab) of the last of tokens idx (b, s) at positions start.. start+s-1."""
        m, (b, s) = self.m, idx.shape
        x = m.wte(idx)
        if m.wpe is not None:
            x = x + m.wpe(torch.arange(start, start + s, device=idx.device))
        rope = m.cos is not None  # (without RoPE, cos and sin below are placeholders)
        cos = m.cos[start : start + s] if rope else x
        sin = m.sin[start : start + s] if rope else x
        gqa = self.c.groups != self.c.num_attention_heads
        for i, blk in enumerate(m.blocks):
            y = blk.ln1(x)
            q = blk.q(y).view(b, s, blk.nh, blk.d).transpose(1, 2)
            k, v = blk.kv(y).view(b, s, 2, blk.nkv, blk.d).unbind(2)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if rope:
                q1, q2 = q.chunk(2, -1)
                k1, k2 = k.chunk(2, -1)
                q = q * cos + torch.cat([-q2, q1], -1) * sin
                k = k * cos + torch.cat([-k2, k1], -1) * sin
            self.k[i, :, :, start : start + s] = k
            self.v[i, :, :, start : start + s] = v
            keys, values = self.k[i, :, :, : start + s], self.v[i, :, :, : start + s]
            # prefill starts at 0 (causal is top-left aligned); one new query sees every key
            a = F.scaled_dot_product_attention(q, keys, values, is_causal=s > 1, enable_gqa=gqa)
            x = x + blk.o(a.transpose(1, 2).reshape(b, s, -1))
            x = x + blk.mlp(blk.ln2(x))
        return m.head(m.ln_f(x[:, -1]))[..., : self.c.vocab_size]

    def generate(self, prompts, new_tokens: int, temperature: float):
        """(tokens, log-probs) lists of `new_tokens` sampled after prompts (b, s)."""
        with torch.no_grad():
            s = prompts.shape[1]
            logits = self.forward(prompts, 0)
            toks, logps = [], []
            for step in range(new_tokens):
                logits = logits.float()
                if temperature == 0:
                    nxt = logits.argmax(-1)
                else:
                    probs = (logits / temperature).softmax(-1)
                    nxt = torch.multinomial(probs, 1).squeeze(-1)
                logps.append(logits.log_softmax(-1).gather(-1, nxt[:, None]).squeeze(-1))
                toks.append(nxt)
                if step + 1 < new_tokens:
                    logits = self.forward(nxt[:, None], s + step)
            return torch.stack(toks, 1).tolist(), torch.stack(logps, 1).tolist()


FLOAT8_RECIPES = ("tensorwise", "rowwise")
"""torchao's float8 training recipes `convert_to_float8` accepts
(Float8LinearConfig.from_recipe_name): one scale per tensor, or one per row of each GEMM operand
(finer, slower scaling)."""


def convert_to_float8(model: BaselineGPT, recipe: str) -> list[str]:
    """Swap the linear layers of `model`'s blocks for torchao's `Float8Linear` in place (dynamic
    scaling, `recipe` of FLOAT8_RECIPES), as torchao's float8 training guide does; the output head
    stays a plain linear, like the output layer of every FP8 recipe. A linear whose in or out
    features are not a multiple of 16 (a small MoE router) stays too: the float8 GEMM
    (torch._scaled_mm) cannot take it. Call it before building the optimizer and compiling. torchao
    also patches Inductor's Triton min/max codegen here, for every graph the process compiles from
    then on (its workaround for a Triton fp8 miscompile; the same values).

    Args:
        model: the baseline, on its device.
        recipe: "tensorwise" or "rowwise".

    Returns:
        The names of the converted layers.
    """
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(
            f"float8 recipe must be one of {', '.join(FLOAT8_RECIPES)}, got {recipe!r}"
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(
            "the float8 baseline needs torchao (pip install torchao; meshtrain's `test` extra "
            f"pins the version its tests use): {e}"
        ) from e
    converted = []

    def chosen(
        linear: nn.Linear, name: str
    ) -> bool:  # torchao asks this of every nn.Linear by its name
        ok = (
            name.startswith("blocks.")
            and linear.in_features % 16 == 0
            and linear.out_features % 16 == 0
        )
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=chosen
    )
    return converted


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=True,
    )
