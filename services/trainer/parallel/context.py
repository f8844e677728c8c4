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
  Key/value heads are repeated first when there are fewer of them than cp ranks (GQA).
- `a2a+p2p` (hierarchical): all-to-all inside groups of `hierarchical_context_parallel_sizes[0]`
  consecutive cp ranks (a node), a ring across the groups. The gathered sequence of a group
  is again a front and a back run of chunks, so the ring above runs on it unchanged.

**Packed documents** (data.reset_attention_mask: `Documents`, attention causal within each
document). Under `a2a` the group's document ids are gathered into the sequence's position order
and `document_attention` runs on the whole sequence (FlexAttention with a block mask on CUDA).
Under the ring (`p2p`, and `a2a+p2p` after its all-to-all) the ring blocks' ids are
all-gathered once per layer forward (`_RingDocuments` says why rather than sent around with
the blocks), and each step attends under causal(global positions) AND same document, merged by
log-sum-exp as without documents: a query whose document starts after the step's key block
gets nothing from it (lse -inf, merged as nothing), and a block where no query shares a
document with a key is skipped, forward and backward. The backward is the same exact one (the
final out and lse fed to every block). Each step's block runs as one of
(`ContextAttention.document_blocks`):

- a dense boolean mask (CPU, and the math backend): the reference, `kernels/reference.py`
  attention with the (b, sq, sk) mask, scores in fp32;
- its documents' dense pieces (CUDA): the ids never decrease along the sequence, so in each
  block a document's queries are a run of rows and its keys a run of keys; each such rectangle
  is one call of the flash-attention block ops (causal in the own block, whole in the others),
  found on the host from one copy of the gathered ids. FlexAttention, the `a2a` path's kernel,
  is not used: the ring's backward must feed each block the final out and lse, which its
  backward does not take. A block of many short documents is many small calls.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from meshtrain.kernels import attention_blocks as blocks
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.dataloader.loader import context_positions
from meshtrain.services.trainer.model.attention import (
    CoreAttention,
    Documents,
    document_attention,
    sdpa,
)
from meshtrain.services.trainer.model.gpt import GPT, SequenceLayout, TransformerBlock
from meshtrain.services.trainer.parallel import mappings as M
from meshtrain.services.trainer.parallel.mesh import Mesh

COMM_TYPES = ("p2p", "a2a", "a2a+p2p")
DOCUMENT_BLOCKS = ("auto", "mask", "segments")
"""How the ring's blocks attend within packed documents (`ContextAttention.document_blocks`)."""


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


def token_count(context: SequenceLayout | None, loss_mask: torch.Tensor) -> torch.Tensor:
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
def _exchange(
    send: torch.Tensor, cp: ContextParallel, tag: int
) -> tuple[torch.Tensor, list[dist.Work]]:
    """Start sending `send` to the next ring rank and receiving the previous one's into a new
    tensor; returns (that tensor, the requests to wait on)."""
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, cp.next, cp.ring_group, tag),
        dist.P2POp(dist.irecv, recv, cp.prev, cp.ring_group, tag),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list[dist.Work]) -> None:
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


class _RingDocuments(NamedTuple):
    """The document ids of the ring's blocks, gathered once per forward of a layer.

    Why an all-gather rather than ids travelling with the key/value blocks: the ids are
    (b, 2C) integers against the blocks' (2, b, g, 2C, d) floats, so either costs latency, not
    bandwidth; one all-gather is one round where carrying them adds a message to each of the
    ring's steps, forward and backward, and knowing every block's ids up front lets the forward
    skip the blocks no query of which shares a document with a key, and lets the backward
    (which saves these ids) skip the same blocks with no communication at all.
    """

    local: torch.Tensor
    """(b, 2C) ids of this rank's ring block (its queries)."""
    every: torch.Tensor
    """(ring, b, 2C) ids of every ring rank's block, by ring rank (the key/value blocks)."""
    segments: list | None
    """Per step, the (batch row, query rows, key rows) slices of its dense pieces: where a
    document's queries meet the same document's keys (`_segments`); None: dense boolean masks."""


def _ring_documents(cp: ContextParallel, ids: torch.Tensor, by_segments: bool) -> _RingDocuments:
    """The `_RingDocuments` of this rank's ring block's ids (b, 2C), the same on every rank of a
    ring: an all-gather over the ring (and with `by_segments` one copy of the ids to the host)."""
    parts = [torch.empty_like(ids) for _ in range(cp.ring)]
    dist.all_gather(parts, ids.contiguous(), group=cp.ring_group)
    every = torch.stack(parts)
    segments = _segments(cp, every.cpu().numpy()) if by_segments else None
    return _RingDocuments(ids, every, segments)


def _segments(cp: ContextParallel, every: np.ndarray) -> list[list[tuple[slice, slice, slice]]]:
    """Each ring step's dense pieces from every ring block's ids (ring, b, 2C).

    A block's query rows and key rows each run in position order, and the ids never decrease
    along positions, so one document's queries in a block are a run of rows and its keys a run
    of keys: its piece is that rectangle, causal at step 0 (the rank's own block, where the two
    runs are the same) and whole elsewhere (every key of a lower step precedes every query).
    Rows of no piece (a query whose document starts after the block) get nothing from it.

    Raises:
        ValueError: ids that decrease along the sequence.
    """
    ring, b, s = every.shape
    half = s // 2
    # the sequence in position order: the ring ranks' front chunks, then their back chunks in
    # reverse ring order
    order = np.concatenate(
        [
            every[:, :, :half].transpose(1, 0, 2).reshape(b, -1),
            every[::-1, :, half:].transpose(1, 0, 2).reshape(b, -1),
        ],
        axis=1,
    )
    if (np.diff(order, axis=1) < 0).any():
        raise ValueError(
            f"packed documents under parallel.cp_comm_type={cp.comm_type!r} need document ids "
            "that never decrease along the sequence (as data.reset_attention_mask counts them "
            "from EODs)"
        )
    steps = []
    for step in range(ring):
        qs, ks, _ = _block(cp, step, half)
        q0, k0 = qs.start or 0, ks.start or 0
        q_ids = every[cp.ring_rank][:, qs]
        k_ids = every[(cp.ring_rank - step) % ring][:, ks]
        pieces = []
        for row in range(b):
            qi, ki = q_ids[row], k_ids[row]
            for doc in np.intersect1d(qi, ki):
                qa, qb = np.searchsorted(qi, doc, "left"), np.searchsorted(qi, doc, "right")
                ka, kb = np.searchsorted(ki, doc, "left"), np.searchsorted(ki, doc, "right")
                pieces.append(
                    (
                        slice(row, row + 1),
                        slice(q0 + int(qa), q0 + int(qb)),
                        slice(k0 + int(ka), k0 + int(kb)),
                    )
                )
        steps.append(pieces)
    return steps


def _pieces(
    cp: ContextParallel, step: int, half: int, docs: _RingDocuments | None
) -> list[tuple[slice, slice, slice, bool, torch.Tensor | None]]:
    """(batch rows, query rows, key rows, causal, mask) of the attention calls of ring step
    `step`: the whole block without documents; with them the block under a dense boolean mask
    (causal AND same document; none when the mask is all False) or its dense pieces."""
    rows = slice(None)
    qs, ks, causal = _block(cp, step, half)
    if docs is None:
        return [(rows, qs, ks, causal, None)]
    if docs.segments is not None:
        return [(r, q, k, causal, None) for r, q, k in docs.segments[step]]
    src = (cp.ring_rank - step) % cp.ring
    mask = docs.local[:, qs, None] == docs.every[src][:, None, ks]  # (b, sq, sk)
    if step == 0:
        mask &= torch.ones(mask.shape[1:], dtype=torch.bool, device=mask.device).tril()
    return [(rows, qs, ks, causal, mask)] if bool(mask.any()) else []


class _RingAttention(torch.autograd.Function):
    """Causal attention over the ring (see the module docstring), within documents when given
    their `_RingDocuments`.

    Shapes: q (b, h, 2C, d), k/v (b, g, 2C, d).
    """

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, impl: str, docs: _RingDocuments | None):
        b, h, s, d = q.shape
        half = s // 2
        out = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp.ring):
            reqs: list[dist.Work] = []
            if step < cp.ring - 1:
                kv_next, reqs = _exchange(kv, cp, tag=0)
            for rows, qs, ks, causal, mask in _pieces(cp, step, half, docs):
                o, l_ = blocks.attention_forward(
                    q[rows, :, qs], kv[0][rows, :, ks], kv[1][rows, :, ks], causal, impl, mask
                )
                blocks.merge(out[rows, :, qs], lse[rows, :, qs], o, l_)
            _wait(reqs)
            if reqs:
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.impl, ctx.docs = cp, impl, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, impl, docs = ctx.cp, ctx.impl, ctx.docs
        dout = dout.contiguous()
        half = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_reqs: list[dist.Work] = []
        # the accumulator of the block in hand: this rank's own block's starts at step 0
        dkv_in = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(cp.ring):
            kv_reqs: list[dist.Work] = []
            if step < cp.ring - 1:
                kv_next, kv_reqs = _exchange(kv, cp, tag=0)
            _wait(dkv_reqs)
            dkv = dkv_in
            for rows, qs, ks, causal, mask in _pieces(cp, step, half, docs):
                gq, gk, gv = blocks.attention_backward(
                    dout[rows, :, qs],
                    q[rows, :, qs],
                    kv[0][rows, :, ks],
                    kv[1][rows, :, ks],
                    out[rows, :, qs],
                    lse[rows, :, qs],
                    causal,
                    impl,
                    mask,
                )
                dq[rows, :, qs].add_(gq)
                dkv[0][rows, :, ks].add_(gk)
                dkv[1][rows, :, ks].add_(gv)
            # the accumulator goes on with the block it belongs to; after the last step it goes home
            dkv_in, dkv_reqs = _exchange(dkv, cp, tag=1)
            _wait(kv_reqs)
            if kv_reqs:
                kv = kv_next
        _wait(dkv_reqs)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None


# ------------------------------------------------------------------------------------ the module
class ContextAttention(CoreAttention):
    """Causal attention of a context-parallel rank's tokens against the whole sequence.

    q (b, heads, 2c, d), k/v (b, groups, 2c, d) of this rank's chunks -> (b, heads, 2c, d);
    with `Documents` (this rank's tokens' ids), within documents. A CoreAttention, so selective
    recompute wraps it like the plain one.
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
        # How the ring attends within packed documents (one of DOCUMENT_BLOCKS): 'mask', each
        # block under a dense boolean mask (the reference); 'segments', each block cut into its
        # documents' dense pieces, one flash-attention call each; 'auto', segments on CUDA
        # (unless the math backend), the mask elsewhere.
        self.document_blocks = "auto"

    @torch.compiler.disable  # point-to-point rounds and all-to-alls: eager, between compiled graphs
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None = None
    ) -> torch.Tensor:
        cp = self.cp
        if cp.a2a > 1:
            groups = k.shape[1]
            if groups % cp.a2a:  # GQA with fewer kv heads than all-to-all ranks: one per rank
                k, v = (t.repeat_interleave(cp.a2a // groups, dim=1) for t in (k, v))
            q, k, v = (_seq_to_heads(t, cp.a2a_group, cp.a2a) for t in (q, k, v))
        ids = None
        if docs is not None:  # the ids of the tokens q/k/v now hold, in their order
            ids = _gather_documents(docs.ids, cp.a2a_group, cp.a2a) if cp.a2a > 1 else docs.ids
        if cp.ring > 1:
            ring_docs = None
            if ids is not None:
                by = self.document_blocks
                if by not in DOCUMENT_BLOCKS:
                    raise ValueError(
                        f"ContextAttention.document_blocks must be one of {DOCUMENT_BLOCKS}, "
                        f"got {by!r}"
                    )
                segments = by == "segments" or (by == "auto" and q.is_cuda and self.impl != "math")
                ring_docs = _ring_documents(cp, ids, segments)
            out = _RingAttention.apply(q, k, v, cp, self.impl, ring_docs)
        elif ids is not None:
            out = document_attention(q, k, v, Documents(ids))
        else:
            out = sdpa(q, k, v, 0.0, self.backend)
        if cp.a2a > 1:
            out = _heads_to_seq(out, cp.a2a_group, cp.a2a)
        return out


def parallelize_context(model: GPT, mesh: Mesh, comm_type: str = "p2p") -> ContextParallel | None:
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
        assert isinstance(layer, TransformerBlock)  # a GPT's layers
        core = layer.attention.core
        if not isinstance(core, CoreAttention):
            raise ConfigError(
                f"context parallelism wraps a block's attention core, which is a "
                f"{type(core).__name__} here: parallelize the context before recompute"
            )
        layer.attention.core = ContextAttention(core, cp)
    model.context = cp
    return cp
