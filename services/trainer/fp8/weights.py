"""FP8 weights cast once per optimizer step, beside the bf16 weight copies: dense and experts.

Under bf16 weight copies (one process) a weight does not change between the micro-batches of a
step, yet an FP8 layer would take its amax, cast it and transpose it in every micro-batch's
forward. `Fp8WeightCache` does that once per step (one fused pass writes both layouts where the
recipe fuses its casts), right after `WeightCopies.refresh`, into
buffers allocated once: per FP8 layer the e4m3 weight (N, K), its transpose (K, N) (the
column-major operand of the input-gradient GEMM) and its scale. The trainer hands them to the
model with the copies (`entries`, names `<layer>.fp8_weight*`, which `functional_call` puts in
place of the layers' empty buffers); anything that runs the model without them (evaluation,
activation recompute's second forward, a multi-process run) casts in the layer as before, to the
same values: the cast is of the same bf16 weight with the same scale. Fully sharded parameters
(FSDP2) get no cache: each layer casts the weight FSDP2 has just gathered (in fp32) in its
forward, so the cast follows every optimizer step by construction, and a cache would hold every
layer's whole FP8 weight for the step, past each reshard. Delayed scaling records
the weight's amax here, once per step instead of once per micro-batch (the max is the same).
Rowwise scaling of the dense layers has no per-tensor weight cast to keep, and is left out.

FP8 experts (`Fp8GroupedExperts`, train.fp8_experts; row-scaled e4m3 whatever the dense recipe,
so under rowwise dense layers too) get the same treatment: per block and per fc1/fc2 weight
(G, N, K) the e4m3 weight and its per-row factors (G, N), and the e4m3 transpose (G, K, N) with
its factors (G, K), `quantize_weight` of the weight once per step (entries
`<block>.mlp.experts.fp8_fc*`) from the expert weight's bf16 copy, the same bf16 values the
layer would quantize. Memory: 2 bytes per expert weight element (both layouts), half the fp32
weights' bytes.

    cache = Fp8WeightCache(model, fp8)  # None-safe: `for_run` returns None where it does not apply
    copies.refresh(); cache.refresh(copies.copies)
    loss = call_with(model, {**copies.copies, **cache.entries}, ...)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.services.trainer.fp8.convert import Fp8Model
from meshtrain.services.trainer.fp8.experts import (
    FP8_EXPERT_BUFFERS,
    Fp8GroupedExperts,
    quantize_weight,
)
from meshtrain.services.trainer.fp8.linear import Fp8Linear
from meshtrain.services.trainer.fp8.scaling import (
    E4M3,
    amax_to_scale,
    cast_transpose,
    tensor_amax,
)


class Fp8WeightCache:
    """This step's FP8 weights of a model's `Fp8Linear` layers (per-tensor recipes) and
    `Fp8GroupedExperts` (see the module doc)."""

    def __init__(self, model: nn.Module, fp8: Fp8Model):
        self.fp8 = fp8
        self.entries: dict[str, torch.Tensor] = {}
        self._layers: list[tuple[str, Fp8Linear, int | None]] = []  # (name, layer, delayed index)
        self._experts: list[tuple[str, Fp8GroupedExperts]] = []
        fmt = fp8.recipe.dtypes.forward
        for name, layer in model.named_modules():
            if isinstance(layer, Fp8GroupedExperts):
                self._add_experts(name, layer)
            if not isinstance(layer, Fp8Linear) or fp8.recipe.recipe == "rowwise":
                continue
            w = layer.weight
            delayed = layer.fp8.delayed
            self._layers.append((name, layer, delayed[1] if delayed is not None else None))
            self.entries[f"{name}.fp8_weight"] = torch.empty(w.shape, dtype=fmt, device=w.device)
            self.entries[f"{name}.fp8_weight_t"] = torch.empty(
                w.shape[::-1], dtype=fmt, device=w.device
            )
            self.entries[f"{name}.fp8_weight_scale"] = torch.empty((), device=w.device)

    def _add_experts(self, name: str, experts: Fp8GroupedExperts) -> None:
        """Buffers for one block's expert weights: per fc (G, N, K) the e4m3 weight and its
        factors (G, N), the e4m3 transpose (G, K, N) and its factors (G, K)."""
        self._experts.append((name, experts))
        shapes = []
        for fc in (experts.fc1, experts.fc2):
            g, n, k = fc.weight.shape
            shapes += [((g, n, k), E4M3), ((g, n), torch.float32)]
            shapes += [((g, k, n), E4M3), ((g, k), torch.float32)]
        device = experts.fc1.weight.device
        for buffer, (shape, dtype) in zip(FP8_EXPERT_BUFFERS, shapes, strict=True):
            self.entries[f"{name}.{buffer}"] = torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def for_run(model: nn.Module, fp8: Fp8Model | None) -> "Fp8WeightCache | None":
        """A cache where one applies: dense FP8 layers with one scale per tensor, or FP8 experts
        (row-scaled whatever the dense recipe), whose weights are whole tensors (not FSDP2's
        shards: see the module doc)."""
        if fp8 is None:
            return None
        if any(isinstance(p, DTensor) for p in model.parameters()):
            return None
        cache = Fp8WeightCache(model, fp8)
        return cache if cache._layers or cache._experts else None

    @torch.no_grad()
    def refresh(self, copies: dict[str, torch.Tensor]) -> None:
        """Cast each layer's weight copy (`copies`: `WeightCopies.copies`) into the buffers."""
        recipe = self.fp8.recipe
        fmt, state, fused = recipe.dtypes, self.fp8.delayed, recipe.fused_now()
        for name, _, index in self._layers:
            w = copies[f"{name}.weight"].to(torch.bfloat16)  # (N, K)
            scale = self.entries[f"{name}.fp8_weight_scale"]
            out = self.entries[f"{name}.fp8_weight"], self.entries[f"{name}.fp8_weight_t"]
            if index is not None and state is not None and state.ready:
                scale.copy_(state.scale[index, 1])  # the history's scale; the amax of the cast
                amax = cast_transpose(w, scale, fmt.forward, fused, True, True, *out)[2]
                assert amax is not None  # asked for (with_amax)
                aw = amax
            else:  # the current amax first, then the cast
                aw = tensor_amax(w, fused)
                scale.copy_(amax_to_scale(aw, fmt.forward_max, recipe.margin))
                cast_transpose(w, scale, fmt.forward, fused, True, False, *out)
            if index is not None and state is not None:  # a delayed index comes with its state
                state.history[index, 1, 0] = torch.maximum(state.history[index, 1, 0], aw)
        for name, experts in self._experts:
            for i, (fc, module) in enumerate((("fc1", experts.fc1), ("fc2", experts.fc2))):
                # the bf16 copy (`WeightCopies` copies the stacked expert weights too); the
                # parameter where a caller passes none, whose bf16 cast `quantize_weight` takes
                w = copies.get(f"{name}.{fc}.weight", module.weight)
                buffers = FP8_EXPERT_BUFFERS[4 * i : 4 * i + 4]
                for buffer, value in zip(buffers, quantize_weight(w, experts.margin), strict=True):
                    self.entries[f"{name}.{buffer}"].copy_(value)
