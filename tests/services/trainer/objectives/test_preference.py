"""The preference losses against a hand computation and against TRL's own code.

Float64 throughout: the comparisons are of formulas, so the tolerances are round-off (1e-10).
TRL 1.x has no standalone `dpo_loss`: its `DPOTrainer._compute_loss` is called on a stand-in
trainer whose model returns the given per-token log-probs, so the loss TRL computes is the one
its training would. TRL's `sigmoid` no longer takes label smoothing; conservative DPO is
compared with its `aot` loss on one pair (sorting one value changes nothing, and `aot` is then
TRL 0.x's smoothed sigmoid), and SimPO with `CPOTrainer.cpo_loss` (loss_type 'simpo').
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from meshtrain.services.trainer.objectives.preference import (
    DPOLoss,
    SequenceLogps,
    finish_stats,
    preference_loss,
    sequence_sums,
)


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _batch(pairs=5, seq=9, seed=0):
    """Per-token log-probs (policy and reference) and completion masks of `pairs` pairs, laid
    out [chosen..., rejected...]; column 0 is prompt, as in TRL's completion_mask."""
    g = torch.Generator().manual_seed(seed)
    tok = -torch.rand(2 * pairs, seq, generator=g) * 3
    ref = -torch.rand(2 * pairs, seq, generator=g) * 3
    start = torch.randint(1, seq // 2, (2 * pairs, 1), generator=g)
    end = torch.randint(seq // 2 + 1, seq + 1, (2 * pairs, 1), generator=g)
    cols = torch.arange(seq)
    mask = ((cols >= start) & (cols < end)).double()
    return tok, ref, mask


def _ours(tok, ref, mask, loss):
    tok = tok.clone().requires_grad_()
    logps, counts = sequence_sums(tok, mask)
    rlogps, _ = sequence_sums(ref, mask)
    value, stats = preference_loss(
        SequenceLogps.from_sequences(logps, counts),
        SequenceLogps.from_sequences(rlogps, counts) if loss.uses_reference else None,
        loss,
    )
    value.backward()
    return value.item(), tok.grad, finish_stats(stats)


def _by_hand(tok, ref, mask, loss):
    """Loss and d loss / d token log-prob, pair by pair in plain floats."""
    n = tok.shape[0] // 2
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    beta, e = loss.beta, loss.label_smoothing
    total, grad = 0.0, torch.zeros_like(tok)
    for i in range(n):
        c, r = i, n + i
        pc, pr = float((tok[c] * mask[c]).sum()), float((tok[r] * mask[r]).sum())
        rc, rr = float((ref[c] * mask[c]).sum()), float((ref[r] * mask[r]).sum())
        nc, nr = float(mask[c].sum()), float(mask[r].sum())
        if loss.loss_type == "sigmoid":
            d = (pc - rc) - (pr - rr)
            total += -(1 - e) * math.log(s(beta * d)) - e * math.log(s(-beta * d))
            dd = -(1 - e) * beta * s(-beta * d) + e * beta * s(beta * d)
            gc, gr = dd, -dd
        elif loss.loss_type == "ipo":
            d = (pc - rc) / nc - (pr - rr) / nr
            total += (d - 1 / (2 * beta)) ** 2
            dd = 2 * (d - 1 / (2 * beta))
            gc, gr = dd / nc, -dd / nr
        else:
            d = pc / nc - pr / nr - loss.simpo_gamma / beta
            total += -(1 - e) * math.log(s(beta * d)) - e * math.log(s(-beta * d))
            dd = -(1 - e) * beta * s(-beta * d) + e * beta * s(beta * d)
            gc, gr = dd / nc, -dd / nr
        grad[c] = gc * mask[c] / n
        grad[r] = gr * mask[r] / n
    return total / n, grad


LOSSES = [
    DPOLoss("sigmoid", beta=0.1),
    DPOLoss("sigmoid", beta=0.5, label_smoothing=0.2),
    DPOLoss("ipo", beta=0.3),
    DPOLoss("simpo", beta=2.0, simpo_gamma=0.7),
    DPOLoss("simpo", beta=2.5, simpo_gamma=0.3, label_smoothing=0.1),
]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda x: f"{x.loss_type}-{x.label_smoothing}")
def test_loss_and_gradient_match_a_hand_computation(loss):
    tok, ref, mask = _batch()
    value, grad, _ = _ours(tok, ref, mask, loss)
    want, want_grad = _by_hand(tok, ref, mask, loss)
    assert value == pytest.approx(want, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_metrics_are_trl_definitions():
    tok, ref, mask = _batch(pairs=6, seed=3)
    loss = DPOLoss("sigmoid", beta=0.2)
    _, _, stats = _ours(tok, ref, mask, loss)
    logps = (tok * mask).sum(1)
    rlogps = (ref * mask).sum(1)
    rc = 0.2 * (logps[:6] - rlogps[:6])
    rr = 0.2 * (logps[6:] - rlogps[6:])
    assert stats["rewards/chosen"] == pytest.approx(rc.mean().item())
    assert stats["rewards/rejected"] == pytest.approx(rr.mean().item())
    assert stats["rewards/margins"] == pytest.approx((rc - rr).mean().item())
    assert stats["rewards/accuracies"] == pytest.approx((rc > rr).double().mean().item())
    assert 0 < stats["rewards/accuracies"] < 1  # the batch has both kinds: the count is tested
    assert stats["logps/chosen"] == pytest.approx(logps[:6].mean().item())


def test_reference_losses_refuse_a_missing_reference():
    tok, _, mask = _batch()
    logps, counts = sequence_sums(tok, mask)
    with pytest.raises(ValueError, match="reference"):
        preference_loss(SequenceLogps.from_sequences(logps, counts), None, DPOLoss("ipo"))
    with pytest.raises(ValueError, match="loss_type"):
        DPOLoss("kto")


# ---------------------------------------------------------------- TRL's code


def _trl_dpo(tok, ref, mask, loss_type, beta, label_smoothing=0.0):
    """TRL's DPOTrainer._compute_loss on a stand-in trainer and model: (loss, d loss / d tok)."""
    trl = pytest.importorskip("trl")
    tok = tok.clone().requires_grad_()
    n = tok.shape[0] // 2
    # TRL's inputs are whole sequences: column 0 (a prompt token) is never a label
    full_mask = torch.cat([torch.zeros(2 * n, 1), mask], dim=1)
    per_token = tok * mask  # what a causal LM returns under labels -100 outside the completion
    zeros = torch.zeros_like(mask)
    outputs = SimpleNamespace(
        log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
    )
    metrics: dict = defaultdict(lambda: defaultdict(list))
    accel = SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x
    )
    rlogps = (ref * mask).sum(1)
    stand_in = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=accel,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics=metrics,
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(),
    )
    inputs = {
        "input_ids": torch.zeros(2 * n, mask.shape[1] + 1, dtype=torch.long),
        "attention_mask": torch.ones(2 * n, mask.shape[1] + 1, dtype=torch.long),
        "completion_mask": full_mask.long(),
        "ref_chosen_logps": rlogps[:n],
        "ref_rejected_logps": rlogps[n:],
    }
    value = trl.DPOTrainer._compute_loss(stand_in, lambda **kw: outputs, inputs, False)
    value.backward()
    return value.item(), tok.grad, metrics["train"]


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 0.7), ("ipo", 0.3)])
def test_equals_trl_dpo_trainer(loss_type, beta):
    tok, ref, mask = _batch(pairs=4, seed=7)
    value, grad, stats = _ours(tok, ref, mask, DPOLoss(loss_type, beta=beta))
    want, want_grad, trl_metrics = _trl_dpo(tok, ref, mask, loss_type, beta)
    assert value == pytest.approx(want, rel=1e-10)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        # the statistics are kept in fp32 (summed over micro-batches and ranks)
        assert stats[name] == pytest.approx(trl_metrics[name][0], rel=1e-6), name


def test_conservative_dpo_equals_trl_smoothed_sigmoid():
    """TRL's `aot` on one pair is -(1-e) log s(beta d) - e log s(-beta d)."""
    for seed in range(3):
        tok, ref, mask = _batch(pairs=1, seed=seed)
        value, grad, _ = _ours(tok, ref, mask, DPOLoss("sigmoid", beta=0.4, label_smoothing=0.15))
        want, want_grad, _ = _trl_dpo(tok, ref, mask, "aot", 0.4, label_smoothing=0.15)
        assert value == pytest.approx(want, rel=1e-10)
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_equals_trl_cpo_trainer(smoothing):
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer

    tok, ref, mask = _batch(pairs=4, seed=11)
    loss = DPOLoss("simpo", beta=2.0, simpo_gamma=0.6, label_smoothing=smoothing)
    value, grad, stats = _ours(tok, ref, mask, loss)
    # CPOTrainer feeds cpo_loss length-normalized log-probs for SimPO
    t = tok.clone().requires_grad_()
    avg = (t * mask).sum(1) / mask.sum(1)
    stand_in = SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=0.6,
        beta=2.0,
        label_smoothing=smoothing,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(stand_in, avg[:4], avg[4:])
    losses.mean().backward()
    assert value == pytest.approx(losses.mean().item(), rel=1e-10)
    torch.testing.assert_close(grad, t.grad, rtol=1e-10, atol=1e-12)
    assert stats["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), rel=1e-6)
    assert stats["rewards/rejected"] == pytest.approx(rejected_rewards.mean().item(), rel=1e-6)
