"""The decode step of `batched_sampling.sample_rows` as a CUDA graph, captured once per shape and
replayed for every token.

One decode step of a 1B model (one token per row through every block, the logits, the draw, the
log-prob) launches a few hundred small kernels; at rollout batch sizes the GPU finishes them
faster than Python launches them, so an eager step is bound by the host. The step runs on static
buffers (a fixed-capacity key/value cache, a per-row key mask, a step counter on the device,
preallocated token and log-prob outputs), so its shapes and addresses never change between
steps and one `torch.cuda.CUDAGraph` replays it whole.

`DecodeGraphs` keeps the captured steps of one model, keyed by what a capture bakes in (batch,
cache capacity, sampling settings, dtypes): a later call of the same key reuses the graph and its
buffers, after refilling them. The graphs read the parameters at the addresses they had at the
capture: weights copied in place (the rollout engine's `set_weights`, an optimizer's step) are
seen by the next replay; a parameter whose storage was replaced drops every graph (they are
captured again at the next call).

    graphs = DecodeGraphs()
    sample_rows(model, prompts, seeds, indices, 128, graphs=graphs)   # captures, then replays
    sample_rows(model, prompts, seeds, indices, 128, graphs=graphs)   # replays
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from meshtrain.services.common.errors import MeshtrainError
from meshtrain.services.trainer.model.moe import MoE


def weights_signature(model: nn.Module) -> tuple:
    """Where the parameters and buffers live (address, dtype, shape): a graph captured under one
    signature reads stale memory under another."""
    tensors = list(model.parameters()) + list(model.buffers())
    for name in ("rope_cos", "rope_sin"):  # plain attributes on a GPT, read by the step
        t = getattr(model, name, None)
        if isinstance(t, torch.Tensor):
            tensors.append(t)
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors)


def graphable(model: nn.Module, device: torch.device) -> str | None:
    """Why the decode step of `model` cannot be captured on `device` (None: it can)."""
    if device.type != "cuda":
        return f"a CUDA graph needs a CUDA device, not {device.type}"
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "the parameters are sharded (DTensor): the forward gathers them"
    if any(isinstance(m, MoE) for m in model.modules()):
        return "mixture-of-experts routing has data-dependent shapes"
    return None


class StepGraph:
    """`step()` (no arguments, all its tensors static) captured as a CUDA graph.

    Args:
        step: the work of one decode step; reads and writes only tensors allocated before the
            capture, with no host synchronization and no data-dependent shape.
        device: the CUDA device.
        warmup: eager calls on a side stream before the capture (lazy initialization, Triton
            compilation and cuBLAS workspaces cannot be captured). They change the buffers the
            step writes: the caller refills them afterwards.
    """

    def __init__(self, step: Callable[[], None], device: torch.device, warmup: int = 2):
        if device.type != "cuda":
            raise MeshtrainError(f"a CUDA graph needs a CUDA device, got {device}")
        self.step = step
        self.graph = torch.cuda.CUDAGraph()
        # Under the caller's autocast (GRPO's bf16) the weights' casts must be captured as
        # kernels: with autocast's cache on, the capture would read the cached copies, which are
        # freed when the caller's autocast ends and never see the next optimizer step.
        autocast = torch.autocast(
            "cuda",
            dtype=torch.get_autocast_dtype("cuda"),
            enabled=torch.is_autocast_enabled("cuda"),
            cache_enabled=False,
        )
        try:
            with autocast:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        step()
                torch.cuda.current_stream(device).wait_stream(side)
                torch.cuda.synchronize(device)
                # thread_local: another thread's CUDA call (a gRPC handler staging weights, the
                # checkpointer) must not invalidate the capture, as "global" mode would
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                    step()
        except RuntimeError as e:
            raise MeshtrainError(
                f"capturing the decode step as a CUDA graph failed: {e}. Something in the step "
                "cannot be captured; sample without graphs (rollout: --no-cuda-graphs; GRPO: "
                "grpo.rollout_cuda_graphs = false)"
            ) from e

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """The captured decode steps of one model, least recently used dropped past `max_graphs`.

    Not thread-safe: one sampler at a time (the rollout engine holds its lock while sampling).

    Args:
        max_graphs: graphs kept; each holds its own key/value cache and workspace, so this bounds
            the memory they keep between calls.
        enabled: False: `sample_rows` runs the same static-shape step eagerly.
    """

    def __init__(self, max_graphs: int = 4, enabled: bool = True):
        if max_graphs < 1:
            raise MeshtrainError(f"max_graphs must be >= 1, got {max_graphs}")
        self.max_graphs = max_graphs
        self.enabled = enabled
        self._entries: OrderedDict[Hashable, tuple[Any, StepGraph | None]] = OrderedDict()
        self._signature: tuple | None = None
        self.captures = 0
        """Graphs captured so far (a test's and a benchmark's way to see reuse)."""
        self.skipped: str | None = None
        """Why a decode ran without a graph although enabled (a CPU model, a failed capture)."""

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every graph and its buffers (their memory returns to the allocator)."""
        self._entries.clear()

    def check_weights(self, model: nn.Module) -> None:
        """Drop the graphs if a parameter or buffer of `model` moved since they were captured."""
        signature = weights_signature(model)
        if signature != self._signature:
            self.clear()
            self._signature = signature

    def state(self, key: Hashable) -> Any:
        """The static buffers kept under `key` (None: none yet); marks the key recently used."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key][0]

    def graph(self, key: Hashable) -> StepGraph | None:
        entry = self._entries.get(key)
        return entry[1] if entry is not None else None

    def keep(self, key: Hashable, state: Any, graph: StepGraph | None) -> None:
        """Keep `state` and its captured `graph` under `key`, dropping the least recently used
        entry past `max_graphs`."""
        if graph is not None:
            self.captures += 1
        self._entries[key] = (state, graph)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_graphs:
            self._entries.popitem(last=False)
