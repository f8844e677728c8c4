"""Megatron-LM's decay styles: WSD (warmup-stable-decay) with its four anneal shapes, inverse square
root, and the warmup as a fraction of the decay length."""

import math

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.optim.schedule import lr_at, warmup_iters

# The anneal's share of (lr - min_lr) at progress p through it (Megatron's formulas).
ANNEAL = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "exponential": lambda p: 2 * 0.5**p - 1,
    "minus_sqrt": lambda p: 1 - math.sqrt(p),
}


@pytest.mark.parametrize("style", sorted(ANNEAL))
def test_wsd_warms_up_holds_then_anneals_to_min_lr(style):
    # warmup 10, stable until step 80, anneal over the last 20 of 100 decay steps, flat after
    c = OptimConfig(
        lr=2.0,
        min_lr=0.5,
        lr_warmup_iters=10,
        lr_decay_style="wsd",
        lr_wsd_decay_style=style,
        lr_wsd_decay_iters=20,
        lr_decay_iters=100,
    )
    assert lr_at(0, c, 150) == pytest.approx(0.2)  # warmup as with every style
    assert [lr_at(s, c, 150) for s in (10, 50, 80)] == [2.0, 2.0, 2.0]
    for step in (81, 85, 90, 99):
        want = 0.5 + ANNEAL[style]((step - 80) / 20) * 1.5
        assert lr_at(step, c, 150) == pytest.approx(want, rel=1e-12)
    assert lr_at(100, c, 150) == pytest.approx(0.5) and lr_at(149, c, 150) == 0.5
    values = [lr_at(s, c, 150) for s in range(10, 150)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_decays_over_train_iters_when_no_decay_length_is_set():
    c = OptimConfig(
        lr=1.0, min_lr=0.0, lr_decay_style="wsd", lr_wsd_decay_style="linear", lr_wsd_decay_iters=4
    )
    assert [lr_at(s, c, 10) for s in range(11)] == pytest.approx(
        [1, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0]
    )


def test_wsd_is_checked():
    with pytest.raises(ConfigError, match="needs optim.lr_wsd_decay_iters"):
        OptimConfig(lr_decay_style="wsd")
    with pytest.raises(
        ConfigError, match="lr_wsd_decay_iters applies to lr_decay_style='wsd', not 'cosine'"
    ):
        OptimConfig(lr_wsd_decay_iters=5)
    with pytest.raises(
        ConfigError, match="lr_wsd_decay_iters=50 is longer than the decay after warmup"
    ):
        lr_at(20, OptimConfig(lr_decay_style="wsd", lr_wsd_decay_iters=50, lr_warmup_iters=10), 40)


def test_inverse_square_root_falls_from_the_warmup_end_and_stops_at_min_lr():
    c = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4, lr_decay_style="inverse-square-root")
    assert lr_at(3, c, 1000) == pytest.approx(1.0)
    assert lr_at(16, c, 1000) == pytest.approx(0.5)  # sqrt(4 / 16)
    assert lr_at(64, c, 1000) == pytest.approx(0.25)
    assert lr_at(900, c, 1000) == pytest.approx(0.1)  # sqrt(4/900) = 0.067, held at min_lr


def test_warmup_fraction_is_of_the_decay_length():
    c = OptimConfig(lr=1.0, min_lr=0.0, lr_warmup_fraction=0.1, lr_decay_iters=200)
    assert warmup_iters(c, 1000) == 20
    assert lr_at(9, c, 1000) == pytest.approx(0.5)
    assert lr_at(19, c, 1000) == pytest.approx(1.0)
    assert (
        warmup_iters(OptimConfig(lr_warmup_fraction=0.25), 10) == 2
    )  # of train_iters, rounded down
    with pytest.raises(ConfigError, match=r"lr_warmup_fraction must be in \[0, 1\)"):
        OptimConfig(lr_warmup_fraction=1.5)
