"""bf16 copies of the matmul weights, cast once per optimizer step instead of once per micro-batch.

Under bf16 autocast each `F.linear` casts its fp32 weight (and bias) to bf16 in every
micro-batch's forward, and in backward its bf16 weight gradient goes back through that cast to
fp32 before autograd adds it to `.grad`: per parameter and micro-batch a 6-byte cast, a 6-byte
gradient cast and a 12-byte accumulation. `WeightCopies` keeps one bf16 copy of each
`nn.Linear` parameter instead (a leaf tensor), refreshed from its fp32 parameter once per
step; the model runs on the copies through `torch.func.functional_call`, and a
post-accumulate-grad hook adds each copy's bf16 gradient into its fp32 parameter's `.grad`
(10 bytes) and drops it. The fp32 parameters stay the model's parameters (the optimizer's
master weights, what checkpoints hold); nothing else in the trainer sees the copies.

The values are autocast's: the copy is the same rounding of the same fp32 weight, and adding
a bf16 gradient to an fp32 sum equals adding its (exact) fp32 cast. Embeddings and norm
weights keep their fp32 parameters (an embedding lookup is not autocast, and the residual
stream's dtype is `model.fp32_residual_connection`'s choice, not the table's).

    copies = WeightCopies(model, torch.bfloat16)
    copies.refresh()                                            # once per step, after the update
    loss = call_with(model, copies.copies, tokens, labels, mask)  # under autocast, per micro-batch
    loss.backward()                                             # fp32 .grad of model's parameters
"""

from __future__ import annotations

import torch
from torch import nn


class WeightCopies:
    """Compute-dtype leaf copies of every `nn.Linear` parameter of a model (see the module doc).

    Args:
        model: its `nn.Linear` weights and biases get copies; a parameter shared by several
            modules (tied) gets one copy under each of its names.
        dtype: the copies' dtype (bf16: autocast's compute dtype).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.copies: dict[str, torch.Tensor] = {}  # parameter name -> copy (what functional_call takes)
        self._pairs: list[tuple[torch.Tensor, nn.Parameter]] = []  # (copy, fp32 parameter), one per parameter
        by_param: dict[int, torch.Tensor] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            if not isinstance(module, nn.Linear):
                continue
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                copy = by_param.get(id(param))
                if copy is None:
                    if not param.is_floating_point() or param.dtype == dtype:
                        raise ValueError(f"{name}: weight copies need a floating-point parameter wider than "
                                         f"{dtype}, got {param.dtype}")
                    copy = torch.empty_like(param, dtype=dtype).requires_grad_(param.requires_grad)
                    if param.requires_grad:
                        copy.register_post_accumulate_grad_hook(_accumulate_into(param))
                    by_param[id(param)] = copy
                    self._pairs.append((copy, param))
                self.copies[name] = copy
        if not self._pairs:
            raise ValueError(f"{type(model).__name__} has no nn.Linear parameters to copy")
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast every fp32 parameter into its copy (after each optimizer step or parameter load)."""
        copies, params = zip(*self._pairs)
        torch._foreach_copy_(list(copies), list(params))

    def numel(self) -> int:
        """Elements copied (each parameter once)."""
        return sum(p.numel() for _, p in self._pairs)



def call_with(model: nn.Module, copies: dict[str, torch.Tensor], *args, **kwargs):
    """`model(*args, **kwargs)` with `copies` (a `WeightCopies.copies`) in place of those parameters.

    The copies are an argument, not looked up, so that torch.compile of this (with the model
    bound) takes them as graph inputs.
    """
    return torch.func.functional_call(model, copies, args, kwargs)


def _accumulate_into(param: nn.Parameter):
    """A hook for a copy: its gradient added (in fp32) to `param.grad`, then released."""

    @torch.no_grad()
    def hook(copy: torch.Tensor) -> None:
        if param.grad is None:
            param.grad = copy.grad.to(param.dtype)
        else:
            param.grad.add_(copy.grad)
        copy.grad = None

    return hook
