"""One micro-batch's forward and backward as a CUDA graph, captured once and replayed.

A compiled gpt2-125m micro-batch launches about 950 kernels from Python. At small
micro-batches the host cannot launch them as fast as the GPU runs them: gpt2-125m at
micro-batch 4 trained faster with the graph (at micro-batch 16 the GPU is the bottleneck and
the graph changed nothing measurable; measured: BENCHMARKS.md, 'Levers tried and dropped').
Replaying a captured graph launches the whole micro-batch with one call. torch's own routes do
not fit gradient accumulation: `torch.compile(mode="reduce-overhead")` overwrites a graph's
outputs that the next micro-batch's backward still reads (pytorch/pytorch#169545), and
`torch.cuda.make_graphed_callables` hands back static gradient buffers that can corrupt
accumulated `.grad`s (#181723). So the graph here holds the whole micro-batch, forward and
backward, with the gradients accumulated inside it:

- every trainable parameter's `.grad` is allocated before the capture and never replaced:
  autograd adds each micro-batch's gradient into it in place, at a fixed address, and the
  optimizer step and `zero_grad(set_to_none=False)` run outside the graph on the same tensors;
- the micro-batch's tensors are copied into static input buffers before each replay, and
  the loss is read from a static output before the next one overwrites it;
- the capture happens at the start of a step, before any of its micro-batches has run: the
  warm-up calls before it (compilation, autotuning, lazy initialization, all of which
  synchronize or allocate and cannot be captured) run on the first micro-batch and their
  gradients are zeroed again, and the CUDA RNG state is put back so the warm-up leaves no
  trace in the run (dropout's masks are drawn from the generator's offset, which each replay
  advances as the captured kernels do).

    graph = MicroBatchGraph(run, params, device)     # run(tokens, labels, mask): backward, -> loss
    graph.capture(tokens, labels, mask)              # at a step's start, gradients zero
    for tokens, labels, mask in micro_batches:
        total += graph.replay(tokens, labels, mask)  # read the loss before the next replay
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from meshtrain.services.common.errors import MeshtrainError


class MicroBatchGraph:
    """Captures `run` (one micro-batch: forward, loss, backward) as a CUDA graph and replays it.

    Args:
        run: called with (tokens, labels, loss_mask) device tensors; runs the forward and the
            backward of one micro-batch and returns the (detached) loss it added gradients for.
            Everything it does must be capturable: no host synchronization, no data-dependent
            shapes, parameters and gradients at fixed addresses.
        params: the parameters whose `.grad` the backward accumulates into. Each gets a zero
            `.grad` at the capture if it has none; the caller must keep these tensors (zero
            them in place, never set them to None) for as long as it replays.
        device: the CUDA device.
        warmup: calls of `run` before the capture (the first compiles, the second meets the
            compiled backward's first call and any autotuning on the way).
    """

    def __init__(
        self,
        run: Callable[..., torch.Tensor],
        params: Sequence[nn.Parameter],
        device: torch.device,
        warmup: int = 2,
    ):
        if device.type != "cuda":
            raise MeshtrainError(f"a CUDA graph needs a CUDA device, got {device}")
        if warmup < 1:
            raise ValueError(
                f"warmup must be >= 1 (compilation and autotuning cannot be captured), got {warmup}"
            )
        self.run = run
        self.params = [p for p in params if p.requires_grad]
        self.device = device
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self._inputs: tuple[torch.Tensor, ...] = ()
        self._loss: torch.Tensor | None = None
        self._grads: list[torch.Tensor] = []

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def capture(self, *inputs: torch.Tensor) -> None:
        """Warm up on `inputs`, zero the gradients, and capture one micro-batch's graph.

        Call it where the gradients would be zero anyway (a step's start): the warm-up adds
        to them, and they are zeroed afterwards, whatever they held.

        Raises:
            MeshtrainError: something in `run` cannot be captured (the message says what
                CUDA refused); train without the graph (train.cuda_graph=false).
        """
        if self.graph is not None:
            raise MeshtrainError("this micro-batch graph is already captured")
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._grads = [p.grad for p in self.params if p.grad is not None]  # all, set above
        self._inputs = tuple(torch.empty_like(t, device=self.device) for t in inputs)
        for static, t in zip(self._inputs, inputs):
            static.copy_(t)
        rng = torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.run(*self._inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch._foreach_zero_(self._grads)
        torch.cuda.set_rng_state(rng, self.device)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads may make CUDA calls meanwhile (the checkpointer's
            # pinned-buffer allocation, the data client's copies); under the default "global"
            # mode any such call invalidates the capture, depending on timing
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                loss = self.run(*self._inputs)
        except RuntimeError as e:
            raise MeshtrainError(
                f"capturing the micro-batch's forward and backward as a CUDA graph failed: {e}. "
                "Something in the step cannot be captured (a host synchronization, a "
                "data-dependent shape, an allocation outside the graph's pool); train without it: "
                "train.cuda_graph=false"
            ) from e
        if not isinstance(loss, torch.Tensor) or loss.device != self.device:
            raise MeshtrainError(
                f"the captured micro-batch must return its loss as a tensor on {self.device}, "
                f"got {type(loss).__name__}"
            )
        self._check_grads("capture")
        self.graph, self._loss = graph, loss

    def replay(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run the captured micro-batch on `inputs`; its gradients are added to the parameters'
        `.grad`.

        Returns:
            The micro-batch's loss, in a buffer the next replay overwrites: add it to a
            running total (on the device) before replaying again.

        Raises:
            MeshtrainError: not captured yet; an input's shape or dtype differs from the
                captured one's; a parameter's `.grad` was replaced or dropped since.
        """
        if self.graph is None or self._loss is None:
            raise MeshtrainError("replay before capture: call capture() at the first step's start")
        if len(inputs) != len(self._inputs):
            raise MeshtrainError(
                f"the graph was captured with {len(self._inputs)} inputs, got {len(inputs)}"
            )
        for k, (static, t) in enumerate(zip(self._inputs, inputs)):
            if t.shape != static.shape or t.dtype != static.dtype:
                raise MeshtrainError(
                    f"micro-batch input {k} is {tuple(t.shape)} {t.dtype}, but the graph was "
                    f"captured for {tuple(static.shape)} {static.dtype}: a CUDA graph replays "
                    "fixed shapes"
                )
            static.copy_(t, non_blocking=True)
        self._check_grads("replay")
        self.graph.replay()
        return self._loss

    def _check_grads(self, when: str) -> None:
        for p, g in zip(self.params, self._grads):
            if p.grad is not g:
                raise MeshtrainError(
                    f"a parameter of shape {tuple(p.shape)} had its .grad "
                    f"{'dropped' if p.grad is None else 'replaced'} at the {when}; the graph adds "
                    "into the tensors it captured: zero gradients in place "
                    "(zero_grad(set_to_none=False)) while it is in use"
                )
