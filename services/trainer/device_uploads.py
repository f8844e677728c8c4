"""A step's micro-batches to the GPU ahead of the compute that reads them.

When a step begins, all of its micro-batches are already on the host: the data source
returns them as one list, and the service client prefetches further steps behind that. On
CUDA, `Uploader.upload` pins every tensor of the step and copies it to the device on a side
stream, all at once, then hands the micro-batches out in order. Before the compute stream
reads a micro-batch it waits on that micro-batch's own copy (a device-side event wait, so the
host never blocks). The copies run on a copy engine while the compute stream is still busy
with the work the host queued before (the host runs ahead of the GPU), instead of each one
waiting its turn in the compute stream between one micro-batch's backward and the next
forward.

Only the current step's batches are uploaded early: fetching the next step's before this one
ends would move the data source's position ahead of the checkpointed step.

Elsewhere (CPU) tensors pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


class Uploader:
    """Copies micro-batches host -> `device` on a side stream (CUDA), or passes them through."""

    def __init__(self, device: torch.device):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def upload(
        self, batches: Sequence[Sequence[torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Each micro-batch's tensors on the device, in order; every copy is issued before the first
        is yielded.

        Args:
            batches: one sequence of host tensors per micro-batch (e.g. tokens, labels, mask).
                Tensors already on the device are handed out as they are.

        Yields:
            A tuple per micro-batch, ready for the current stream to read: it waits on the
            micro-batch's copy, and the tensors are recorded as used there, so the allocator
            does not reuse their memory while the compute stream may still read them.
        """
        if self.stream is None:
            for tensors in batches:
                yield tuple(tensors)
            return
        compute = torch.cuda.current_stream(self.device)
        staged = []
        with torch.cuda.stream(self.stream):
            for tensors in batches:
                # pinned staging, so the copy is asynchronous; the host allocator keeps each
                # pinned buffer until the copy stream's copy of it has run
                on_device = tuple(
                    t
                    if t.device == self.device
                    else t.pin_memory().to(self.device, non_blocking=True)
                    for t in tensors
                )
                done = torch.cuda.Event()
                done.record(self.stream)
                staged.append((on_device, done))
        for on_device, done in staged:
            compute.wait_event(done)
            for t in on_device:
                t.record_stream(compute)
            yield on_device
