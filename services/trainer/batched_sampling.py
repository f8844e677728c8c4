"""The RL rollouts' batched sampler: `sample_rows`, run by GRPO's colocated generator and the
rollout worker.

Prompts of any lengths are left-padded into one batch with a static key/value cache, each
completion drawing from its own generator, seeded by `generate.completion_seed(prompt seed,
sample index)`, with the prompt seed = request seed + the prompt's index in the whole request.
Both sides then give the same tokens for the same weights, however prompts are batched, split
over workers or over data-parallel ranks. The decode step has static shapes (the whole
preallocated cache under a per-row key mask, the step number on the device), so on a GPU it is
captured once as a CUDA graph and replayed per token (decode_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtrain.kernels import dispatch
from meshtrain.services.common.errors import ConfigError, MeshtrainError
from meshtrain.services.common.sampling import check_sampling
from meshtrain.services.trainer.decode_graphs import DecodeGraphs, StepGraph, graphable
from meshtrain.services.trainer.generate import context_length, draw_tokens, row_uniforms

log = logging.getLogger("meshtrain.generate")


class StaticKV:
    """Per-layer keys and values (batch, groups, capacity, d), allocated once at the first
    append and written in place: a step costs no copy of what is cached (a growing
    concatenation would copy the whole cache of every layer at every token). Allocated zero:
    a decode step attends over every column under a mask, and a masked column must hold no NaN
    (its weight is 0, and 0 x NaN is NaN)."""

    def __init__(self, num_layers: int, capacity: int):
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0  # positions cached; the forward advances it after every layer

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, groups, s, d) after the cached positions; return all of them."""
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            b, g, _, d = k.shape
            keys = k.new_zeros(b, g, self.capacity, d)
            values = v.new_zeros(b, g, self.capacity, d)
            self.keys[layer], self.values[layer] = keys, values
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ConfigError(f"key/value cache of {self.capacity} positions overflows")
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        return keys[:, :, :end], values[:, :, :end]

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, column: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, groups, 1, d) at `column` ((1,) int64 on the device: no host value, so
        a captured step writes the next column at every replay); return the whole buffers."""
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            raise MeshtrainError("key/value cache written by column before a prefill allocated it")
        keys.index_copy_(2, column, k)
        values.index_copy_(2, column, v)
        return keys, values


STOP_CHECK = 8
"""Decode steps between two checks whether every row has ended (a device-to-host sync)."""

CAPACITY_STEP = 128
"""A graphed decode's cache capacity is rounded up to a multiple of this: requests whose
prompts and lengths differ a little share one captured graph."""


@dataclass(frozen=True)
class RowSample:
    """One row's completion: its tokens, their log-probs, whether it ended with a stop id."""

    tokens: list[int]
    logprobs: list[float]
    finished: bool


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_k: int | None
    top_p: float | None
    eod_id: int | None
    context: int


@dataclass
class _Decode:
    """The static buffers of a batched decode: every decode step reads and writes these in
    place, with no shape that depends on the step, so one step can be captured as a CUDA graph
    and replayed for the next (decode_graphs.py)."""

    cache: StaticKV  # (b, groups, capacity, d) per layer, allocated by the first prefill
    tok: torch.Tensor  # (b,) the last drawn token, fed back at the next step
    k: torch.Tensor  # (1,) the step being drawn: the number of tokens drawn before it
    longest: torch.Tensor  # (1,) the longest prompt: the cache column of the first drawn token
    lengths: torch.Tensor  # (b,) prompt lengths
    ends: torch.Tensor  # (b,) how many tokens each row may draw
    key_ok: torch.Tensor  # (b, capacity) bool: the cache columns a row attends to
    u: torch.Tensor  # (b, capacity) the rows' uniforms, step k's in column k
    tokens: torch.Tensor  # (b, capacity) drawn tokens, step k's in column k
    logps: torch.Tensor  # (b, capacity) fp32 their log-probs
    done: torch.Tensor  # (b,) bool: ended (a stop id drawn, or its limit reached)

    @classmethod
    def allocate(cls, b: int, capacity: int, layers: int, device: torch.device) -> _Decode:
        def long(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        return cls(
            cache=StaticKV(layers, capacity),
            tok=long(b),
            k=long(1),
            longest=long(1),
            lengths=long(b),
            ends=long(b),
            key_ok=torch.zeros(b, capacity, dtype=torch.bool, device=device),
            u=torch.ones(b, capacity, device=device),
            tokens=long(b, capacity),
            logps=torch.zeros(b, capacity, device=device),
            done=torch.zeros(b, dtype=torch.bool, device=device),
        )


@torch.no_grad()
def sample_rows(
    model,
    prompts: Sequence[Sequence[int]],
    prompt_seeds: list[int],
    sample_indices: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eod_id: int | None = None,
    graphs: DecodeGraphs | None = None,
) -> list[RowSample]:
    """Sample a completion of every row as one left-padded batch with a static key/value cache:
    the RL rollouts' sampler (the rollout worker's engine and GRPO's colocated generator).

    Each row keeps its own positions (they start at its first real token) and its keys never
    include the padding, and its draws come from its own generator, seeded by
    `completion_seed(prompt_seeds[r], sample_indices[r])`: a row's tokens and log-probs depend on
    the weights, its prompt and its seed alone, not on its batch-mates. A log-prob is the token's
    under the full-vocabulary distribution at temperature 1 (log_softmax of the raw logits),
    whatever temperature, top-k or top-p drew it. Runs in the model's dtype, or under the
    caller's autocast.

    The prompts run through the model at once (prefill); each decode step then feeds one token
    per row, attends over the whole preallocated cache under a per-row key mask and writes its
    token and log-prob into preallocated outputs: nothing is allocated or copied per step in
    proportion to the sequence, and the step's shapes never change. With `graphs` (enabled, on
    CUDA) the step is captured once as a CUDA graph and replayed for every token; rows that
    ended keep decoding (their draws are dropped) until every row has, which is asked every
    `STOP_CHECK` steps.

    Args:
        model: a single-device GPT (or its tensor-parallel shard: every rank of a group draws
            the same tokens from the same gathered logits and seeds), in eval mode.
        prompts: each row's prompt ids (at least one each).
        prompt_seeds, sample_indices: each row's seed pair (`completion_seed`).
        max_new_tokens: tokens to draw per row; a row whose prompt leaves fewer positions in the
            model's context draws as many as fit (the last drawn token needs no position).
        temperature, top_k, top_p: as for `generate.generate` (`check_sampling`).
        eod_id: a row ends at its first `eod_id`, kept (None: always max_new_tokens).
        graphs: the caller's captured decode steps of this model (None, disabled, not CUDA, or
            a model whose step cannot be captured: the same step runs eagerly).

    Returns:
        A `RowSample` per row, in order.

    Raises:
        ConfigError: an empty prompt, or one that leaves no room in the model's positions.
    """
    check_sampling(temperature, top_k, top_p)
    if len(prompts) == 0:
        return []
    context = context_length(model)
    limits = _row_limits(prompts, prompt_seeds, sample_indices, max_new_tokens, context)
    steps = max(limits)
    device = next(model.parameters()).device
    sampling = _Sampling(temperature, top_k, top_p, eod_id, context)
    st, graph = _decode_state(model, prompts, steps, sampling, device, graphs)
    logits = _start(model, st, prompts, prompt_seeds, sample_indices, steps, limits, device)
    _draw(st, logits, sampling)  # step 0, from the prefill's logits
    # Every row runs to the end unless a stop id may end it, or its own limit is below steps.
    drawn = _decode_steps(
        model, st, sampling, graph, steps, eod_id is not None or min(limits) < steps
    )
    tokens = st.tokens[:, :drawn].tolist()  # (b, drawn): one transfer
    logps = st.logps[:, :drawn].tolist()
    return _trim_rows(tokens, logps, limits, eod_id)


def _decode_state(
    model,
    prompts: Sequence[Sequence[int]],
    steps: int,
    sampling: _Sampling,
    device: torch.device,
    graphs: DecodeGraphs | None,
) -> tuple[_Decode, StepGraph | None]:
    """The static buffers of this decode and the captured step that runs on them: the graphs'
    kept ones for this shape (captured now if new), or fresh buffers and no graph where the
    step runs eagerly (no graphs, disabled, one step, or a model whose step cannot be
    captured: logged once)."""
    b, longest = len(prompts), max(len(p) for p in prompts)
    use_graph = steps > 1 and graphs is not None and graphs.enabled
    if use_graph and graphs is not None:
        why = graphable(model, device)
        if why is not None:
            use_graph = False
            if graphs.skipped is None:
                log.info("decoding without CUDA graphs: %s", why)
                graphs.skipped = why
    if not use_graph or graphs is None:
        return _Decode.allocate(b, longest + steps, len(model.layers), device), None
    graphs.check_weights(model)
    capacity = -(-(longest + steps) // CAPACITY_STEP) * CAPACITY_STEP
    key = (b, capacity, sampling, next(model.parameters()).dtype, _autocast_state())
    st = graphs.state(key)
    if st is None:
        st = _Decode.allocate(b, capacity, len(model.layers), device)
        graphs.keep(key, st, _capture(model, st, sampling, prompts, device, graphs))
    return st, graphs.graph(key)


def _decode_steps(
    model, st: _Decode, sampling: _Sampling, graph: StepGraph | None, steps: int, may_stop: bool
) -> int:
    """Draw steps 1.. of `st` (step 0 is the prefill's), replaying `graph` or running the step
    eagerly; return how many steps were drawn. With `may_stop`, the loop ends early once every
    row has ended, which is asked only every STOP_CHECK steps: a host round trip per token would
    leave the device idle while the next step is launched."""
    drawn = 1
    for step in range(1, steps):
        if may_stop and step % STOP_CHECK == 0 and bool(st.done.all()):
            break
        if graph is not None:
            graph.replay()
        else:
            _decode_step(model, st, sampling)
        drawn = step + 1
    return drawn


def _autocast_state() -> tuple:
    return (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def _capture(
    model,
    st: _Decode,
    sampling: _Sampling,
    prompts: Sequence[Sequence[int]],
    device: torch.device,
    graphs: DecodeGraphs,
) -> StepGraph | None:
    """The decode step on `st` captured as a CUDA graph (None, and graphs turned off, where the
    capture fails: the step then runs eagerly)."""
    # the prefill allocates the cache the step writes into; _start refills everything after
    _prefill_rows(model, prompts, st)
    try:
        return StepGraph(lambda: _decode_step(model, st, sampling), device)
    except MeshtrainError as e:
        log.warning("%s; decoding eagerly from now on", e)
        graphs.enabled, graphs.skipped = False, str(e)
        return None


def _start(
    model,
    st: _Decode,
    prompts: Sequence[Sequence[int]],
    prompt_seeds: list[int],
    sample_indices: list[int],
    steps: int,
    limits: list[int],
    device: torch.device,
) -> torch.Tensor:
    """Fill `st` for these rows, run the prefill into its cache, and return the logits (b,
    vocab) of every row's first token."""
    # every uniform of the generation, one copy: decoding then never waits on the host
    u = row_uniforms(prompt_seeds, sample_indices, steps)  # (b, steps)
    st.u.fill_(1.0)
    st.u[:, :steps] = u.to(device)
    # a row past its own limit counts as ended; what it draws after is dropped (_trim_rows)
    st.ends.copy_(torch.tensor(limits))
    st.k.zero_()
    st.done.zero_()
    st.tokens.zero_()
    st.logps.zero_()
    logits, lengths, key_ok = _prefill_rows(model, prompts, st)
    longest = key_ok.shape[1]
    st.longest.fill_(longest)
    st.lengths.copy_(lengths)
    # decoded columns join a row's keys one per step (_decode_step); the later ones hold what an
    # earlier call left, finite and never read
    st.key_ok.zero_()
    st.key_ok[:, :longest] = key_ok
    return logits


def _draw(st: _Decode, logits: torch.Tensor, sampling: _Sampling) -> None:
    """Step `st.k`'s tokens drawn from logits (b, vocab) with its uniforms, written with their
    log-probs into the outputs; rows that end here marked done."""
    logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)  # temperature 1, full vocabulary
    u = st.u.index_select(1, st.k).squeeze(1)  # (b,)
    nxt = draw_tokens(logits, sampling.temperature, sampling.top_k, sampling.top_p, u)  # (b,)
    st.tokens.index_copy_(1, st.k, nxt[:, None])
    st.logps.index_copy_(1, st.k, logp.gather(-1, nxt[:, None]))
    st.tok.copy_(nxt)
    st.done |= st.ends <= st.k + 1
    if sampling.eod_id is not None:
        st.done |= nxt == sampling.eod_id


def _decode_step(model, st: _Decode, sampling: _Sampling) -> None:
    """Feed every row's last token back and draw the next: all on `st`'s static buffers, with
    no host value that changes from step to step (the graph replays it as captured)."""
    st.k.add_(1)
    column = st.longest + st.k - 1  # (1,) the cache column of the token fed back
    st.key_ok.index_fill_(1, column, True)
    # each row's next position; a row past its limit may run off the table, and is ignored
    positions = (st.lengths + st.k - 1).clamp(max=sampling.context - 1)[:, None]  # (b, 1)
    mask = st.key_ok[:, None, None, :]  # (b, 1, 1, capacity)
    logits = _forward_rows(model, st.tok[:, None], positions, mask, st.cache, column)
    _draw(st, logits[:, -1], sampling)


def _row_limits(
    prompts: Sequence[Sequence[int]],
    prompt_seeds: list[int],
    sample_indices: list[int],
    max_new_tokens: int,
    context: int,
) -> list[int]:
    """How many tokens each row may draw (`sample_rows`'s arguments checked)."""
    b = len(prompts)
    if len(prompt_seeds) != b or len(sample_indices) != b:
        raise ConfigError(
            f"{b} prompts but {len(prompt_seeds)} prompt seeds and {len(sample_indices)} "
            "sample indices"
        )
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sizes = [len(p) for p in prompts]
    for r, n in enumerate(sizes):
        if not 1 <= n <= context:
            raise ConfigError(
                f"prompt {r} of {n} tokens: must be 1..{context} (the model's positions)"
            )
    return [min(max_new_tokens, context + 1 - n) for n in sizes]


def _prefill_rows(model, prompts: Sequence[Sequence[int]], st: _Decode):
    """The left-padded prompts through the model into `st.cache` (from its column 0): the last
    position's logits (b, vocab), each row's prompt length (b,) and the key mask of the prompt
    columns (b, longest)."""
    b, sizes = len(prompts), [len(p) for p in prompts]
    device = st.tok.device
    longest = max(sizes)
    host = torch.zeros(b, longest, dtype=torch.long)  # built on the host, sent once
    for r, prompt in enumerate(prompts):
        host[r, longest - sizes[r] :] = torch.as_tensor(prompt, dtype=torch.long)
    tokens = host.to(device)
    lengths = torch.tensor(sizes, device=device)
    pad = longest - lengths  # (b,) padding before each row's prompt
    # Positions count from each row's first real token; keys are real tokens only (a padding
    # query sees itself, so no row of the mask is empty and nothing is NaN).
    cols = torch.arange(longest, device=device)
    positions = (cols[None, :] - pad[:, None]).clamp(min=0)  # (b, longest)
    key_ok = cols[None, :] >= pad[:, None]  # (b, longest)
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    eye = torch.eye(longest, dtype=torch.bool, device=device)
    mask = causal[None] & (key_ok[:, None, :] | eye[None])  # (b, q, k)
    st.cache.length = 0
    logits = _forward_rows(model, tokens, positions, mask[:, None], st.cache)[:, -1]  # (b, vocab)
    return logits, lengths, key_ok


def _trim_rows(
    drawn: list[list[int]], logps: list[list[float]], limits: list[int], eod_id: int | None
) -> list[RowSample]:
    """Each row's draws cut at its own limit and after its first EOD (kept)."""
    eod = -1 if eod_id is None else eod_id  # -1 is never drawn
    out = []
    for r, limit in enumerate(limits):
        row = drawn[r][:limit]
        finished = eod in row
        n = row.index(eod) + 1 if finished else len(row)
        out.append(RowSample(row[:n], logps[r][:n], finished))
    return out


def _forward_rows(
    model,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    cache: StaticKV,
    column: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (b, s, vocab) of new tokens (b, s) at per-row `positions` (b, s), attending to the
    cached keys and themselves where `mask` allows: (b, 1, s, cached + s) with the new keys
    appended after `cache.length` ones (column None), or (b, 1, 1, capacity) with one new token
    per row written at cache column `column` ((1,) on the device) and every column attended."""
    x = model.embedding(tokens, positions)  # (b, s, hidden)
    rope = None
    if model.rope_cos is not None:
        rope = (model.rope_cos[positions], model.rope_sin[positions])  # (b, s, d) each
    for i, block in enumerate(model.layers):
        x = x + _attention_rows(block.attention, block.input_norm(x), rope, mask, cache, i, column)
        x = x + block.mlp(block.pre_mlp_norm(x))
    if column is None:
        cache.length += tokens.shape[1]
    h = model.final_norm(x)
    # Padded vocabulary rows are never real tokens: keep them out of sampling.
    return model.head.logits(h, model.output_weight)[..., : model.vocab_size]


def _attention_rows(
    attn,
    x: torch.Tensor,
    rope,
    mask: torch.Tensor,
    cache: StaticKV,
    layer: int,
    column: torch.Tensor | None,
) -> torch.Tensor:
    """The model's Attention on new positions x (b, s, hidden) with a per-row key mask."""
    q, k, v = attn.project(x)  # (b, heads|groups, s, d)
    b, _, s, _ = q.shape
    if rope is not None:
        q, k = dispatch.rope(q, *rope), dispatch.rope(k, *rope)  # per-row rows (b, s, d)
    if column is None:
        k, v = cache.append(layer, k, v)  # (b, groups, t, d)
    else:
        k, v = cache.write(layer, k, v, column)  # (b, groups, capacity, d)
    # Query head j uses key/value group j // per_group (the fused layout's order), as
    # enable_gqa maps them: the cache is never expanded to one copy per head.
    gqa = attn.heads != attn.groups
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)  # (b, h, s, d)
    return attn.proj(out.transpose(1, 2).reshape(b, s, attn.heads * attn.head_dim))
