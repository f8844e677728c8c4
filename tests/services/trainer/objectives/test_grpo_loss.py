"""The GRPO loss and advantages against a hand computation and against TRL's own code.

Float64 throughout: the comparisons are of formulas, so the tolerances are round-off. TRL's
`GRPOTrainer._compute_loss` runs on a stand-in trainer whose log-prob function returns the given
per-token log-probs, so the loss TRL computes is the one its training would: our token-mean is
its `dapo` (normalized by the batch's completion tokens), sequence-mean its `grpo`,
sequence-sum-norm its `dr_grpo`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from meshtrain.services.trainer.objectives.grpo import (
    GRPOLoss,
    finish_loss_stats,
    group_advantages,
    grpo_loss,
)

TRL_NAMES = {"token-mean": "dapo", "sequence-mean": "grpo", "sequence-sum-norm": "dr_grpo"}


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _batch(n=6, seq=7, seed=0):
    """Per-token log-probs (policy, old, reference), advantages and completion masks; the old
    log-probs are near the policy's so some ratios fall inside the clip range and some out."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, seq, generator=g) * 2
    old = logps + (torch.rand(n, seq, generator=g) - 0.5) * 0.8
    ref = logps + (torch.rand(n, seq, generator=g) - 0.5)
    adv = torch.randn(n, generator=g)
    lengths = torch.randint(1, seq + 1, (n, 1), generator=g)
    mask = (torch.arange(seq) < lengths).double()
    return logps, old, ref, adv, mask


def _ours(logps, old, ref, adv, mask, loss):
    x = logps.clone().requires_grad_()
    n = mask.shape[0]
    denominator = {
        "token-mean": mask.sum().item(),
        "sequence-mean": n,
        "sequence-sum-norm": n * loss.max_new_tokens,
    }[loss.loss_type]
    value, stats = grpo_loss(x, old, ref if loss.beta else None, adv, mask, loss, 1 / denominator)
    value.backward()
    return value.item(), x.grad, finish_loss_stats(stats, loss.beta)


def _by_hand(logps, old, ref, adv, mask, loss):
    """Loss and d loss / d log-prob token by token in plain floats."""
    n, s = logps.shape
    lo, hi = 1 - loss.epsilon, 1 + loss.eps_high
    per = [[0.0] * s for _ in range(n)]
    grad = torch.zeros(n, s)
    for i in range(n):
        a = float(adv[i])
        for t in range(s):
            if not mask[i, t]:
                continue
            r = math.exp(float(logps[i, t] - old[i, t]))
            c = min(max(r, lo), hi)
            # -min(r a, c a): the unclipped term carries the gradient r a when it is the smaller
            if r * a <= c * a:
                per[i][t], g = -r * a, -r * a
            else:
                per[i][t], g = -c * a, 0.0
            if loss.beta:
                d = float(ref[i, t] - logps[i, t])
                per[i][t] += loss.beta * (math.exp(d) - d - 1)
                g += loss.beta * (1 - math.exp(d))
            grad[i, t] = g
    counts = [float(mask[i].sum()) for i in range(n)]
    if loss.loss_type == "token-mean":
        total = sum(map(sum, per)) / sum(counts)
        grad /= sum(counts)
    elif loss.loss_type == "sequence-mean":
        total = sum(sum(per[i]) / counts[i] for i in range(n)) / n
        grad /= torch.tensor(counts)[:, None] * n
    else:
        total = sum(map(sum, per)) / (n * loss.max_new_tokens)
        grad /= n * loss.max_new_tokens
    return total, grad


LOSSES = [
    GRPOLoss(beta=0.0, epsilon=0.2, loss_type="token-mean", max_new_tokens=7),
    GRPOLoss(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type="token-mean", max_new_tokens=7),
    GRPOLoss(beta=0.1, epsilon=0.1, loss_type="sequence-mean", max_new_tokens=7),
    GRPOLoss(
        beta=0.0, epsilon=0.3, epsilon_high=0.4, loss_type="sequence-sum-norm", max_new_tokens=9
    ),
]


def _id(loss):
    return f"{loss.loss_type}-b{loss.beta}-e{loss.epsilon}-{loss.eps_high}"


@pytest.mark.parametrize("loss", LOSSES, ids=_id)
def test_loss_and_gradient_match_a_hand_computation(loss):
    batch = _batch()
    value, grad, _ = _ours(*batch, loss)
    want, want_grad = _by_hand(*batch, loss)
    assert value == pytest.approx(want, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert grad.abs().sum() > 0 and (grad == 0).any()  # both clipped and live tokens


def test_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0, 1.0, 1.0])
    a = group_advantages(r, 4, "group")
    g1 = [1.0, 0.0, 0.5, 0.5]
    mean = sum(g1) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in g1) / 3)  # sample std, as TRL
    assert a[0].item() == pytest.approx((1.0 - mean) / (std + 1e-4))
    assert a[:4].sum().item() == pytest.approx(0.0, abs=1e-12)
    assert group_advantages(r, 4, "none")[4].item() == pytest.approx(2.0 - 1.0)
    batch_std = r.std().item()
    assert group_advantages(r, 4, "batch")[4].item() == pytest.approx(1.0 / (batch_std + 1e-4))
    # a group whose completions all score the same carries no signal
    assert group_advantages(torch.ones(4), 4).abs().max().item() == 0.0


# ---------------------------------------------------------------- TRL's code


def _trl_grpo(logps, old, ref, adv, mask, loss):
    trl = pytest.importorskip("trl")
    x = logps.clone().requires_grad_()
    n, seq = mask.shape
    metrics: dict = defaultdict(lambda: defaultdict(list))
    accel = SimpleNamespace(
        num_processes=1,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        reduce=lambda t, reduction="sum": t,
    )
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (x, torch.zeros_like(x), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=loss.beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type=TRL_NAMES[loss.loss_type],
        epsilon_low=loss.epsilon,
        epsilon_high=loss.eps_high,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=loss.max_new_tokens,
        accelerator=accel,
        _metrics=metrics,
        _entropy_bonus_enabled=False,
    )
    stand_in.args.steps_per_generation = 1
    inputs = {
        "prompt_ids": torch.zeros(n, 2, dtype=torch.long),
        "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.zeros(n, seq, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    value = trl.GRPOTrainer._compute_loss(stand_in, None, inputs)
    value.backward()
    return value.item(), x.grad, metrics["train"]


@pytest.mark.parametrize("loss", LOSSES, ids=_id)
def test_equals_trl_grpo_trainer(loss):
    batch = _batch(n=5, seq=8, seed=3)
    value, grad, stats = _ours(*batch, loss)
    want, want_grad, trl_metrics = _trl_grpo(*batch, loss)
    assert value == pytest.approx(want, rel=1e-10)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert stats[name] == pytest.approx(trl_metrics[name][0], rel=1e-6), name
    assert stats["clip_ratio/region_mean"] > 0 or loss.epsilon > 0.2  # clipping was compared
    if loss.beta:
        assert stats["kl"] == pytest.approx(trl_metrics["kl"][0], rel=1e-6)


def test_num_iterations_one_is_ratio_one():
    """With the old log-probs the policy's own (detached), the loss is -A per token and its
    gradient -A / tokens: the plain policy gradient."""
    logps, _, _, adv, mask = _batch(seed=5)
    loss = GRPOLoss(loss_type="token-mean")
    value, grad, _ = _ours(logps, logps, None, adv, mask, loss)
    tokens = mask.sum()
    assert value == pytest.approx(-(adv[:, None] * mask).sum().item() / tokens.item())
    torch.testing.assert_close(grad, -adv[:, None] * mask / tokens)
