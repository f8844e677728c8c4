"""Pipeline schedules as data: every schedule validates where allowed (and is refused where not),
validate() catches broken schedules by rank and action, simulated bubbles match the closed forms,
activation memory (micro-batch-chunks in flight) is bounded, and build() is pure."""

import pytest

from meshtrain.services.trainer.parallel.pipeline import schedules as S
from meshtrain.services.trainer.parallel.pipeline.schedules import Action, ScheduleError

PPS = (1, 2, 3, 4, 8)
ZB_COST = {"F": 1.0, "I": 1.0, "W": 1.0}  # zero-bubble costs: B = I + W = 2, as 1F1B's default


def micros(pp):
    return sorted({1, 2, 3, pp, pp + 1, 2 * pp, 3 * pp + 1})


def allowed(name, pp, m, v):
    """The combinations build() accepts (everything else must raise ScheduleError)."""
    if v > 1 and (pp == 1 or name in ("gpipe", "1f1b", "zb-h1")):
        return False
    return not (name == "interleaved" and v > 1 and m % pp)


CASES = [
    (n, pp, m, v)
    for n in S.SCHEDULES
    for pp in PPS
    for m in micros(pp)
    for v in ((1, 2, 3) if n in ("none", "interleaved") else (1, 2))
]


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_every_schedule_validates_where_allowed_and_is_refused_elsewhere(name, pp, m, v):
    if not allowed(name, pp, m, v):
        with pytest.raises(ScheduleError):
            S.build(name, pp, m, v)
        return
    sched = S.build(name, pp, m, v)
    S.validate(sched, pp, m, v)
    assert len(sched) == pp
    computes = [a for rank in sched for a in rank if not a.is_comm]
    back = "I" if name == "zb-h1" else "B"
    assert (
        sum(a.kind == "F" for a in computes) == sum(a.kind == back for a in computes) == pp * v * m
    )


def test_refusals_name_the_requirement():
    with pytest.raises(ScheduleError, match="multiple of pp"):
        S.build("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="pp >= 2"):
        S.build("interleaved", 1, 4, 2)
    with pytest.raises(ScheduleError, match="virtual=1"):
        S.build("zb-h1", 2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown"):
        S.build("dualpipe", 2, 4)
    assert S.build("interleaved", 4, 6, 1) == S.build("1f1b", 4, 6)


# ---- validate() on hand-broken schedules -------------------------------------------------------


def test_validate_catches_swapped_send_order():
    sched = S.build("gpipe", 2, 2)
    r0 = sched[0]
    i, j = r0.index(Action("SEND_F", 0, 0)), r0.index(Action("SEND_F", 1, 0))
    r0[i], r0[j] = r0[j], r0[i]  # SEND_F1 first: F1 runs after its send now, so swap F's too
    i, j = r0.index(Action("F", 0, 0)), r0.index(Action("F", 1, 0))
    r0[i], r0[j] = r0[j], r0[i]
    with pytest.raises(
        ScheduleError, match=r"rank 0: message #0 to rank 1 is SEND_F1\.0 .*RECV_F0\.0"
    ):
        S.validate(sched, 2, 2)


def test_validate_catches_missing_recv():
    sched = S.build("1f1b", 3, 3)
    sched[2].remove(Action("RECV_F", 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 2: missing RECV_F1\.0"):
        S.validate(sched, 3, 3)


def test_validate_catches_deadlock_of_two_ranks_receiving_first():
    sched = S.build("1f1b", 2, 1)  # rank 0: F SEND_F RECV_B B; rank 1: RECV_F F B SEND_B
    r0 = sched[0]
    r0.remove(Action("RECV_B", 0, 0))
    r0.insert(0, Action("RECV_B", 0, 0))  # rank 0 waits for the gradient before its forward
    with pytest.raises(
        ScheduleError, match=r"deadlock: rank 0 waits at RECV_B0\.0.*rank 1 waits at RECV_F0\.0"
    ):
        S.validate(sched, 2, 1)
    with pytest.raises(
        ScheduleError, match=r"deadlock: rank 0 waits at RECV_B0\.0.*rank 1 waits at RECV_F0\.0"
    ):
        S.simulate(sched, 2)


def test_validate_catches_duplicated_forward():
    sched = S.build("gpipe", 2, 3)
    sched[1].insert(sched[1].index(Action("F", 2, 0)), Action("F", 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 1: duplicate F1\.0"):
        S.validate(sched, 2, 3)


def test_validate_catches_w_before_its_i():
    sched = S.build("zb-h1", 2, 2)
    r0 = sched[0]
    r0.remove(Action("W", 0, 0))
    r0.insert(r0.index(Action("I", 0, 0)), Action("W", 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0: W0\.0 runs before I0\.0"):
        S.validate(sched, 2, 2)


def test_validate_catches_compute_before_its_recv_and_extra_comm():
    sched = S.build("1f1b", 2, 4)
    r1 = sched[1]
    i, j = r1.index(Action("RECV_F", 3, 0)), r1.index(Action("F", 3, 0))
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(ScheduleError, match=r"rank 1: F3\.0 runs before RECV_F3\.0"):
        S.validate(sched, 2, 4)
    sched = S.build("1f1b", 2, 4)
    sched[0].insert(0, Action("RECV_F", 0, 0))  # stage 0 reads tokens, receives nothing
    with pytest.raises(ScheduleError, match=r"rank 0: unexpected RECV_F0\.0"):
        S.validate(sched, 2, 4)


# ---- simulated bubbles (comm free; F=1, B=2 or F=I=W=1) ---------------------------------------


@pytest.mark.parametrize("pp", PPS)
def test_1f1b_bubble_is_the_closed_form(pp):
    # makespan = (m + p - 1) * (F + B) = 3 (m + p - 1); each rank computes 3m, so its idle
    # fraction is exactly (p - 1) / (m + p - 1) on every rank
    for m in micros(pp):
        tl = S.simulate(S.build("1f1b", pp, m), pp)
        assert max(e for rank in tl for _, _, e in rank) == pytest.approx(3 * (m + pp - 1))
        assert S.bubble_fraction(tl) == pytest.approx([(pp - 1) / (m + pp - 1)] * pp, abs=1e-12)


@pytest.mark.parametrize("pp", (2, 3, 4, 8))
@pytest.mark.parametrize("v", (2, 3))
def test_interleaved_bubble_is_the_closed_form(pp, v):
    # per chunk F=1, B=2: each rank computes 3vm; the bubble is still (p - 1)(F + B) = 3(p - 1),
    # so makespan = 3(vm + p - 1) and the idle fraction is (p - 1) / (vm + p - 1), v times less
    for m in (pp, 2 * pp, 3 * pp):
        tl = S.simulate(S.build("interleaved", pp, m, v), pp, v)
        assert max(e for rank in tl for _, _, e in rank) == pytest.approx(3 * (v * m + pp - 1))
        assert S.bubble_fraction(tl) == pytest.approx([(pp - 1) / (v * m + pp - 1)] * pp, abs=1e-12)


@pytest.mark.parametrize("pp", PPS)
def test_zb_h1_bubble_is_at_most_half_of_1f1b(pp):
    # ZB-H1 (F=I=W=1): bubble (p - 1)(F + I - W) = p - 1, makespan 3m + p - 1, idle fraction
    # exactly (p - 1) / (3m + p - 1) for m >= p -- at most half 1F1B's (p - 1) / (m + p - 1)
    # whenever m >= p - 1. (For m < p the F/I chain alone is 2p long; that halving cannot hold.)
    for m in (x for x in micros(pp) if x >= pp):
        zb = S.bubble_fraction(S.simulate(S.build("zb-h1", pp, m), pp, cost=ZB_COST))
        ref = S.bubble_fraction(S.simulate(S.build("1f1b", pp, m), pp))
        assert zb == pytest.approx([(pp - 1) / (3 * m + pp - 1)] * pp, abs=1e-12)
        assert max(zb) <= 0.5 * min(ref) + 1e-12


def test_none_runs_one_micro_batch_at_a_time():
    pp, m = 4, 3
    tl = S.simulate(S.build("none", pp, m), pp)
    assert max(e for rank in tl for _, _, e in rank) == pytest.approx(m * pp * 3)
    assert S.bubble_fraction(tl) == pytest.approx([1 - 1 / pp] * pp)


# ---- activation memory on rank 0 ---------------------------------------------------------------


@pytest.mark.parametrize("pp", PPS)
def test_peak_in_flight_on_rank_0(pp):
    for m in micros(pp):
        assert S.peak_in_flight(S.build("1f1b", pp, m)[0]) == min(m, pp)
        assert S.peak_in_flight(S.build("gpipe", pp, m)[0]) == m
        assert S.peak_in_flight(S.build("zb-h1", pp, m)[0]) == min(m, pp)
        assert max(S.peak_in_flight(r) for r in S.build("zb-h1", pp, m)) <= pp
        for v in (2, 3):
            if allowed("interleaved", pp, m, v):
                # Megatron's rank 0: 2(p - 1) + (v - 1)p warm-up forwards, plus one in steady state
                peak = min(v * m, 2 * (pp - 1) + (v - 1) * pp + 1)
                assert S.peak_in_flight(S.build("interleaved", pp, m, v)[0]) == peak


def test_peak_in_flight_counts_w_as_the_last_backward():
    acts = [
        Action("F", 0, 0),
        Action("F", 1, 0),
        Action("I", 0, 0),
        Action("F", 2, 0),
        Action("W", 0, 0),
        Action("B", 1, 0),
    ]
    assert S.peak_in_flight(acts) == 3


# ---- purity --------------------------------------------------------------------------------------


def test_build_is_deterministic():
    for name, pp, m, v in [
        ("1f1b", 4, 9, 1),
        ("interleaved", 4, 8, 2),
        ("zb-h1", 8, 17, 1),
        ("gpipe", 3, 5, 1),
        ("none", 2, 3, 2),
    ]:
        a, b = S.build(name, pp, m, v), S.build(name, pp, m, v)
        assert a == b and a is not b
        assert [[str(x) for x in r] for r in a] == [[str(x) for x in r] for r in b]
    assert str(Action("F", 3, 1)) == "F3.1" and str(Action("SEND_B", 0, 0)) == "SEND_B0.0"
