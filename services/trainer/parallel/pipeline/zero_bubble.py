"""Split backward for zero-bubble schedules: input gradients now, weight gradients later.

A schedule's I action runs a chunk's backward for the input gradient only: every linear layer
of the chunk computes dx = dy W there and, instead of dW = dy^T x, leaves a closure holding
(dy, x) in the `WeightGradStore` under the action's (micro-batch, chunk). The W action runs
those closures, adding into the parameters' gradients, and tells data parallelism that the
gradients are final (so an overlapped reduction can start). Parameters outside linear layers
(norms, biases, embeddings) are small and get their gradients in I, as usual. The GEMMs,
their order of summation and hence the results are the same as a plain backward's; only
their time moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """Deferred weight-gradient closures, per (micro-batch, chunk)."""

    def __init__(self, on_ready: Callable[[nn.Parameter], None] | None = None):
        self.on_ready = on_ready
        # deferred dW computations, each called with whether it is the step's last
        self.collecting: list[Callable[[bool], None]] | None = None
        self.pending: dict[tuple[int, int], list[Callable[[bool], None]]] = {}

    def begin(self, key: tuple[int, int]) -> None:
        """From now on, linear layers' backward defers dW into `key` (until `end`)."""
        self.collecting = self.pending.setdefault(key, [])

    def end(self) -> None:
        self.collecting = None

    def run(self, key: tuple[int, int], final: bool) -> None:
        """Compute and accumulate the deferred dW of `key`; `final`: these are the step's last."""
        for fn in self.pending.pop(key, []):
            fn(final)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """F.linear whose weight gradient is deferred while `begin`..`end` is collecting."""
        param = weight
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            # the parameter travels in a tuple: autograd does not treat it as an input
            return _DeferredLinear.apply(x, weight, bias, self, (param,))

    def _defer(self, param: nn.Parameter, x: torch.Tensor, dy: torch.Tensor) -> bool:
        """Queue dW = dy^T x for `param` while collecting; False (compute it now) otherwise."""
        if self.collecting is None or not param.requires_grad:
            return False

        x, dy = x.detach(), dy.detach()

        @torch.no_grad()
        def compute(final: bool) -> None:
            dw = dy.flatten(0, -2).t() @ x.flatten(0, -2)
            if param.grad is None:
                param.grad = dw.to(param.dtype)
            else:
                param.grad.add_(dw.to(param.grad.dtype))
            if final and self.on_ready is not None:
                self.on_ready(param)

        self.collecting.append(compute)
        return True


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b; backward gives dx (and db) at once, and dW now or through the store.

    `weight` may be autocast's bf16 cast of the parameter; a deferred dW skips the cast's
    backward and is added straight into the fp32 parameter's gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, store, param_box):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.param, ctx.has_bias = store, param_box[0], bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight
        db = dy.flatten(0, -2).sum(0) if ctx.has_bias else None
        if ctx.store._defer(ctx.param, x, dy):
            return dx, None, db, None, None
        return dx, dy.flatten(0, -2).t() @ x.flatten(0, -2), db, None, None


class DeferrableLinear(nn.Module):
    """nn.Linear's parameters (the same objects: names unchanged) computed through a store."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore):
        super().__init__()
        self.weight, self.bias, self.store = linear.weight, linear.bias, store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.store.linear(x, self.weight, self.bias)
