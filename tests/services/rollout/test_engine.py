"""The rollout engine without a network: padded batches equal prompts alone, log-probs equal the
training forward's, determinism, versions and staleness, weights from a checkpoint and from
streamed chunks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from meshtrain.services.common.errors import InvalidRequestError
from meshtrain.services.rollout.engine import (
    Limits,
    RolloutEngine,
    StaleWeightsError,
    engine_from_checkpoint,
)
from meshtrain.services.rollout.types import RolloutRequest, SamplingParams
from meshtrain.services.rollout.weights import WeightAssembler, tensor_chunks
from meshtrain.services.trainer import batched_sampling
from meshtrain.services.trainer.generate import generate
from tests.services.rollout.helpers import PROMPTS, save_policy, tiny_model

SAMPLING = SamplingParams(max_new_tokens=7, temperature=1.0, seed=3)


@pytest.mark.parametrize("position", ["rope", "learned_absolute"])
def test_a_padded_batch_gives_each_prompt_what_it_gets_alone(position):
    """fp32 on CPU: padded and unpadded matmuls differ only in summation order (1e-5)."""
    engine = RolloutEngine(tiny_model(1, position), eod_id=0)
    batch = engine.generate(RolloutRequest(PROMPTS, 3, SAMPLING))
    assert [c.prompt_index for c in batch] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate(RolloutRequest([prompt], 3, SAMPLING), prompt_offset=i)
        for a, b in zip(batch[3 * i : 3 * i + 3], alone):
            assert a.tokens == b.tokens
            assert a.finished == b.finished
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    # the group's samples differ (own generators), and small batches give the same answer
    assert len({tuple(c.tokens) for c in batch[:3]}) > 1
    small = RolloutEngine(tiny_model(1, position), eod_id=0, limits=Limits(max_batch_rows=2))
    assert [c.tokens for c in small.generate(RolloutRequest(PROMPTS, 3, SAMPLING))] == [
        c.tokens for c in batch
    ]


def test_logprobs_are_the_full_vocabulary_temperature_one_logprobs_of_the_training_forward():
    model = tiny_model(2)
    engine = RolloutEngine(model)
    hot = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, seed=1)
    for c in engine.generate(RolloutRequest(PROMPTS[:3], 2, hot)):
        seq = torch.tensor([PROMPTS[c.prompt_index] + c.tokens])
        with torch.no_grad():
            logits = model.head.logits(model.hidden_states(seq), model.output_weight)
        logp = torch.log_softmax(logits.float(), -1)[0, len(PROMPTS[c.prompt_index]) - 1 : -1]
        want = logp.gather(-1, torch.tensor(c.tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-5)


def test_greedy_matches_the_trainers_kv_cache_generate_and_eod_ends_a_completion():
    model = tiny_model(3)
    engine = RolloutEngine(model)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    out = engine.generate(RolloutRequest(PROMPTS, 1, greedy))
    for c, prompt in zip(out, PROMPTS):
        ref = generate(model, torch.tensor(prompt), 8, temperature=0)[len(prompt) :].tolist()
        assert c.tokens == ref and not c.finished
    eod = out[0].tokens[2]
    stopped = RolloutEngine(model, eod_id=eod).generate(RolloutRequest(PROMPTS[:1], 1, greedy))[0]
    assert stopped.tokens == out[0].tokens[: out[0].tokens.index(eod) + 1] and stopped.finished


def test_rows_end_at_their_first_eod_however_seldom_the_engine_checks(monkeypatch):
    """The engine asks whether every row has ended only every STOP_CHECK steps: rows that end
    earlier keep drawing, and what they draw after their EOD must be dropped."""
    model = tiny_model(5)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=2)
    free = RolloutEngine(model).generate(RolloutRequest(PROMPTS, 2, sampling))
    eod = free[0].tokens[1]
    ends = [c.tokens.index(eod) + 1 if eod in c.tokens else len(c.tokens) for c in free]
    assert len(set(ends)) > 1 and min(ends) < 12  # rows end at different steps
    for every in (1, 3, 64):
        monkeypatch.setattr(batched_sampling, "STOP_CHECK", every)
        got = RolloutEngine(model, eod_id=eod).generate(RolloutRequest(PROMPTS, 2, sampling))
        assert [c.tokens for c in got] == [c.tokens[:n] for c, n in zip(free, ends)]
        assert [c.logprobs for c in got] == [c.logprobs[:n] for c, n in zip(free, ends)]
        assert [c.finished for c in got] == [eod in c.tokens for c in free]


def test_same_request_same_completions_other_seed_other_ones():
    engine = RolloutEngine(tiny_model(4))
    req = RolloutRequest(PROMPTS, 2, SAMPLING)
    assert engine.generate(req) == RolloutEngine(tiny_model(4)).generate(req)
    other = RolloutRequest(PROMPTS, 2, SamplingParams(max_new_tokens=7, seed=4))
    assert [c.tokens for c in engine.generate(other)] != [c.tokens for c in engine.generate(req)]


def test_bounds_are_checked_before_sampling():
    engine = RolloutEngine(tiny_model(0), limits=Limits(max_prompts=2, max_group_size=4))
    bad = [
        (RolloutRequest(PROMPTS, 1), "prompts"),
        (RolloutRequest([[1]], 5), "group_size"),
        (RolloutRequest([[]], 1), r"prompts\[0\]"),
        (RolloutRequest([[1] * 40], 1, SamplingParams(max_new_tokens=10)), "positions"),
    ]
    for request, match in bad:
        with pytest.raises(InvalidRequestError, match=match):
            engine.generate(request)


def test_staleness_waits_for_newer_weights_or_refuses():
    model = tiny_model(0)
    engine = RolloutEngine(model, version=3, limits=Limits(max_wait_s=5))
    with pytest.raises(StaleWeightsError, match="version 3"):
        engine.generate(RolloutRequest([[1, 2]], 1, SAMPLING, min_version=4), wait_s=0.1)
    new = {k: v + 0.01 for k, v in tiny_model(9).state_dict().items()}
    threading.Timer(0.2, engine.set_weights, (new, 4)).start()
    t0 = time.monotonic()
    out = engine.generate(RolloutRequest([[1, 2]], 1, SAMPLING, min_version=4), wait_s=3)
    assert out[0].policy_version == 4 and time.monotonic() - t0 < 3
    with pytest.raises(InvalidRequestError, match="older"):
        engine.set_weights(new, 2)


def test_a_bad_update_leaves_the_weights_untouched():
    engine = RolloutEngine(tiny_model(0), version=1)
    before = engine.generate(RolloutRequest([[1, 2]], 2, SAMPLING))
    state = dict(tiny_model(5).state_dict())
    state["final_norm.weight"] = torch.ones(3)  # one tensor misshapen: nothing is applied
    with pytest.raises(InvalidRequestError, match="final_norm.weight"):
        engine.set_weights(state, 2)
    state.pop("final_norm.weight")
    with pytest.raises(InvalidRequestError, match="missing"):
        engine.set_weights(state, 2)
    assert engine.version == 1
    assert engine.generate(RolloutRequest([[1, 2]], 2, SAMPLING)) == before


def test_streamed_chunks_reassemble_bit_exact_and_refuse_what_the_model_lacks():
    model = tiny_model(0)
    params = dict(model.named_parameters())
    state = {k: v.to(torch.bfloat16) for k, v in tiny_model(6).state_dict().items()}
    asm = WeightAssembler(params, model.vocab_size)
    for name, dtype, shape, offset, data in tensor_chunks(state, 100):
        assert len(data) <= 100
        asm.add(7, name, dtype, shape, offset, data)
    got, version = asm.finish()
    assert version == 7 and all(torch.equal(got[k], state[k]) for k in state)
    asm = WeightAssembler(params, model.vocab_size)
    with pytest.raises(InvalidRequestError, match="no such parameter"):
        asm.add(1, "layers.9.mlp.fc1.weight", "float32", (10**6, 10**6), 0, b"")
    with pytest.raises(InvalidRequestError, match="needs"):
        asm.add(1, "final_norm.weight", "float32", (10**9,), 0, b"")
    asm.add(1, "final_norm.weight", "float32", (32,), 0, b"\0" * 64)
    with pytest.raises(InvalidRequestError, match="64 of its 128 bytes"):
        asm.finish()


def test_a_checkpoint_loads_into_the_worker_and_its_step_is_the_version(tmp_path):
    root = str(tmp_path / "ckpt")
    save_policy(root, 5, seed=11)
    engine = engine_from_checkpoint(root, device="cpu")
    assert engine.version == 5
    want = RolloutEngine(tiny_model(11), version=5)
    req = RolloutRequest(PROMPTS, 2, SAMPLING)
    assert engine.generate(req) == want.generate(req)
    save_policy(root, 6, seed=12)
    engine.load_checkpoint(root, 6)
    assert engine.version == 6
    assert engine.generate(req) == RolloutEngine(tiny_model(12), version=6).generate(req)
