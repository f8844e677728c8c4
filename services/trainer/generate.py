"""Sampling from a single-device GPT with a key/value cache.

The decode path here reuses the model's own modules and weights (norms, projections, MLPs,
embeddings, RoPE tables) but runs its own attention step, so the training forward stays
untouched: the prompt is run once (prefill), each layer's keys and values are kept, and every
new token then costs one position through the network instead of the whole sequence. A
vision-language model's images are part of the prefill: their features take the place of the
prompt's placeholders, and the keys and values of those positions are cached like any other.

RL rollouts share this module's seeding rule: completion j of the prompt seeded s draws from
its own generator, seeded by `completion_seed(s, j)`, with one uniform per token
(`row_uniforms`); the batched sampler both generators run is `batched_sampling.sample_rows`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from meshtrain.kernels import dispatch
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.sampling import check_sampling
from meshtrain.services.trainer.model.vision import image_features, merge_image_features


class KVCache:
    """Per-layer keys and values of the positions decoded so far: (batch, groups, len, d)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def _attention_step(attn, x: torch.Tensor, rope, cache: KVCache, layer: int) -> torch.Tensor:
    """The model's Attention on new positions x (b, s, hidden), attending to cache + themselves."""
    per_group = attn.heads // attn.groups
    start = cache.length
    q, k, v = attn.project(x)  # (b, heads|groups, s, d), q/k normalized where the model does
    b, _, s, _ = q.shape
    if rope is not None:
        # The new positions are start..start+s-1, so their rotation starts at the cache length.
        cos, sin = rope[0][start : start + s], rope[1][start : start + s]
        q, k = dispatch.rope(q, cos, sin), dispatch.rope(k, cos, sin)
    k, v = cache.append(layer, k, v)  # (b, groups, start+s, d)
    # Query head j uses key/value group j // per_group (the fused layout's order).
    k, v = k.repeat_interleave(per_group, 1), v.repeat_interleave(per_group, 1)  # (b, heads, t, d)
    total = start + s
    # Causal with an offset: new position i (absolute start+i) sees keys 0..start+i. SDPA's
    # is_causal aligns top-left, which is wrong once the cache is non-empty, so pass a mask.
    mask = torch.ones(s, total, dtype=torch.bool, device=x.device).tril(diagonal=start)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (b, heads, s, d)
    return attn.proj(out.transpose(1, 2).reshape(b, s, attn.heads * attn.head_dim))


def context_length(model) -> int:
    """Positions the model can take: its RoPE table's length, or its learned position rows."""
    if model.rope_cos is not None:
        return model.rope_cos.shape[0]
    return model.config.max_positions


@torch.no_grad()
def forward_cached(
    model, tokens: torch.Tensor, cache: KVCache, images: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits (b, s, vocab) of new tokens (b, s) placed after the `cache.length` cached
    positions; `images` (n, 3, H, W), normalized, fill the tokens' placeholders in reading order
    (row by row, left to right) as in training."""
    s = tokens.shape[1]
    start = cache.length
    if start + s > context_length(model):
        raise ConfigError(
            f"sequence of {start + s} tokens exceeds the model's {context_length(model)} positions"
        )
    emb = model.embedding
    x = emb.word_embeddings(tokens)
    if images is not None and images.shape[0]:
        if model.vision is None:
            raise ConfigError("images given to a text-only model (model.vision is unset)")
        features = image_features(model.vision, model.projector, images.to(x.device))
        x = merge_image_features(x, tokens, features, model.config.vision.image_token_id)
    if emb.position_embeddings is not None:
        positions = torch.arange(start, start + s, device=tokens.device)
        x = x + emb.position_embeddings(positions)  # (s, hidden) broadcast over batch
    rope = (model.rope_cos, model.rope_sin) if model.rope_cos is not None else None
    for i, block in enumerate(model.layers):
        x = x + _attention_step(block.attention, block.input_norm(x), rope, cache, i)
        x = x + block.mlp(block.pre_mlp_norm(x))
    cache.length += s
    h = model.final_norm(x)
    # Padded vocabulary rows are never real tokens: keep them out of sampling.
    return model.head.logits(h, model.output_weight)[..., : model.vocab_size]


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """logits (b, vocab) with everything outside the top k / the nucleus of mass p set to -inf."""
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches p (the best one always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def completion_seed(prompt_seed: int, sample_index: int) -> int:
    """The seed of completion `sample_index` of the prompt seeded `prompt_seed` (63 bits, well
    mixed: neighbouring prompts or samples get unrelated streams)."""
    mask = (1 << 64) - 1
    data = struct.pack("<QQ", prompt_seed & mask, sample_index & mask)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def row_generators(prompt_seeds: list[int], sample_indices: list[int]) -> list[torch.Generator]:
    """One CPU generator per row (prompt seed, sample index): draws that do not depend on the
    device, the batch or the other rows."""
    return [
        torch.Generator().manual_seed(completion_seed(s, j))
        for s, j in zip(prompt_seeds, sample_indices, strict=True)
    ]


def row_uniforms(prompt_seeds: list[int], sample_indices: list[int], steps: int) -> torch.Tensor:
    """(b, steps) uniforms in (0, 1] on the host: row r's k-th is the k-th draw of its generator
    (`row_generators`), so a row's draws never depend on the other rows or on how many tokens
    the batch decodes. Drawn all at once (`torch.rand(n)` gives the same values as n single
    draws) so that decoding needs no host work per token."""
    gens = row_generators(prompt_seeds, sample_indices)
    if not gens:
        return torch.empty(0, steps)
    return torch.stack([1.0 - torch.rand(steps, generator=g) for g in gens])


def draw_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    u: torch.Tensor,
) -> torch.Tensor:
    """(b,) next tokens of logits (b, vocab): greedy at temperature 0, else inverse-CDF sampling
    with each row's own uniform u (b,) in (0, 1] (see `row_uniforms`)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)  # (b, vocab)
    cdf = probs.cumsum(-1)
    # u in (0, 1]: the first index whose cdf reaches u * total has positive probability.
    nxt = (cdf < (u * cdf[:, -1])[:, None]).sum(-1)
    return nxt.clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def generate(
    model,
    tokens: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eod_id: int | Sequence[int] | None = None,
    images: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample `max_new_tokens` tokens after `tokens` with a KV cache.

    Args:
        model: a single-device GPT (put in eval mode here: no dropout while sampling).
        tokens: (batch, seq) or (seq,) int64 prompt ids.
        max_new_tokens: tokens to add (fewer if the model's positions run out).
        temperature: softmax temperature; 0 picks the most likely token (greedy).
        top_k: keep only the k most likely tokens (None/0: all).
        top_p: keep the smallest set of tokens with probability mass >= p (None/1: all).
        generator: the torch.Generator to draw from (reproducible samples).
        eod_id: stop a row once it emits this id, or any of these ids (it is kept; a stopped
            row is filled with the first); None: never stop early.
        images: a vision-language model's (n_images, 3, H, W) normalized images, for the
            prompt's placeholders in reading order (every row's, row by row); the prefill reads
            them, the decoded tokens never do.

    Returns:
        (batch, seq + new) int64: the prompt followed by the sampled tokens.
    """
    check_sampling(temperature, top_k, top_p)
    squeeze = tokens.dim() == 1
    out = tokens.unsqueeze(0) if squeeze else tokens
    model.eval()
    limit = context_length(model)
    steps = max(0, min(max_new_tokens, limit - out.shape[1]))
    cache = KVCache(len(model.layers))
    logits = forward_cached(model, out, cache, images)[
        :, -1
    ]  # prefill: (b, vocab) of the next token
    done = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    stop_ids = [] if eod_id is None else [eod_id] if isinstance(eod_id, int) else list(eod_id)
    stops = torch.tensor(stop_ids, dtype=out.dtype, device=out.device) if stop_ids else None
    for step in range(steps):
        logits = logits.float()
        if temperature == 0:
            nxt = logits.argmax(-1)  # (b,)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (b,)
        if stops is not None:
            nxt = torch.where(done, stops[0].expand_as(nxt), nxt)
            done |= torch.isin(nxt, stops)
        out = torch.cat([out, nxt[:, None]], dim=1)
        if step + 1 == steps or (stops is not None and bool(done.all())):
            break
        logits = forward_cached(model, nxt[:, None], cache)[:, -1]
    return out[0] if squeeze else out
