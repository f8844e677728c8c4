"""bf16 copies of the matmul weights, cast once per optimizer step instead of once per micro-batch.

Under bf16 autocast each `F.linear` casts its fp32 weight (and bias) to bf16 in every
micro-batch's forward, and in backward its bf16 weight gradient goes back through that cast to
fp32 before autograd adds it to `.grad`: per parameter and micro-batch a 6-byte cast, a 6-byte
gradient cast and a 12-byte accumulation. The MoE experts' grouped GEMMs cast their stacked
weights the same way (`model.moe.StackedWeight`), and in a MoE model those are most of the
parameters, each seen by a fraction of the tokens, so the casts weigh more there than beside a
dense layer's GEMMs. `WeightCopies` keeps one bf16 copy of each `nn.Linear` parameter and of
each stacked expert weight instead (a leaf tensor), refreshed from its fp32 parameter once per
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

With `fuse_weight_grads` (train.gradient_accumulation_fusion, Megatron-LM's
--gradient-accumulation-fusion) the linear layers' weight copies take no gradient at all: each
`nn.Linear` whose weight is copied runs `_LinearIntoMainGrad`, whose backward adds the weight
gradient into the fp32 parameter's `.grad` inside the weight-gradient GEMM
(`accumulate_weight_grad`: on CUDA cuBLAS with an fp32 output and beta = 1). That drops the bf16
gradient's write and read (4 of the 12 bytes per weight and micro-batch above) and the separate
add's launch; the fp32 read and write move into the GEMM's epilogue, beside its arithmetic. The
micro-batch's gradient is no longer rounded to bf16 before it is added (more exact than
autocast, so not bit for bit its values). The `.grad`s must exist before the backward: `refresh`
allocates the missing ones as zeros.

The experts' copies keep the hook by default (torch's grouped GEMM writes its weight gradient in
bf16, with no fp32 output to add into): 12 bytes moved per expert weight element and
micro-batch, against 26 under autocast (the casts, the accumulation and the GEMM's bf16 write).
With `fuse_expert_weight_grads` (train.expert_gradient_accumulation_fusion) each
`StackedWeight` gets a `main_weight` too, and the experts' backward adds each expert's weight
gradient into the fp32 `.grad` in a GEMM of its own
(`model.main_grad.accumulate_expert_weight_grads`, Transformer Engine's grouped linear with
host-side split sizes): the per-expert counts are read on the host once per expert GEMM in
backward, a device synchronization per MoE layer, projection and micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.services.trainer.model.main_grad import accumulate_weight_grad, fused_main_grad
from meshtrain.services.trainer.model.moe import StackedWeight


class WeightCopies:
    """Compute-dtype leaf copies of every `nn.Linear` parameter and stacked expert weight of a
    model (see the module doc).

    Args:
        model: its `nn.Linear` weights and biases get copies; a parameter shared by several
            modules (tied) gets one copy under each of its names.
        dtype: the copies' dtype (bf16: autocast's compute dtype).
        fuse_weight_grads: add the linear layers' weight gradients into the fp32 `.grad`s inside
            the weight-gradient GEMM (see the module doc). The modules that are exactly
            `nn.Linear` become `MainGradLinear`s for it (their parameters, state dict and
            forward on their own fp32 weights unchanged).
        fuse_expert_weight_grads: the same for the stacked expert weights, one GEMM per expert
            (see the module doc): each `StackedWeight` gets its `main_weight`.
    """

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        fuse_weight_grads: bool = False,
        fuse_expert_weight_grads: bool = False,
    ):
        self.copies: dict[
            str, torch.Tensor
        ] = {}  # parameter name -> copy (what functional_call takes)
        self._pairs: list[
            tuple[torch.Tensor, nn.Parameter]
        ] = []  # (copy, fp32 parameter), one per parameter
        self._main_grads: dict[
            int, torch.Tensor
        ] = {}  # the fused weights, whose .grad the GEMMs add into
        by_param: dict[int, torch.Tensor] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            if not isinstance(module, (nn.Linear, StackedWeight)):
                continue
            if isinstance(module, StackedWeight):
                fuse = fuse_expert_weight_grads
            else:  # a MainGradLinear, or a linear that adds into it itself (Fp8Linear)
                fuse = fuse_weight_grads and (
                    type(module) in (nn.Linear, MainGradLinear)
                    or getattr(module, "adds_into_main_grad", False)
                )
            if fuse and module.weight.requires_grad:
                if type(module) is nn.Linear:
                    module.__class__ = MainGradLinear
                setattr(module, "main_weight", (module.weight,))
                self._main_grads[id(module.weight)] = module.weight
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                copy = by_param.get(id(param))
                if copy is None:
                    if not param.is_floating_point() or param.dtype == dtype:
                        raise ValueError(
                            f"{name}: weight copies need a floating-point parameter wider than "
                            f"{dtype}, got {param.dtype}"
                        )
                    copy = torch.empty_like(param, dtype=dtype).requires_grad_(param.requires_grad)
                    if param.requires_grad:
                        copy.register_post_accumulate_grad_hook(_accumulate_into(param))
                    by_param[id(param)] = copy
                    self._pairs.append((copy, param))
                self.copies[name] = copy
        if not self._pairs:
            raise ValueError(
                f"{type(model).__name__} has no nn.Linear or stacked expert parameters to copy"
            )
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast every fp32 parameter into its copy (after each optimizer step or parameter load);
        with fused weight gradients, give each fused weight a zero `.grad` where it has none."""
        copies, params = zip(*self._pairs)
        torch._foreach_copy_(list(copies), list(params))
        for param in self._main_grads.values():
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    @property
    def fused(self) -> bool:
        """Whether any weight gradient is added inside its GEMM (`fuse_weight_grads` found a
        layer)."""
        return bool(self._main_grads)

    def numel(self) -> int:
        """Elements copied (each parameter once)."""
        return sum(p.numel() for _, p in self._pairs)


def call_with(model: nn.Module, copies: dict[str, torch.Tensor], *args, **kwargs):
    """`model(*args, **kwargs)` with `copies` (a `WeightCopies.copies`) in place of those
    parameters.

    The copies are an argument, not looked up, so that torch.compile of this (with the model
    bound) takes them as graph inputs.
    """
    return torch.func.functional_call(model, copies, args, kwargs)


@contextlib.contextmanager
def running_on(model: nn.Module, copies: dict[str, torch.Tensor]) -> Iterator[None]:
    """`model` with `copies` in place of those parameters until the block exits, so a backward
    run inside it recomputes on them too.

    `call_with` swaps the copies in for the forward only; a checkpoint that recomputes its blocks
    in backward then runs them on the fp32 parameters under autocast: the same values in eager,
    but a block compiled on its own traces another graph for them, whose saved tensors are not
    the forward's (the checkpoint refuses them). Held over forward and backward, the recompute
    runs the forward's graph.
    """
    with torch.nn.utils.stateless._reparametrize_module(model, copies, tie_weights=True):
        yield


def forward_on_copies(
    model: nn.Module,
    forward: Callable[..., Any],
    per_block: bool,
    compile_model: bool,
    options: dict | None,
) -> tuple[
    Callable[..., Any], Callable[[dict[str, torch.Tensor] | None], AbstractContextManager[None]]
]:
    """How a micro-batch runs on the bf16 weight copies: (run(copies, *batch), held(copies), the
    context its forward and backward run inside).

    per_block (the model's blocks compiled in place, `build.compiles_per_block`): `forward` runs
    with the copies held over the backward too (`running_on`), so a recomputed block runs the
    same compiled graph on the same weights. Else the copies go in as the arguments of
    `call_with`, compiled whole when `compile_model`, so they are the graph's inputs.
    """
    if per_block:
        return (lambda copies, *batch: forward(*batch)), functools.partial(running_on, model)
    on_copies = functools.partial(call_with, model)
    run = torch.compile(on_copies, options=options) if compile_model else on_copies
    return run, lambda copies: contextlib.nullcontext()


def _accumulate_into(param: nn.Parameter):
    """A hook for a copy: its gradient added (in fp32) to `param.grad`, then released."""

    @torch.no_grad()
    def hook(copy: torch.Tensor) -> None:
        if copy.grad is None:  # a fused GEMM's backward added into param.grad itself
            return
        if param.grad is None:
            param.grad = copy.grad.to(param.dtype)
        else:
            param.grad.add_(copy.grad)
        copy.grad = None

    return hook


class _LinearIntoMainGrad(torch.autograd.Function):
    """y = x @ weight^T + bias on a compute-dtype copy; backward adds the weight's gradient into
    `main_grad` (returning none for the copy) and returns the input's and the bias's as usual."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        x_c = x.to(weight.dtype)  # autocast's cast, kept for the weight gradient
        ctx.save_for_backward(x_c, weight)
        # Not saved: a tied weight's backward adds into it between this forward and the backward.
        ctx.main_grad = main_grad
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        return F.linear(x_c, weight, None if bias is None else bias.to(weight.dtype))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        accumulate_weight_grad(ctx.main_grad, dy, x)
        dx = (dy @ weight).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        db = (
            dy.reshape(-1, dy.shape[-1]).sum(0)
            if ctx.has_bias and ctx.needs_input_grad[2]
            else None
        )
        return dx, None, db, None


class MainGradLinear(nn.Linear):
    """An `nn.Linear` whose gradient accumulation is fused (`WeightCopies(fuse_weight_grads=True)`).

    Given a narrower copy of its weight (under `call_with`) it runs `_LinearIntoMainGrad`
    against the fp32 weight's `.grad`. On its own fp32 weight it does the same under autocast
    with gradients on and a `.grad` to add into, with autocast's cast of the weight: that is
    activation recompute's second forward, which runs after `call_with` has put the fp32
    weights back and must save what the first one saved. Otherwise (evaluation, no `.grad`
    yet) it is `nn.Linear`.
    """

    main_weight: tuple[torch.Tensor]  # the fp32 weight, in a tuple: not registered twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main = self.main_weight[0]
        weight: torch.Tensor = self.weight
        bias: torch.Tensor | None = self.bias
        main_grad = fused_main_grad(weight, main)
        if main_grad is None:
            return super().forward(x)
        if weight.dtype == main.dtype:  # the recomputed forward: autocast's cast of the weight
            dtype = torch.get_autocast_dtype(x.device.type)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        return _LinearIntoMainGrad.apply(x, weight, bias, main_grad)
