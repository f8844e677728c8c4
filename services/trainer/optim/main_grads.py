"""bf16 device parameters with fp32 gradients beside them (Megatron-LM's `main_grad`), for the
offloaded optimizer's bf16 mode (optim.offload_bf16_params).

Where the fp32 master weights live on the host (`offload.OffloadedAdamW`), the device needs only
a bf16 copy of each parameter to run the model on: 2 bytes instead of 4. Its gradient is not
accumulated in bf16, though: a micro-batch's bf16 gradient, rounded once by the backward as
under autocast, is added into an fp32 `main_grad` by a post-accumulate-grad hook, and the bf16
`.grad` is dropped at once, so the sum over micro-batches is an fp32 sum (4 bytes a parameter,
as the fp32 `.grad` it replaces). Everything that reads a step's gradient (clipping, the
data-parallel reduction, the optimizer) reads `grad_of(p)`: the `main_grad` where there is one,
else `.grad`.

    to_bf16(params)                       # after the optimizer has read its fp32 masters
    attach_main_grads(params)             # one flat fp32 buffer, a view per parameter
    loss.backward()                       # p.grad stays None; p.main_grad holds the sum
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient a step applies to `p`: its fp32 `main_grad` where it has one, else `.grad`."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


@torch.no_grad()
def to_bf16(params: Sequence[nn.Parameter]) -> None:
    """Replace each fp32 parameter's data by its bf16 rounding, in place (the same Parameter
    objects, so optimizer state and hooks keyed by them stay valid)."""
    for p in params:
        if p.dtype != torch.float32:
            raise ValueError(f"bf16 device parameters are cast from fp32 ones, got {p.dtype}")
        p.data = p.data.to(torch.bfloat16)


def attach_main_grads(
    params: Sequence[nn.Parameter], views: Sequence[torch.Tensor] | None = None
) -> torch.Tensor | None:
    """Give each parameter an fp32 `main_grad` that its backward adds into.

    Args:
        params: bf16 parameters (their `.grad` must be None: it is dropped after every add).
        views: where each `main_grad` lives (the data-parallel buckets' fp32 views); unset: one
            zeroed flat fp32 buffer for all of them, on their device.

    Returns:
        The flat buffer, when one was made (zero it with one kernel), else None.
    """
    flat = None
    if views is None:
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        views, off = [], 0
        for p in params:
            views.append(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
    for p, v in zip(params, views, strict=True):
        if p.grad is not None:
            raise ValueError("a parameter given a main_grad still has a .grad: zero it to None")
        if v.dtype != torch.float32 or v.shape != p.shape:
            raise ValueError(
                f"a main_grad is fp32 of the parameter's shape, got {v.dtype} {v.shape}"
            )
        p.main_grad = v  # type: ignore[attr-defined]
        p.register_post_accumulate_grad_hook(_into_main_grad)
    return flat


@torch.no_grad()
def _into_main_grad(p: torch.Tensor) -> None:
    """Add the micro-batch's bf16 gradient into the fp32 sum and drop it (its memory is free
    before the next layer's backward)."""
    if p.grad is None:
        return
    p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
    p.grad = None
