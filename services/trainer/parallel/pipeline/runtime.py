"""The pipeline runtime: executes one rank's schedule (`schedules.build`) for a training step.

Compute actions (F, B, I, W) run the rank's `PipelineStage` chunks; each run of consecutive
comm actions is posted as one `batch_isend_irecv`, in the order `schedules.validate` checked
for deadlock freedom. Waits come as late as they can: a receive is waited for just before the
compute that needs it, a send only at the end of the step, so a rank keeps computing while its
transfers are in flight (posting order is what the validation covers; waiting later can only
let ranks progress further). Activations and their gradients have a
shape known before the step, (micro_batch, seq or seq/tp under sequence parallelism, hidden),
in the dtype of the residual stream, so receivers allocate without a shape handshake; a
tensor of another shape or dtype about to be sent is an error naming both.

Data parallelism: the gradient reduction of a chunk's parameters may start (with
overlap_grad_reduce) in its last backward action on this rank; earlier ones accumulate
without communicating. Zero-bubble schedules defer the linear layers' weight gradients to W
actions (`zero_bubble.WeightGradStore`).

Every action can be timed (`record=True`): `timeline` then holds (action, start, end) per
action of the last step, from which `benchmarks/pipeline_bubble.py` draws the step and
measures the idle fraction of each stage.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.model.moe import set_moe_loss_scale
from meshtrain.services.trainer.parallel.context import token_count
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.pipeline import schedules
from meshtrain.services.trainer.parallel.pipeline.schedules import Action
from meshtrain.services.trainer.parallel.pipeline.stage import PipelineStage
from meshtrain.services.trainer.parallel.pipeline.zero_bubble import WeightGradStore

COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass
class _StepState:
    """What one step's actions hand each other, keyed by (micro, chunk)."""

    total: torch.Tensor  # the sum of the loss shares (last stage)
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # activations/tokens
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # outputs/losses
    grad_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # received grads
    grad_in: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # to send back
    batch: list[tuple[Action, dist.P2POp]] = field(default_factory=list)  # comm not yet posted
    # in flight until the step ends (buffers kept alive)
    sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    # ("F"|"B", micro, chunk) -> the receive it needs
    recvs: dict[tuple[str, int, int], dist.Work] = field(default_factory=dict)
    in_flight: int = 0  # forwards whose backward has not finished


class PipelineRuntime:
    """Runs a schedule on this rank.

    Args:
        stage: this rank's chunks.
        mesh: the layout (the pp group gives the neighbours' global ranks).
        schedule: a name in `schedules.SCHEDULES`.
        n_micro: micro-batches per step on this data-parallel rank.
        act_shape, act_dtype: what flows between stages.
        device: where activations live.
        ddp: the DataParallel wrapper (its reductions are started by the last backward of a chunk).
        autocast: the context the forward runs under (bf16 autocast or a null context).
        weight_store: for split-backward schedules, the store the stage's linears defer into.
    """

    def __init__(
        self,
        stage: PipelineStage,
        mesh: Mesh,
        schedule: str,
        n_micro: int,
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype,
        device: torch.device,
        ddp=None,
        autocast=None,
        weight_store: WeightGradStore | None = None,
    ):
        pp, v = mesh.pp, stage.virtual
        try:
            plan = schedules.build(schedule, pp, n_micro, v)
            schedules.validate(plan, pp, n_micro, v)
        except schedules.ScheduleError as e:
            raise ConfigError(
                f"parallel.pipeline_schedule={schedule!r} with pp={pp}, {v} virtual stages and "
                f"{n_micro} micro-batches per step: {e}"
            ) from None
        self.stage, self.mesh, self.n_micro = stage, mesh, n_micro
        # the last stage divides each micro-batch's loss by n_micro; the MoE blocks of every stage
        # (those without the head too) scale their aux losses' gradients alike
        set_moe_loss_scale(stage, 1.0 / n_micro)
        self.actions: list[Action] = plan[stage.pp_rank]
        self.split_backward = any(a.kind == "I" for a in self.actions)
        if self.split_backward and weight_store is None:
            raise ValueError(f"schedule {schedule!r} splits the backward: pass a weight_store")
        self.store = weight_store
        ranks = mesh.ranks["pp"]
        self.next = ranks[(stage.pp_rank + 1) % pp]
        self.prev = ranks[(stage.pp_rank - 1) % pp]
        self.act_shape, self.act_dtype, self.device = tuple(act_shape), act_dtype, device
        self.ddp = ddp
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        # the index of each chunk's last action that adds into its gradients
        self.final: dict[str, dict[int, int]] = {"B": {}, "I": {}, "W": {}}
        for i, a in enumerate(self.actions):
            if a.kind in self.final:
                self.final[a.kind][a.chunk] = i
        self.record = False
        self.timeline: list[tuple[Action, float, float]] = []
        self.peak_in_flight = 0

    # ------------------------------------------------------------------ one step
    def step(self, micro: list[tuple | None]) -> torch.Tensor:
        """Forward and backward of a step's micro-batches; the sum of their loss shares.

        `micro[m]` is (tokens, labels, loss_mask, document_ids, position_ids) on the device for
        stages that read data (the first needs tokens, the last labels and the mask, every one
        the document ids and positions, None when the batches have none), None elsewhere.
        Returns the step's loss (the mean over micro-batches) on the last stage, 0 elsewhere.
        """
        st = _StepState(torch.zeros((), device=self.device))
        self.timeline = []
        self.peak_in_flight = 0
        sync_default = self.ddp.sync_enabled if self.ddp is not None else True
        try:
            for i, a in enumerate(self.actions):
                key = (a.micro, a.chunk)
                if a.kind in COMM:
                    self._post(a, key, st)
                    continue
                self._flush(st)
                if a.kind in ("F", "B", "I"):
                    self._wait_for(st, "F" if a.kind == "F" else "B", key)
                t0 = self._now()
                if a.kind == "F":
                    self._forward(a, key, micro, st)
                elif a.kind in ("B", "I"):
                    self._backward(i, a, key, st)
                else:  # W
                    self._weight_store().run(key, final=self.final["W"].get(a.chunk) == i)
                    st.in_flight -= 1
                if self.record:
                    self.timeline.append((a, t0, self._now()))
            self._flush(st)
            for work in list(st.recvs.values()) + [w for w, _ in st.sends]:
                work.wait()
        finally:
            if self.ddp is not None:
                self.ddp.sync_enabled = sync_default
        return st.total

    def _post(self, a: Action, key: tuple[int, int], st: _StepState) -> None:
        """Queue a comm action for the next `_flush`: a receive into a new buffer, or a send."""
        if a.kind == "RECV_F":
            buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
            st.inputs[key] = buf
            st.batch.append((a, dist.P2POp(dist.irecv, buf, self.prev)))
        elif a.kind == "RECV_B":
            buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
            st.grad_out[key] = buf
            st.batch.append((a, dist.P2POp(dist.irecv, buf, self.next)))
        else:
            t = (
                st.outputs[key].detach() if a.kind == "SEND_F" else st.grad_in.pop(key)
            ).contiguous()
            self._check(a, t)
            peer = self.next if a.kind == "SEND_F" else self.prev
            st.batch.append((a, dist.P2POp(dist.isend, t, peer)))

    def _flush(self, st: _StepState) -> None:
        """Post the queued comm actions as one `batch_isend_irecv`."""
        if not st.batch:
            return
        t0 = self._now()
        works = dist.batch_isend_irecv([op for _, op in st.batch])
        for (a, op), work in zip(st.batch, works):
            if a.kind in ("SEND_F", "SEND_B"):
                st.sends.append((work, op.tensor))
            else:
                st.recvs[("F" if a.kind == "RECV_F" else "B", a.micro, a.chunk)] = work
        if self.record:
            t1 = self._now()
            self.timeline += [(a, t0, t1) for a, _ in st.batch]
        st.batch.clear()

    def _wait_for(self, st: _StepState, kind: str, key: tuple[int, int]) -> None:
        """Wait for the receive ("F": activation, "B": gradient) of `key`, if one is pending."""
        work = st.recvs.pop((kind, *key), None)
        if work is not None:
            t0 = self._now()
            work.wait()
            if self.record:
                self.timeline.append((Action("WAIT", *key), t0, self._now()))

    def _forward(self, a: Action, key: tuple[int, int], micro, st: _StepState) -> None:
        """An F action: the chunk's forward (on the last chunk, the micro-batch's loss share)."""
        stage = self.stage
        x = self._forward_input(micro, a, st.inputs)
        labels, mask, docs, positions, images = _stage_inputs(stage, a.chunk, micro[a.micro])
        with self.autocast:
            y = stage(a.chunk, x, labels, mask, docs, positions, images)
        if stage.chunk_is_last(a.chunk):
            y = y / self.n_micro
            st.total += y.detach()
        st.outputs[key] = y
        st.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, st.in_flight)

    def _backward(self, i: int, a: Action, key: tuple[int, int], st: _StepState) -> None:
        """A B action (full backward) or I action (input gradients, weight gradients deferred
        to the store); the input gradient is kept for the send back."""
        stage = self.stage
        if self.ddp is not None:
            self.ddp.sync_enabled = self.final[a.kind].get(a.chunk) == i
        y = st.outputs.pop(key)
        grad = None if stage.chunk_is_last(a.chunk) else st.grad_out.pop(key)
        store = self._weight_store() if a.kind == "I" else None
        if store is not None:
            store.begin(key)
        try:
            torch.autograd.backward(y, grad)
        finally:
            if store is not None:
                store.end()
        x = st.inputs.pop(key)
        if not stage.chunk_is_first(a.chunk):
            assert x.grad is not None  # a later chunk's input requires grad: backward gave it one
            st.grad_in[key] = x.grad
        if a.kind == "B":
            st.in_flight -= 1

    def _weight_store(self) -> WeightGradStore:
        """The store of deferred weight gradients, which a schedule with I and W actions uses."""
        if self.store is None:
            raise ValueError(
                "a schedule with I and W actions (zero-bubble) needs a weight-gradient store"
            )
        return self.store

    def _forward_input(self, micro, a: Action, inputs) -> torch.Tensor:
        key = (a.micro, a.chunk)
        if self.stage.chunk_is_first(a.chunk):
            tokens = micro[a.micro][0]
            inputs[key] = tokens
            return tokens
        x = inputs[key]
        x.requires_grad_()
        return x

    def _check(self, a: Action, t: torch.Tensor) -> None:
        if tuple(t.shape) != self.act_shape or t.dtype != self.act_dtype:
            raise RuntimeError(
                f"pipeline rank {self.stage.pp_rank}: {a} would send a {t.dtype} tensor of shape "
                f"{tuple(t.shape)}; the peer expects {self.act_dtype} of shape {self.act_shape} "
                "(micro_batch, seq, hidden)"
            )

    def _now(self) -> float:
        if self.record and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def forward_only(self, micro: list[tuple | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every micro-batch through every stage in order, no backward: on the last stage
        (sum of token-weighted losses, tokens counted) in float64, zeros elsewhere. Under context
        parallelism each cp rank's sum is its share: the caller sums them over cp."""
        stage, pp = self.stage, self.mesh.pp
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        counted = torch.zeros((), dtype=torch.float64, device=self.device)
        for m in range(len(micro)):
            for s in range(pp * stage.virtual):
                if s % pp != stage.pp_rank:
                    continue
                c = s // pp
                if stage.chunk_is_first(c):
                    inputs = micro[m]
                    assert inputs is not None  # the first stage holds the micro-batches
                    x = inputs[0]
                else:
                    x = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                    dist.recv(x, self.prev)
                labels, mask, docs, positions, images = _stage_inputs(stage, c, micro[m])
                with self.autocast:
                    y = stage(c, x, labels, mask, docs, positions, images)
                if stage.chunk_is_last(c):
                    n = token_count(stage.context, mask)
                    total += y.double() * n
                    counted += n
                else:
                    y = y.contiguous()
                    self._check(Action("SEND_F", m, c), y)
                    dist.send(y, self.next)
        return total, counted


def _stage_inputs(stage, chunk: int, batch: tuple | None) -> tuple:
    """(labels, loss_mask, document_ids, position_ids, images) chunk `chunk` takes from a
    micro-batch (tokens, labels, loss_mask[, document_ids, position_ids[, images]]): labels and
    mask on the last chunk only, images on the first; the documents on every chunk (None where
    the batch has none, or none is read)."""
    if batch is None:
        return None, None, None, None, None
    labels, mask = batch[1], batch[2]
    docs, positions = (batch[3], batch[4]) if len(batch) > 3 else (None, None)
    images = batch[5] if len(batch) > 5 and stage.chunk_is_first(chunk) else None
    if not stage.chunk_is_last(chunk):
        labels = mask = None
    return labels, mask, docs, positions, images
