"""Fused ops and their dispatch.

The model calls ops through this module, never through a specific implementation. Today
every op resolves to `kernels.reference` (plain torch: the spec and the CPU path); Triton
kernels land as `kernels/<op>.py` and register in `_FAST`, after which CUDA tensors take them.
`MESHTRAIN_KERNELS=reference` forces the reference everywhere; `=triton` makes a missing
Triton kernel an error instead of a silent fallback.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from kernels import reference

OPS = ("rms_norm", "layer_norm", "gelu", "swiglu", "rope", "cross_entropy", "linear_cross_entropy")

# op name -> Triton implementation, filled in as kernels are written.
_FAST: dict[str, Callable] = {}


def mode() -> str:
    """The dispatch mode from MESHTRAIN_KERNELS: 'auto' (default), 'reference' or 'triton'."""
    value = os.environ.get("MESHTRAIN_KERNELS", "auto")
    if value not in ("auto", "reference", "triton"):
        raise ValueError(f"MESHTRAIN_KERNELS={value!r}; allowed: auto, reference, triton")
    return value


def resolve(op: str, on_cuda: bool) -> Callable:
    """The implementation of `op` for tensors on CUDA (`on_cuda`) or elsewhere."""
    m = mode()
    if m == "reference" or (m == "auto" and not on_cuda):
        return getattr(reference, op)
    if op in _FAST and on_cuda:
        return _FAST[op]
    if m == "triton":
        raise RuntimeError(f"MESHTRAIN_KERNELS=triton but op {op!r} has no Triton kernel for this device")
    return getattr(reference, op)


def _dispatching(op: str) -> Callable:
    ref = getattr(reference, op)

    def call(x: torch.Tensor, *args, **kwargs):
        return resolve(op, x.is_cuda)(x, *args, **kwargs)

    call.__name__ = op
    call.__doc__ = ref.__doc__
    return call


rms_norm = _dispatching("rms_norm")
layer_norm = _dispatching("layer_norm")
gelu = _dispatching("gelu")
swiglu = _dispatching("swiglu")
rope = _dispatching("rope")
cross_entropy = _dispatching("cross_entropy")
linear_cross_entropy = _dispatching("linear_cross_entropy")
rope_cos_sin = reference.rope_cos_sin
