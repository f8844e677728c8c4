"""`sample_rows`'s static-shape decode (one token per row over a fixed-capacity cache, written into
preallocated outputs) against a growing-slice reference, and its CUDA-graphed replay against the
eager step on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer import batched_sampling
from meshtrain.services.trainer.batched_sampling import STOP_CHECK, StaticKV, sample_rows
from meshtrain.services.trainer.decode_graphs import DecodeGraphs, StepGraph, graphable
from meshtrain.services.trainer.generate import context_length, draw_tokens, row_uniforms
from meshtrain.services.trainer.model import GPT

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# lengths 1..40 in one batch; the model has 48 positions, so the longest row is cut by the context
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13], list(range(20, 60)), [3, 4, 5, 6, 7, 8, 9, 10, 11]]
SEEDS, INDICES = [7, 7, 8, 9, 10], [0, 1, 0, 0, 0]
NEW = 2 * STOP_CHECK + 3  # past two stop checks


@pytest.fixture(autouse=True)
def one_thread():
    """A tiny model's decode is all small ops: more threads only contend for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(seed: int = 0, position: str = "rope", device: str = "cpu") -> GPT:
    torch.manual_seed(seed)
    config = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=48,
        vocab_size=61,
        position_embedding_type=position,
    )
    return GPT(config).to(device).eval()


@torch.no_grad()
def reference_rows(model, prompts, seeds, indices, new, eod_id, temperature, top_k, top_p):
    """The decode as it was written before the static-shape step: the cache's keys sliced to the
    positions so far at every step, the mask a growing view, every row to the last step."""
    context = context_length(model)
    limits = batched_sampling._row_limits(prompts, seeds, indices, new, context)
    steps = max(limits)
    device = next(model.parameters()).device
    u = row_uniforms(seeds, indices, steps).to(device)
    b, sizes = len(prompts), [len(p) for p in prompts]
    longest = max(sizes)
    tokens = torch.zeros(b, longest, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, longest - len(p) :] = torch.tensor(p)
    tokens = tokens.to(device)
    lengths = torch.tensor(sizes, device=device)
    cols = torch.arange(longest, device=device)
    pad = longest - lengths
    positions = (cols[None, :] - pad[:, None]).clamp(min=0)
    key_ok = cols[None, :] >= pad[:, None]
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    eye = torch.eye(longest, dtype=torch.bool, device=device)
    mask = causal[None] & (key_ok[:, None, :] | eye[None])
    cache = StaticKV(len(model.layers), longest + steps)
    logits = batched_sampling._forward_rows(model, tokens, positions, mask[:, None], cache)[:, -1]
    key_ok = torch.cat([key_ok, key_ok.new_ones(b, steps)], 1)
    drawn, logps = [], []
    for step in range(steps):
        logits = logits.float()
        logp = F.log_softmax(logits, dim=-1)
        nxt = draw_tokens(logits, temperature, top_k, top_p, u[:, step])
        drawn.append(nxt)
        logps.append(logp.gather(-1, nxt[:, None]).squeeze(-1))
        if step + 1 == steps:
            break
        pos = (lengths + step).clamp(max=context - 1)[:, None]
        keys = key_ok[:, None, None, : longest + step + 1]
        logits = batched_sampling._forward_rows(model, nxt[:, None], pos, keys, cache)[:, -1]
    return batched_sampling._trim_rows(
        torch.stack(drawn, 1).tolist(), torch.stack(logps, 1).tolist(), limits, eod_id
    )


def assert_same(got, want, atol: float) -> None:
    assert [(r.tokens, r.finished) for r in got] == [(r.tokens, r.finished) for r in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)


def an_eod(model, sampling: dict) -> tuple[int, int]:
    """A token row 0 draws early, and how many tokens row 0 has with it as EOD."""
    tokens = reference_rows(model, PROMPTS, SEEDS, INDICES, NEW, None, **sampling)[0].tokens
    j = next((j for j in range(1, len(tokens)) if tokens[j] not in tokens[:j]), 0)
    return tokens[j], j + 1


SAMPLINGS = [
    dict(temperature=0.0, top_k=None, top_p=None),
    dict(temperature=1.0, top_k=None, top_p=None),
    dict(temperature=0.7, top_k=5, top_p=None),
    dict(temperature=1.0, top_k=None, top_p=0.8),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t1", "topk", "topp"])
@pytest.mark.parametrize("position", ["rope", "learned"])
def test_static_decode_matches_the_growing_cache_reference(sampling, position):
    model = tiny_model(position=position)
    eod, ended = an_eod(model, sampling)
    for eod_id in (None, eod):
        want = reference_rows(model, PROMPTS, SEEDS, INDICES, NEW, eod_id, **sampling)
        got = sample_rows(model, PROMPTS, SEEDS, INDICES, NEW, eod_id=eod_id, **sampling)
        assert_same(got, want, atol=1e-6)
        lengths = [len(r.tokens) for r in got]
        assert lengths[3] == 48 + 1 - len(PROMPTS[3]) < NEW or eod_id is not None
        if eod_id is not None:  # row 0 ends early; the test covers a stop
            assert got[0].finished and lengths[0] == ended < NEW


def test_every_row_ending_early_stops_the_decode_at_a_check(monkeypatch):
    model = tiny_model()
    greedy = dict(temperature=0.0, top_k=None, top_p=None)
    # greedy from one prompt: every row draws the same tokens, so all end at the same EOD
    prompts, seeds, indices = [[5, 6, 7]] * 3, [1, 2, 3], [0, 0, 0]
    first = reference_rows(model, prompts, seeds, indices, 40, None, **greedy)
    eod = first[0].tokens[0]
    steps = []
    step = batched_sampling._decode_step
    monkeypatch.setattr(batched_sampling, "_decode_step", lambda *a: steps.append(1) or step(*a))
    got = sample_rows(model, prompts, seeds, indices, 40, eod_id=eod, **greedy)
    assert [(r.tokens, r.finished) for r in got] == [([eod], True)] * 3
    assert len(steps) == STOP_CHECK - 1  # the first check after the stop ends the loop


def test_graphs_on_a_cpu_model_decode_eagerly_and_say_why():
    model = tiny_model()
    graphs = DecodeGraphs()
    got = sample_rows(model, PROMPTS, SEEDS, INDICES, NEW, graphs=graphs)
    want = sample_rows(model, PROMPTS, SEEDS, INDICES, NEW)
    assert_same(got, want, atol=0)
    assert graphs.captures == 0 and len(graphs) == 0
    assert graphs.skipped is not None and "CUDA" in graphs.skipped
    assert graphable(model, torch.device("cpu")) is not None
    with pytest.raises(Exception, match="CUDA device"):
        StepGraph(lambda: None, torch.device("cpu"))


def test_decode_graphs_bound_what_they_keep():
    graphs = DecodeGraphs(max_graphs=2)
    for key in "abc":
        graphs.keep(key, key, None)
    assert len(graphs) == 2 and graphs.state("a") is None and graphs.state("c") == "c"
    with pytest.raises(Exception, match="max_graphs"):
        DecodeGraphs(max_graphs=0)


# ---- on a GPU: the captured step replays what the eager one computes -------------------------


def _both(model, graphs, **kw):
    graphed = sample_rows(model, PROMPTS, SEEDS, INDICES, NEW, graphs=graphs, **kw)
    eager = sample_rows(model, PROMPTS, SEEDS, INDICES, NEW, **kw)
    return graphed, eager


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t1", "topk", "topp"])
def test_the_graphed_decode_equals_the_eager_one_on_cuda(sampling):
    model = tiny_model(device="cuda")
    eod, _ = an_eod(model, sampling)
    graphs = DecodeGraphs()
    for eod_id in (None, eod):
        graphed, eager = _both(model, graphs, eod_id=eod_id, **sampling)
        assert_same(graphed, eager, atol=1e-5)
    assert graphs.skipped is None and graphs.captures == 2  # one per eod setting
    again = sample_rows(model, PROMPTS, SEEDS, INDICES, NEW, graphs=graphs, eod_id=eod, **sampling)
    assert graphs.captures == 2  # the same key replays the graph it has
    assert_same(again, eager, atol=1e-5)


@pytest.mark.gpu
@cuda
def test_the_graphed_decode_sees_weights_copied_in_and_recaptures_for_moved_ones():
    model, other = tiny_model(0, device="cuda"), tiny_model(1, device="cuda")
    graphs = DecodeGraphs()
    before, _ = _both(model, graphs)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.copy_(q)  # in place, as the rollout engine's set_weights and an optimizer step
    graphed, eager = _both(model, graphs)
    assert graphs.captures == 1
    assert_same(graphed, eager, atol=1e-5)
    assert [r.tokens for r in graphed] != [r.tokens for r in before]
    for p in model.parameters():  # new storage: the graph's addresses are stale
        p.data = p.data.clone().mul_(0.5)
    graphed, eager = _both(model, graphs)
    assert graphs.captures == 2
    assert_same(graphed, eager, atol=1e-5)


@pytest.mark.gpu
@cuda
def test_the_graphed_decode_under_autocast_sees_each_update_of_fp32_weights():
    # GRPO's colocated generator: fp32 weights, bf16 autocast, an optimizer updating in place
    model = tiny_model(device="cuda")
    graphs = DecodeGraphs()
    for step in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            graphed, eager = _both(model, graphs, temperature=0.0)
        assert_same(graphed, eager, atol=1e-3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.5)
    assert graphs.captures == 1


@pytest.mark.gpu
@cuda
def test_the_rollout_engine_graphs_its_decode_and_sees_new_weights():
    from meshtrain.services.rollout.engine import RolloutEngine
    from meshtrain.services.rollout.types import RolloutRequest, SamplingParams

    request = RolloutRequest(PROMPTS[:3], group_size=2, sampling=SamplingParams(max_new_tokens=12))
    graphed = RolloutEngine(tiny_model(0, device="cuda"), eod_id=0, cuda_graphs=True)
    eager = RolloutEngine(tiny_model(0, device="cuda"), eod_id=0, cuda_graphs=False)
    for version, seed in ((0, 0), (1, 1)):
        new = {n: p.detach().clone() for n, p in tiny_model(seed).named_parameters()}
        graphed.set_weights(new, version)
        eager.set_weights(new, version)
        got, want = graphed.generate(request), eager.generate(request)
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert graphed.graphs.captures == 1 and eager.graphs.captures == 0
