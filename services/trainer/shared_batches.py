"""One pull per tensor-parallel group: a batch source that one rank reads and its peers share.

Tensor-parallel peers train on the same samples. Pulling them from the data service once per
peer multiplies the network traffic (and the workers' streams) by tp; instead the group's first
rank reads its source and broadcasts each step's micro-batches over a gloo group of the peers
(host memory, so the upload to the device stays what it is without sharing), and the others
rebuild the very same `Batch` objects from it. The batches are the tokens, labels, loss mask
and, when the batches carry them, document ids and positions as int32 planes of one tensor,
after a small header that also carries a failure: when the reading rank's source raises (no
worker served, a bad request), its peers raise a DataError naming that rank instead of waiting
in the broadcast forever.

    shared = GroupSharedSource(source if tp_rank == 0 else None, group, src=ranks[0])
    batches = shared.micro_batches(step)  # on every peer, in the same order
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.loader import Batch

_OK, _FAILED = 0, 1
_HEADER = 6  # status, micro-batches, micro-batch size, positions, optional planes, step
# the optional planes after tokens, labels and loss mask, in order, by their bit in the header
_OPTIONAL = (("document_ids", 1), ("position_ids", 2))


class GroupSharedSource:
    """`micro_batches(step)` of `source`, read on rank `src` and broadcast to `group`."""

    def __init__(self, source, group: dist.ProcessGroup, src: int, shape_of=None):
        """Args:
        source: the batch source, on the reading rank only (None on its peers).
        group: a gloo group of the peers (the reading rank included).
        src: the global rank of the reading rank.
        shape_of: on the peers, a source of the same stream to take `num_micro_batches` and
            `num_steps` from without reading it (None: those are unknown there).
        """
        self.source = source
        self.group = group
        self.src = src
        self._like = source if source is not None else shape_of
        self.pulls = 0  # steps this rank read from its source (tests count them)

    @property
    def reads(self) -> bool:
        """Whether this rank reads the source (the others receive)."""
        return self.source is not None

    @property
    def num_micro_batches(self) -> int:
        return self._like.num_micro_batches

    @property
    def num_steps(self) -> int:
        return self._like.num_steps

    def micro_batches(self, step: int) -> list[Batch]:
        """The step's micro-batches, identical on every peer.

        Raises:
            DataError: the reading rank's source failed (on that rank: its own error).
        """
        if self.source is not None:
            return self._send(step)
        return self._receive(step)

    def _send(self, step: int) -> list[Batch]:
        try:
            batches = self.source.micro_batches(step)
        except BaseException:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0], header[5] = _FAILED, step
            dist.broadcast(header, self.src, group=self.group)
            raise
        self.pulls += 1
        first = batches[0]
        extra = [name for name, _ in _OPTIONAL if getattr(first, name) is not None]
        bits = sum(bit for name, bit in _OPTIONAL if name in extra)
        mbs, positions = first.tokens.shape  # (micro_batch, positions)
        header = torch.tensor([_OK, len(batches), mbs, positions, bits, step], dtype=torch.int64)
        dist.broadcast(header, self.src, group=self.group)
        payload = torch.empty(len(batches), 3 + len(extra), mbs, positions, dtype=torch.int32)
        for i, b in enumerate(batches):  # (n, planes, micro_batch, positions)
            payload[i, 0] = b.tokens
            payload[i, 1] = b.labels
            payload[i, 2] = b.loss_mask.view(torch.int32)  # the float32 bits, exactly
            for k, name in enumerate(extra):
                payload[i, 3 + k] = getattr(b, name)
        dist.broadcast(payload, self.src, group=self.group)
        return batches

    def _receive(self, step: int) -> list[Batch]:
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, self.src, group=self.group)
        status, n, mbs, positions, bits, sent_step = header.tolist()
        if status == _FAILED:
            raise DataError(
                f"rank {self.src}, which reads the data for its tensor-parallel group, failed to "
                f"read step {step}: its log says why"
            )
        if sent_step != step:
            raise DataError(
                f"rank {self.src} shared step {sent_step} while this rank asked for step {step}: "
                "the tensor-parallel peers are out of step"
            )
        extra = [name for name, bit in _OPTIONAL if bits & bit]
        payload = torch.empty(n, 3 + len(extra), mbs, positions, dtype=torch.int32)
        dist.broadcast(payload, self.src, group=self.group)
        return [
            Batch(
                tokens=payload[i, 0].long(),
                labels=payload[i, 1].long(),
                loss_mask=payload[i, 2].clone().view(torch.float32),
                step=step,
                microbatch=i,
                **{name: payload[i, 3 + k].clone() for k, name in enumerate(extra)},
            )
            for i in range(n)
        ]

    def close(self) -> None:
        closer = getattr(self.source, "close", None)
        if closer is not None:
            closer()
