"""GRPO's pieces around the loss: the prompts' order, the reward functions, the colocated
generator's completions and log-probs."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain.services.common.errors import ConfigError, DataError
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.rollout.types import RolloutRequest, SamplingParams
from meshtrain.services.trainer.objectives.prompts import PromptSet
from meshtrain.services.trainer.objectives.rewards import (
    Rewards,
    digits_only,
    exact_answer,
    load_reward_func,
)
from meshtrain.services.trainer.objectives.rollouts import ColocatedBackend
from tests.services.trainer.model.test_gpt import LLAMA, build


def _prompts(path, n):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(n)]
    rows.append({"messages": [{"role": "user", "content": "hi"}], "answer": "x"})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return PromptSet.read(path, build_tokenizer("byte"), "chatml", seed=5)


def test_prompt_order_is_a_pure_function_split_over_ranks(tmp_path):
    ps = _prompts(tmp_path / "p.jsonl", 10)  # 11 prompts
    assert ps.prompts[0].columns == {"answer": "0"} and ps.prompts[0].text == "q0"
    assert ps.prompts[-1].text.endswith("assistant\n")  # chatml, generation prompt opened
    for k in range(6):  # across epoch boundaries too
        whole = ps.indices(k, 4, 0, 1)
        assert ps.indices(k, 4, 0, 2) + ps.indices(k, 4, 1, 2) == whole
        again = _prompts(tmp_path / "q.jsonl", 10)
        assert again.indices(k, 4, 0, 1) == whole  # a fresh reader (a resumed run) agrees
    epoch0 = [i for k in range(11) for i in ps.indices(k, 1, 0, 1)]
    assert sorted(epoch0) == list(range(11)) and epoch0 != list(range(11))


def test_prompt_rows_are_checked(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": 1}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: a row needs exactly one"):
        PromptSet.read(bad, build_tokenizer("byte"), "auto", 0)


def test_rewards():
    assert exact_answer("1+2=", " 3 ", answer="3") == 1.0
    assert exact_answer("1+2=", "3 apples", answer="3") == 0.5
    assert exact_answer("1+2=", "4", answer="3") == 0.0
    assert digits_only("", "12") == 1.0 and digits_only("", "1a") == 0.0
    r = Rewards.load(
        [
            "meshtrain.services.trainer.objectives.rewards:exact_answer",
            "meshtrain.services.trainer.objectives.rewards:digits_only",
        ],
        [1.0, 0.5],
    )
    scores = r.score("1+2=", "3", {"answer": 3})
    assert scores == [1.0, 1.0] and r.total(scores) == 1.5
    with pytest.raises(ConfigError, match="has no function"):
        load_reward_func("meshtrain.services.trainer.objectives.rewards:nothing")
    bad = Rewards([lambda **k: "high"], ["bad"], [1.0])
    with pytest.raises(ValueError, match="bad returned 'high'"):
        bad.score("", "", {})


def test_colocated_completions_are_seeded_and_carry_the_policys_logprobs():
    torch.manual_seed(0)
    model = build(**LLAMA)
    backend = ColocatedBackend(model, eod_id=7, device=torch.device("cpu"))
    backend.update_weights(3)
    request = RolloutRequest(
        [[1, 2, 3], [4, 5]], group_size=3, sampling=SamplingParams(6, temperature=1.0, seed=11)
    )
    out = backend.generate(request)
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    assert all(c.policy_version == 3 for c in out)
    assert [c.tokens for c in out] == [c.tokens for c in backend.generate(request)]
    # prompt 1 alone with seed 12 is what it was as prompt 1 of the request (seed 11 + 1)
    alone = RolloutRequest([[4, 5]], 3, SamplingParams(6, temperature=1.0, seed=12))
    assert [c.tokens for c in backend.generate(alone)] == [c.tokens for c in out[3:]]
    assert len({tuple(c.tokens) for c in out}) > 2  # sampled, not greedy
    prompts = request.prompts
    with torch.no_grad():
        for c in out:
            ids = torch.tensor([prompts[c.prompt_index] + c.tokens])
            logps = model(ids)[0, :, :301].float().log_softmax(-1)  # the training forward
            p = len(prompts[c.prompt_index])
            want = [logps[p - 1 + j, t].item() for j, t in enumerate(c.tokens)]
            assert c.logprobs == pytest.approx(want, abs=1e-5)
            assert c.finished == (c.tokens[-1] == 7) and (c.finished or len(c.tokens) == 6)


def test_colocated_batches_give_the_same_completions_and_rows_stop_at_the_context():
    """The step's groups are sampled as one batch or in chunks of rollout_max_batch: the same
    tokens either way (the log-probs to rounding: another batch pads rows differently, which
    changes the shapes the matmuls are summed in). A prompt near the end of the model's 32
    positions draws only what fits, and its batch-mates still draw their full max_new_tokens."""
    model = build(**LLAMA)
    cpu = torch.device("cpu")
    long = list(range(1, 30))  # 29 tokens: 32 + 1 - 29 = 4 tokens fit
    request = RolloutRequest(
        [[1, 2, 3], long, [4, 5]], group_size=3, sampling=SamplingParams(8, seed=3)
    )
    whole = ColocatedBackend(model, eod_id=300, device=cpu).generate(request)
    fits = [8] * 3 + [4] * 3 + [8] * 3
    for c, n in zip(whole, fits, strict=True):
        assert len(c.tokens) == n if not c.finished else len(c.tokens) <= n
    assert 8 in [len(c.tokens) for c in whole] and 4 in [len(c.tokens) for c in whole]
    for max_batch in (1, 4):
        chunks = ColocatedBackend(model, eod_id=300, device=cpu, max_batch=max_batch)
        got = chunks.generate(request)
        assert [c.tokens for c in got] == [c.tokens for c in whole]
        for a, b in zip(got, whole, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    with pytest.raises(ConfigError, match="rollout_max_batch"):
        ColocatedBackend(model, eod_id=300, device=cpu, max_batch=0)
    too_long = RolloutRequest([list(range(1, 34))], 1, SamplingParams(4))
    with pytest.raises(ConfigError, match="33 tokens"):
        ColocatedBackend(model, eod_id=300, device=cpu).generate(too_long)


def test_colocated_sampling_runs_under_the_trainers_autocast():
    """With train.bf16 the trainer's autocast is entered around sampling (the projections then
    run in bf16); without it the fp32 weights sample in fp32."""
    model = build(**LLAMA)
    seen: list[torch.dtype] = []
    hook = model.layers[0].mlp.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    request = RolloutRequest([[1, 2, 3]], 2, SamplingParams(3, seed=1))
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    ColocatedBackend(model, 300, torch.device("cpu"), autocast=bf16).generate(request)
    assert seen and set(seen) == {torch.bfloat16}
    seen.clear()
    ColocatedBackend(model, 300, torch.device("cpu")).generate(request)
    assert set(seen) == {torch.float32}
    hook.remove()


@pytest.mark.parametrize(
    "graphs, tp, enabled", [(True, 1, True), (False, 1, False), (True, 2, False)]
)
def test_the_colocated_backend_graphs_its_decode_unless_turned_off_or_tensor_parallel(
    graphs, tp, enabled
):
    from meshtrain.services.trainer.config.sections import JobConfig
    from meshtrain.services.trainer.objectives.rollouts import rollout_backend

    job = JobConfig()
    job.grpo.rollout_cuda_graphs, job.parallel.tp = graphs, tp
    backend = rollout_backend(job, build(**LLAMA), 300, torch.device("cpu"))
    assert isinstance(backend, ColocatedBackend) and backend.graphs.enabled is enabled
