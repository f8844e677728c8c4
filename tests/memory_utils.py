"""What a forward keeps for backward, and the most memory a step holds, measured on CPU.

`saved_bytes` counts the storages autograd saves for backward (an outer saved-tensors hook sees
eager nodes and a compiled graph's `ctx.save_for_backward` alike; a non-reentrant checkpoint's
own hook hides what its region saves, as the checkpoint drops it). `peak_allocated_bytes` reads
the CPU allocator's allocation and free events from the profiler, so it also sees the buffers
Inductor's generated code allocates and frees inside a compiled backward, which no hook sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn()` runs, those of
    `exclude` (e.g. the parameters, held anyway) not counted."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held above its level at the start, while `fn()` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:  # + an allocation, - a free
        live += nbytes
        peak = max(peak, live)
    return peak
