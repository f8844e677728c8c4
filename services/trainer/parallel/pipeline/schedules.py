"""Pipeline schedules as data: per pipeline rank, the ordered list of actions it runs in one step.

A schedule is built by a small pure function (`build`), checked without a model (`validate`),
and timed on a cost model (`simulate`). The runtime executes one rank's list as it is.

Stages. There are `pp` ranks and `v` model chunks per rank ("virtual" stages). Virtual stage
``s = chunk * pp + rank`` (Megatron's interleaving: rank r holds stages r, r+pp, r+2pp, ...).
Stage s sends its forward output to stage s+1, i.e. rank (s+1) % pp, chunk (s+1) // pp.
Stage 0 is the first (embedding, reads tokens); stage pp*v-1 the last (computes the loss).

Actions (`Action(kind, micro, chunk)`; `chunk` is the chunk on the rank running the action):
  F       forward of micro-batch `micro` through `chunk` (with the loss on the last stage);
  B       its full backward (input and weight gradients), or, split for zero-bubble schedules,
  I / W   the input-gradient backward and the weight-gradient backward (W after I, same rank);
  RECV_F  receive F's input activation from the previous stage (iff not the first stage);
  SEND_F  send F's output to the next stage (iff not the last stage);
  RECV_B  receive the gradient w.r.t. the output from the next stage (iff not the last stage);
  SEND_B  send the gradient w.r.t. the input to the previous stage (iff not the first stage).

Communication semantics (what `simulate` and `validate` model, and what the runtime does):
each maximal run of consecutive comm actions in a rank's list is one batch, posted together
(``torch.distributed.batch_isend_irecv``); the rank waits for every op of the batch before its
next compute action. One op completes once its partner is posted on the peer (a rendezvous:
sends are not buffered). Messages between an ordered pair of ranks (src, dst) are matched in
posting order, whatever their kind: the k-th send src->dst is received by dst's k-th recv from
src. With pp=2 "next" and "prev" are the same rank, so activations and gradients share a pair.

Schedules list the compute order per rank; `_with_comms` inserts the comm actions (recv right
before the compute that needs it, send right after the compute that produced it), so that
consecutive comm actions fuse into batches as Megatron fuses send_forward_recv_backward and
send_backward_recv_forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved", "zb-h1")
COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
DEFAULT_COST: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class ScheduleError(ValueError):
    """A schedule that cannot be built for the arguments, or one that is not valid."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule; `chunk` is the model chunk on the rank running it."""

    kind: str
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}.{self.chunk}"

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


Schedule = list[list[Action]]
Timeline = list[list[tuple[Action, float, float]]]


def stage_of(rank: int, chunk: int, pp: int) -> int:
    """The virtual stage of `chunk` on `rank`."""
    return chunk * pp + rank


def peer_of(a: Action, rank: int, pp: int) -> int:
    """The rank a comm action talks to: the next stage's for SEND_F/RECV_B, else the previous's."""
    s = stage_of(rank, a.chunk, pp)
    return (s + 1) % pp if a.kind in ("SEND_F", "RECV_B") else (s - 1) % pp


def _with_comms(
    steps: Sequence[Sequence[tuple[str, int, int]]],
    rank: int,
    pp: int,
    v: int,
    fuse_sends: bool = True,
) -> list[Action]:
    """One rank's actions from its compute order, grouped in steps: before each step one comm batch
    with the sends of the previous step's computes, then the recvs this step's computes need
    (a step of one compute gives "recv right before, send right after"; Megatron's interleaved
    steady state fuses a (forward, backward) pair this way)."""
    last, out = pp * v - 1, []
    for step in steps:
        for kind, m, c in step:
            s = stage_of(rank, c, pp)
            if kind == "F" and s > 0:
                out.append(Action("RECV_F", m, c))
            if kind in ("B", "I") and s < last:
                out.append(Action("RECV_B", m, c))
        sends = []
        for kind, m, c in step:
            out.append(Action(kind, m, c))
            s = stage_of(rank, c, pp)
            if kind == "F" and s < last:
                sends.append(Action("SEND_F", m, c))
            if kind in ("B", "I") and s > 0:
                sends.append(Action("SEND_B", m, c))
            if not fuse_sends:
                out, sends = out + sends, []
        out += sends
    return out


def _interleaved_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """Megatron's forward order of (micro, chunk): micro-batches `group` at a time per chunk."""
    return [(lo + j, c) for lo in range(0, m, group) for c in range(v) for j in range(group)]


Step = tuple[tuple[str, int, int], ...]


def _order(name: str, pp: int, m: int, v: int, r: int) -> list[Step]:
    """Rank r's compute order for schedule `name`, grouped in comm steps (see `_with_comms`)."""
    if name == "none":  # one micro-batch at a time, forward through every stage, then backward
        return [
            ((k, mb, c),)
            for mb in range(m)
            for k, c in [("F", c) for c in range(v)] + [("B", c) for c in reversed(range(v))]
        ]
    if name == "gpipe":  # all forwards, then all backwards
        return [((k, mb, 0),) for k in "FB" for mb in range(m)]
    w = min(pp - r - 1, m)  # 1F1B's warm-up forwards
    if name == "1f1b":  # Megatron's non-interleaved 1F1B
        fb = [k for i in range(m - w) for k in (("F", w + i, 0), ("B", i, 0))]
        return [
            (x,)
            for x in [("F", mb, 0) for mb in range(w)] + fb + [("B", i, 0) for i in range(m - w, m)]
        ]
    if name == "zb-h1":  # 1F1B with B = I + W; rank r defers up to r W's (peak stays pp)
        steps: list[Step] = [(("F", mb, 0),) for mb in range(w)]
        pending: deque[int] = deque()
        for i in range(m):
            step = [("F", w + i, 0)] if i < m - w else []
            step.append(("I", i, 0))
            pending.append(i)
            if len(pending) > r or i >= m - w:  # steady state: keep r deferred; cool-down: fill
                step.append(("W", pending.popleft(), 0))
            # once r W's are deferred, post RECV_B for I before the F in front of it: the next
            # rank sends it while this one finishes its W (sends are not buffered)
            steps += (
                [tuple(step[:2]), tuple(step[2:])]
                if len(step) == 3 and i > r
                else [(x,) for x in step]
            )
        return steps + [(("W", i, 0),) for i in pending]
    # interleaved (Megatron-core): step k forwards table[k], backs table[k] with chunk reversed;
    # the steady state's (F, B) pairs share one comm batch, as in Megatron
    table = _interleaved_table(m, v, pp)
    total = len(table)
    w = min((pp - r - 1) * 2 + (v - 1) * pp, total)
    fwd = [("F", mb, c) for mb, c in table]
    bwd = [("B", mb, v - 1 - c) for mb, c in table]
    warm_up: list[Step] = [(x,) for x in fwd[:w]]
    return (
        warm_up
        + [(fwd[k + w], bwd[k]) for k in range(total - w)]
        + [(x,) for x in bwd[total - w :]]
    )


def build(name: str, pp: int, micro: int, virtual: int = 1) -> Schedule:
    """The actions of every rank (index = pipeline rank) for schedule `name`.

    Refused (ScheduleError): pp < 1, micro < 1, virtual < 1; virtual > 1 with pp == 1 (chunks
    would send to themselves); virtual > 1 for "gpipe", "1f1b" and "zb-h1" (non-interleaved
    schedules; "interleaved" with virtual == 1 is "1f1b"); "interleaved" with micro not a
    multiple of pp (Megatron-core's partial last group of micro-batches, in this comm model
    of fused batches and unbuffered sends, deadlocks or breaks the per-pair FIFO order at pp=2).
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if pp < 1 or micro < 1 or virtual < 1:
        raise ScheduleError(
            f"need pp, micro-batches and virtual stages >= 1, got {pp}, {micro}, {virtual}"
        )
    if virtual > 1 and pp == 1:
        raise ScheduleError("virtual pipeline stages need pp >= 2")
    if virtual > 1 and name in ("gpipe", "1f1b", "zb-h1"):
        raise ScheduleError(
            f"schedule {name!r} takes virtual=1 (use 'interleaved' for virtual > 1)"
        )
    if name == "interleaved":
        if virtual == 1:
            name = "1f1b"
        elif micro % pp:  # Megatron-core's partial last group deadlocks under rendezvous sends
            raise ScheduleError(
                f"interleaved schedule needs micro-batches to be a multiple of pp "
                f"(got {micro} with pp={pp})"
            )
    return [
        _with_comms(_order(name, pp, micro, virtual, r), r, pp, virtual, name != "zb-h1")
        for r in range(pp)
    ]


def _batches(actions: Sequence[Action]) -> list[list[int]]:
    """Indices of the rank's actions, grouped: a compute alone, a maximal comm run together."""
    out: list[list[int]] = []
    for i, a in enumerate(actions):
        if a.is_comm and out and actions[out[-1][-1]].is_comm:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _keys(actions: Sequence[Action], rank: int, pp: int) -> list[tuple[int, ...]]:
    """Per action, the FIFO slot of its message: (src, dst, k) for the k-th message src->dst.

    A compute action sends nothing: its slot is the empty tuple.
    """
    count: dict[tuple[int, int], int] = {}
    keys: list[tuple[int, ...]] = []
    for a in actions:
        if not a.is_comm:
            keys.append(())
            continue
        peer = peer_of(a, rank, pp)
        pair = (rank, peer) if a.kind.startswith("SEND") else (peer, rank)
        k = count.get(pair, 0)
        count[pair] = k + 1
        keys.append((*pair, k))
    return keys


def simulate(
    schedule: Sequence[Sequence[Action]],
    pp: int,
    virtual: int = 1,
    cost: Mapping[str, float] | None = None,
) -> Timeline:
    """Per rank, (action, start, end) under the runtime semantics (module docstring).

    Compute actions take `cost[kind]` (default `DEFAULT_COST`); a comm op starts when its batch is
    posted and ends when its partner is posted too; comms take no time. Raises ScheduleError on a
    deadlock, naming each stuck rank and the op it waits for.
    """
    costs = {**DEFAULT_COST, **(cost or {})}
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} ranks, expected pp={pp}")
    batches = [_batches(acts) for acts in schedule]
    keys = [_keys(acts, r, pp) for r, acts in enumerate(schedule)]
    posted: dict[tuple, float] = {}  # ("S"|"R", src, dst, k) -> time posted
    pos, clock = [0] * pp, [0.0] * pp
    is_posted = [False] * pp
    timeline: Timeline = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(batches[r]):
                idx = batches[r][pos[r]]
                a = schedule[r][idx[0]]
                if not a.is_comm:
                    end = clock[r] + float(costs[a.kind])
                    timeline[r].append((a, clock[r], end))
                    clock[r], pos[r], progress = end, pos[r] + 1, True
                    continue
                mine = [
                    ("S" if schedule[r][i].kind.startswith("SEND") else "R", *keys[r][i])
                    for i in idx
                ]
                if not is_posted[r]:
                    for key in mine:
                        posted[key] = clock[r]
                    is_posted[r] = progress = True
                partners = [("R" if key[0] == "S" else "S", *key[1:]) for key in mine]
                if any(p not in posted for p in partners):
                    break
                t0 = clock[r]
                for i, p in zip(idx, partners):
                    timeline[r].append((schedule[r][i], t0, max(t0, posted[p])))
                clock[r] = max([t0] + [posted[p] for p in partners])
                pos[r], is_posted[r], progress = pos[r] + 1, False, True
    stuck = []
    for r in range(pp):
        if pos[r] < len(batches[r]):
            idx = batches[r][pos[r]]
            waiting = [
                schedule[r][i]
                for i in idx
                if ("R" if schedule[r][i].kind.startswith("SEND") else "S", *keys[r][i])
                not in posted
            ]
            stuck.append(f"rank {r} waits at {waiting[0]} (peer rank {peer_of(waiting[0], r, pp)})")
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    return timeline


def bubble_fraction(timeline: Timeline) -> list[float]:
    """Per rank, the time it does not compute divided by the makespan (all ranks start at 0)."""
    span = max((end for rank in timeline for _, _, end in rank), default=0.0)
    if span <= 0:
        return [0.0 for _ in timeline]
    return [(span - sum(e - s for a, s, e in rank if not a.is_comm)) / span for rank in timeline]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batch-chunks whose F has run and whose last backward (B, or W) has not."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.kind == "F":
            live.add((a.micro, a.chunk))
            peak = max(peak, len(live))
        elif a.kind in ("B", "W"):
            live.discard((a.micro, a.chunk))
    return peak


def _message(a: Action, rank: int, pp: int) -> tuple[str, int, int]:
    """What a comm action carries: (F|B, micro, stage that receives it)."""
    s = stage_of(rank, a.chunk, pp)
    if a.kind == "SEND_F":
        return ("F", a.micro, s + 1)
    if a.kind == "SEND_B":
        return ("B", a.micro, s - 1)
    return (a.kind[-1], a.micro, s)


def _check_rank(actions: Sequence[Action], r: int, pp: int, m: int, v: int) -> None:
    last = pp * v - 1
    at: dict[Action, int] = {}
    for i, act in enumerate(actions):
        if act.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ScheduleError(f"rank {r}: unknown action kind {act.kind!r} ({act})")
        if not (0 <= act.micro < m and 0 <= act.chunk < v):
            raise ScheduleError(f"rank {r}: {act} is out of range (micro < {m}, chunk < {v})")
        if act in at:
            raise ScheduleError(f"rank {r}: duplicate {act} (actions {at[act]} and {i})")
        at[act] = i

    def before(first: Action, then: Action) -> None:
        if at[first] > at[then]:
            raise ScheduleError(f"rank {r}: {then} runs before {first}")

    for mb in range(m):
        for c in range(v):
            s = stage_of(r, c, pp)
            a = {k: Action(k, mb, c) for k in COMPUTE_KINDS + COMM_KINDS}
            if a["F"] not in at:
                raise ScheduleError(f"rank {r}: missing {a['F']}")
            split = a["I"] in at or a["W"] in at
            if split and a["B"] in at:
                raise ScheduleError(
                    f"rank {r}: {a['B']} and a split backward ({a['I']}/{a['W']}) both present"
                )
            for k in ("I", "W") if split else ("B",):
                if a[k] not in at:
                    raise ScheduleError(f"rank {r}: missing {a[k]}")
            bwd = a["I"] if split else a["B"]
            needed = {"RECV_F": s > 0, "SEND_B": s > 0, "SEND_F": s < last, "RECV_B": s < last}
            for k, need in needed.items():
                if need and a[k] not in at:
                    raise ScheduleError(f"rank {r}: missing {a[k]} (stage {s} of {last + 1})")
                if not need and a[k] in at:
                    raise ScheduleError(
                        f"rank {r}: unexpected {a[k]} (stage {s} is the "
                        f"{'first' if k in ('RECV_F', 'SEND_B') else 'last'})"
                    )
            before(a["F"], bwd)
            if split:
                before(a["I"], a["W"])
            if s > 0:
                before(a["RECV_F"], a["F"])
                before(bwd, a["SEND_B"])
            if s < last:
                before(a["F"], a["SEND_F"])
                before(a["RECV_B"], bwd)


def validate(schedule: Sequence[Sequence[Action]], pp: int, micro: int, virtual: int = 1) -> None:
    """Check a schedule without a model; raises ScheduleError naming the rank and the action.

    Checks: one F and one B (or one I and one W) per micro-batch and chunk on each rank; the
    dependency order on a rank; exactly the comm actions needed; per-pair FIFO matching (the k-th
    message src->dst is what dst's k-th recv from src expects); no deadlock (by `simulate`).
    """
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} ranks, expected pp={pp}")
    for r, actions in enumerate(schedule):
        _check_rank(actions, r, pp, micro, virtual)
    sent: dict[tuple[int, int], list[Action]] = {}
    recv: dict[tuple[int, int], list[Action]] = {}
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.is_comm:
                peer = peer_of(a, r, pp)
                if a.kind.startswith("SEND"):
                    sent.setdefault((r, peer), []).append(a)
                else:
                    recv.setdefault((peer, r), []).append(a)
    for src, dst in sorted(set(sent) | set(recv)):
        sends, recvs = sent.get((src, dst), []), recv.get((src, dst), [])
        for k in range(max(len(sends), len(recvs))):
            if k >= len(sends):
                raise ScheduleError(f"rank {dst}: {recvs[k]} has no matching send on rank {src}")
            if k >= len(recvs):
                raise ScheduleError(f"rank {src}: {sends[k]} has no matching recv on rank {dst}")
            if _message(sends[k], src, pp) != _message(recvs[k], dst, pp):
                raise ScheduleError(
                    f"rank {src}: message #{k} to rank {dst} is {sends[k]} but rank {dst}'s recv "
                    f"#{k} from rank {src} is {recvs[k]} (per-pair FIFO order differs)"
                )
    simulate(schedule, pp, virtual)
