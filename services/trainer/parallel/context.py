"""Context parallelism: each sample's sequence split over cp ranks, attention exchanged among them.

**Layout (causal load balance).** The sequence of s tokens is cut into 2·cp chunks of
c = s/(2·cp); cp rank i holds chunks i and 2·cp−1−i, in that order (`context_positions`). Under a
causal mask the early chunks attend to little and the late ones to much, so every rank does the
same attention work. Everything outside attention is per token and runs on the local 2c tokens
unchanged; RoPE and learned positions take the local tokens' global positions
(`ContextParallel.positions`), the data path hands each rank only its tokens, and the loss of a
rank is its share of the sample's mean (`ContextParallel.loss_share`: its tokens' loss sum over
the token count of the whole cp group), so the cp ranks' losses and gradients add up to the
unsplit run's. Parameters are replicated over cp: gradients are summed over cp and averaged
over dp (the data-parallel reduction runs over dp×cp), and checkpoints do not depend on cp.

**Attention** (`ContextAttention`, in place of each block's `CoreAttention`), by
`parallel.cp_comm_type` (Megatron's --cp-comm-type):

- `p2p` (ring): the key/value blocks rotate around the cp ring; each step sends the current
  block on (`batch_isend_irecv`) while attending to it, and merges the partial output by its
  log-sum-exp (`kernels.attention_blocks`). With the layout above, the block a rank receives
  from a lower rank is seen whole by every local query through its first chunk only, and the
  one from a higher rank only by the local second chunk, both without a mask; only the local
  block is causal. Backward rotates the key/value blocks the same way, their gradient
  accumulators travelling with them and arriving home after a full turn.
- `a2a` (all-to-all over heads, as DeepSpeed-Ulysses): an all-to-all turns sequence-sharded
  q/k/v into head-sharded full-sequence ones, causal attention runs unchanged on the
  sequence reordered into position order, and a second all-to-all turns the output back.
  Key/value heads are repeated first when there are fewer of them than cp ranks (GQA). With
  packed documents (data.reset_attention_mask) the group's document ids are gathered into the
  same position order and attention stays within documents (`document_attention`); the ring
  variants carry no document ids and refuse them (`check_documents`).
- `a2a+p2p` (hierarchical): all-to-all inside groups of `hierarchical_context_parallel_sizes[0]`
  consecutive cp ranks (a node), a ring across the groups. The gathered sequence of a group
  is again a front and a back run of chunks, so the ring above runs on it unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.kernels import attention_blocks as blocks
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.dataloader.loader import context_positions
from meshtrain.services.trainer.model.attention import (
    CoreAttention,
    Documents,
    document_attention,
    sdpa,
)
from meshtrain.services.trainer.parallel import mappings as M
from meshtrain.services.trainer.parallel.mesh import Mesh

COMM_TYPES = ("p2p", "a2a", "a2a+p2p")


class ContextParallel:
    """One rank's place in the context-parallel layout and its groups.

    Attributes:
        cp, cp_rank: degree and this rank's coordinate.
        a2a, a2a_rank, a2a_group: the all-to-all group (consecutive cp ranks; size 1 for p2p).
        ring, ring_rank, ring_group, next, prev: the ring across a2a groups (size 1 for a2a);
            next/prev are global ranks.
    """

    def __init__(self, mesh: Mesh, comm_type: str):
        if comm_type not in COMM_TYPES:
            raise ConfigError(
                f"parallel.cp_comm_type must be one of {COMM_TYPES}, got {comm_type!r}"
            )
        self.cp, self.cp_rank, self.comm_type = mesh.cp, mesh.cp_rank, comm_type
        self.group = mesh.group("cp")
        self.a2a_group, self.ring_group = mesh.group("cp_a2a"), mesh.group("cp_ring")
        a2a_ranks, ring_ranks = mesh.ranks["cp_a2a"], mesh.ranks["cp_ring"]
        self.a2a, self.a2a_rank = len(a2a_ranks), a2a_ranks.index(mesh.rank)
        self.ring, self.ring_rank = len(ring_ranks), ring_ranks.index(mesh.rank)
        wants = {"p2p": "1", "a2a": f"cp={self.cp}", "a2a+p2p": "a size strictly between 1 and cp"}[
            comm_type
        ]
        fits = {
            "p2p": self.a2a == 1,
            "a2a": self.a2a == self.cp,
            "a2a+p2p": 1 < self.a2a < self.cp,
        }[comm_type]
        if self.cp > 1 and not fits:
            raise ConfigError(
                f"cp_comm_type={comm_type!r} needs a mesh whose context-parallel all-to-all spans "
                f"{wants} ranks; this one was built with {self.a2a} (Mesh.build(cp_a2a=...), or "
                "initialize_model_parallel(cp_comm_type=..., "
                "hierarchical_context_parallel_sizes=...))"
            )
        self.next = ring_ranks[(self.ring_rank + 1) % self.ring]
        self.prev = ring_ranks[(self.ring_rank - 1) % self.ring]
        self._positions: dict[tuple[int, str], torch.Tensor] = {}

    @torch.compiler.disable
    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """(local_len,) int64: the global positions of this rank's tokens."""
        key = (local_len, str(device))
        if key not in self._positions:
            pos = context_positions(local_len * self.cp, self.cp_rank, self.cp)
            self._positions[key] = torch.from_numpy(pos).to(device)
        return self._positions[key]

    @torch.compiler.disable  # a collective: outside compiled graphs
    def loss_share(
        self, loss: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's share of the sample's mean loss, from the mean over its own tokens.

        loss (a mean over the local counted tokens) x local count / count over the cp group:
        the shares of the cp ranks add up to the mean over every token of the micro-batch
        (one all-reduce of a scalar, on the data: no gradient flows through it).
        """
        local = labels.numel() if loss_mask is None else loss_mask.sum(dtype=torch.float32)
        local = torch.as_tensor(local, dtype=torch.float32, device=loss.device)
        total = M.all_reduce(local.clone(), self.group)
        return loss * (local / total.clamp(min=1.0))


def token_count(context: ContextParallel | None, loss_mask: torch.Tensor) -> torch.Tensor:
    """float64 tokens a micro-batch's loss counts: the whole sample's over the cp group (what
    `loss_share` divides by), or this rank's without context parallelism. Evaluation weights
    each micro-batch's loss by it; the weighted shares are then summed over cp."""
    n = loss_mask.sum(dtype=torch.float64)
    return n if context is None else M.all_reduce(n, context.group)


# ------------------------------------------------------------------------------------ all-to-all
def _seq_to_heads(x: torch.Tensor, group, a: int) -> torch.Tensor:
    """(b, H, 2c, d) of this rank's two chunks -> (b, H/a, 2ac, d) of the group's chunks for this
    rank's share of the heads, in position order (the front chunks by rank, then the back ones
    in reverse rank order, which is how their positions run). Differentiable: its backward is
    `_heads_to_seq`'s data movement (the all-to-all reversed, the reshapes undone)."""
    b, h, s, d = x.shape
    send = x.reshape(b, a, h // a, s, d).transpose(0, 1)  # (a, b, H/a, 2c, d) by destination
    recv = M.all_to_all(send, group)  # recv[r]: rank r's two chunks, my heads
    c = s // 2
    y_front, y_back = recv.view(a, b, h // a, 2, c, d).unbind(3)  # each (a, b, H/a, c, d)
    front = y_front.permute(1, 2, 0, 3, 4).reshape(b, h // a, a * c, d)
    back = y_back.flip(0).permute(1, 2, 0, 3, 4).reshape(b, h // a, a * c, d)
    return torch.cat([front, back], dim=2)


def _gather_documents(ids: torch.Tensor, group, a: int) -> torch.Tensor:
    """(b, 2c) document ids of this rank's two chunks -> (b, 2ac) of the group's chunks in
    position order, as `_seq_to_heads` orders the sequence (no gradient: ids are data)."""
    b, s = ids.shape
    parts = [torch.empty_like(ids) for _ in range(a)]
    dist.all_gather(parts, ids.contiguous(), group=group)
    c = s // 2
    stacked = torch.stack(parts).view(a, b, 2, c)  # (a, b, front|back, c)
    front = stacked[:, :, 0].permute(1, 0, 2).reshape(b, a * c)
    back = stacked[:, :, 1].flip(0).permute(1, 0, 2).reshape(b, a * c)
    return torch.cat([front, back], dim=1)


def _heads_to_seq(y: torch.Tensor, group, a: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (b, H/a, 2ac, d) -> (b, H, 2c, d)."""
    b, hl, s, d = y.shape
    c = s // (2 * a)
    y_front, y_back = y.split(a * c, dim=2)  # each (b, H/a, ac, d)
    front = y_front.reshape(b, hl, a, c, d).permute(2, 0, 1, 3, 4)
    back = y_back.reshape(b, hl, a, c, d).permute(2, 0, 1, 3, 4).flip(0)
    send = torch.stack([front, back], dim=3).reshape(a, b, hl, 2 * c, d)  # (a, b, H/a, 2c, d)
    recv = M.all_to_all(send, group)  # recv[r]: my chunks, rank r's heads
    return recv.transpose(0, 1).reshape(b, a * hl, 2 * c, d)


# ------------------------------------------------------------------------------------ ring
def _exchange(send: torch.Tensor, cp: ContextParallel, tag: int) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next ring rank and receiving the previous one's into a new
    tensor; returns (that tensor, the requests to wait on)."""
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, cp.next, cp.ring_group, tag),
        dist.P2POp(dist.irecv, recv, cp.prev, cp.ring_group, tag),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _block(cp: ContextParallel, step: int, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the attention step `step` computes: the key/value block
    held then is the one of ring rank (ring_rank - step) mod ring. Step 0: this rank's own block,
    causal. A lower rank's block: its first chunk, which every local query sees whole (its second
    none does). A higher rank's block: whole, seen only by the local second chunk."""
    every = slice(None)
    if step == 0:
        return every, every, True
    if (cp.ring_rank - step) % cp.ring < cp.ring_rank:
        return every, slice(0, half), False
    return slice(half, None), every, False


class _RingAttention(torch.autograd.Function):
    """Causal attention over the ring (see the module docstring).

    Shapes: q (b, h, 2C, d), k/v (b, g, 2C, d).
    """

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, impl: str):
        b, h, s, d = q.shape
        half = s // 2
        out = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp.ring):
            reqs = []
            if step < cp.ring - 1:
                kv_next, reqs = _exchange(kv, cp, tag=0)
            qs, ks, causal = _block(cp, step, half)
            o, l_ = blocks.attention_forward(
                q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal, impl
            )
            blocks.merge(out[:, :, qs], lse[:, :, qs], o, l_)
            _wait(reqs)
            if reqs:
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.impl = cp, impl
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, impl = ctx.cp, ctx.impl
        dout = dout.contiguous()
        half = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_reqs: list = []
        dkv_in = None
        for step in range(cp.ring):
            kv_reqs = []
            if step < cp.ring - 1:
                kv_next, kv_reqs = _exchange(kv, cp, tag=0)
            qs, ks, causal = _block(cp, step, half)
            gq, gk, gv = blocks.attention_backward(
                dout[:, :, qs],
                q[:, :, qs],
                kv[0][:, :, ks],
                kv[1][:, :, ks],
                out[:, :, qs],
                lse[:, :, qs],
                causal,
                impl,
            )
            dq[:, :, qs].add_(gq)
            if step == 0:  # this rank's own block: its accumulator starts here
                dkv = torch.stack([gk, gv]).float()
            else:
                _wait(dkv_reqs)
                dkv = dkv_in
                dkv[0][:, :, ks].add_(gk)
                dkv[1][:, :, ks].add_(gv)
            # the accumulator goes on with the block it belongs to; after the last step it goes home
            dkv_in, dkv_reqs = _exchange(dkv, cp, tag=1)
            _wait(kv_reqs)
            if kv_reqs:
                kv = kv_next
        _wait(dkv_reqs)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None


# ------------------------------------------------------------------------------------ the module
class ContextAttention(CoreAttention):
    """Causal attention of a context-parallel rank's tokens against the whole sequence.

    q (b, heads, 2c, d), k/v (b, groups, 2c, d) of this rank's chunks -> (b, heads, 2c, d).
    A CoreAttention, so selective recompute wraps it like the plain one.
    """

    def __init__(self, core: CoreAttention, cp: ContextParallel):
        super().__init__(core.dropout, core.backend)
        if core.dropout:
            raise ConfigError(
                "context parallelism does not carry attention dropout across ranks: "
                "set model.attention_dropout=0"
            )
        self.cp = cp
        self.impl = "math" if core.backend == "math" else "auto"

    @torch.compiler.disable  # point-to-point rounds and all-to-alls: eager, between compiled graphs
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None = None
    ) -> torch.Tensor:
        cp = self.cp
        if docs is not None and cp.ring > 1:
            raise ConfigError(
                f"attention within documents (data.reset_attention_mask) under context "
                f"parallelism needs parallel.cp_comm_type='a2a'; {cp.comm_type!r} runs a ring"
            )
        if cp.a2a > 1:
            groups = k.shape[1]
            if groups % cp.a2a:  # GQA with fewer kv heads than all-to-all ranks: one per rank
                k, v = (t.repeat_interleave(cp.a2a // groups, dim=1) for t in (k, v))
            q, k, v = (_seq_to_heads(t, cp.a2a_group, cp.a2a) for t in (q, k, v))
        if docs is not None:  # the whole sequence's ids, in the order q/k/v now have
            ids = _gather_documents(docs.ids, cp.a2a_group, cp.a2a) if cp.a2a > 1 else docs.ids
            out = document_attention(q, k, v, Documents(ids))
        elif cp.ring > 1:
            out = _RingAttention.apply(q, k, v, cp, self.impl)
        else:
            out = sdpa(q, k, v, 0.0, self.backend)
        if cp.a2a > 1:
            out = _heads_to_seq(out, cp.a2a_group, cp.a2a)
        return out


def parallelize_context(
    model: nn.Module, mesh: Mesh, comm_type: str = "p2p"
) -> ContextParallel | None:
    """Make `model` (a GPT, before recompute and tensor parallelism) context parallel over
    `mesh.cp`: its attention cores exchange keys and values, its positions and loss follow the
    layout. Returns the ContextParallel (None, and nothing changed, at cp=1).

    Then feed each rank the columns `context_positions(seq, mesh.cp_rank, mesh.cp)` of every
    batch (`build_data(..., cp_rank=, cp_size=)` does), reduce gradients over dp x cp
    (`DistributedDataParallel` does), and sum the returned losses over the "cp" group to
    report the micro-batch's mean: each rank's loss is its share of it.

    Raises:
        ConfigError: a comm type the mesh's cp groups were not built for, or attention dropout.
    """
    if mesh.cp == 1:
        return None
    cp = ContextParallel(mesh, comm_type)
    for layer in model.layers:
        layer.attention.core = ContextAttention(layer.attention.core, cp)
    model.context = cp
    return cp
