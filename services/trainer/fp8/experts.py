"""FP8 grouped expert GEMMs: a MoE block's expert projections on row-scaled e4m3 operands.

`Fp8GroupedExperts` (what `apply_fp8` makes of a block's `GroupedExperts` under
train.fp8_experts) runs fc1 and fc2 through `fp8_grouped_linear`:

    forward  y  = x · Wᵀ      x scaled per row over K (in), W per output row over K
    dgrad    dx = dy · W      dy scaled per row over N (out), W per column over N (Wᵀ's rows)
    wgrad    dW = dyᵀ · x     bf16 (`torch._grouped_mm`, or the per-expert loop), or added
                              into the fp32 .grad per expert (expert gradient-accumulation fusion)

Every scale is one row's along the dimension its GEMM sums over (rowwise, amax / 448, e4m3 for
all operands: what Hopper's `torch._scaled_grouped_mm` takes), whatever train.fp8's format and
recipe are for the dense layers. The weight gradient stays bf16 by choice: as a 2d x 2d grouped
GEMM it sums over each expert's tokens, so its FP8 scales would be per feature *per expert* along
a jagged token dimension, and `_scaled_grouped_mm` needs each expert's token count padded to a
multiple of 16 there, so the routing would have to pad every group.

Where `_scaled_grouped_mm` runs (CUDA sm90, K and N multiples of 16, model.moe_grouped_gemm)
the GEMMs are one kernel for all experts; elsewhere `fp8_grouped_mm_emulated`: the same FP8
values dequantized to fp32 and multiplied per expert inside one custom op (so torch.compile keeps
the block in one graph), output rounded to bf16. The emulation is the reference the kernel is
held to; both take their operands from `quantize_rows`. Rows past counts.sum() (dropped choices)
come out zero from the emulation and unwritten from the kernel, as the bf16 paths'
(`model/grouped_gemm.py`); the MoE block masks them.

The weight's two quantizations (the forward's W per row, the dgrad's Wᵀ per row:
`quantize_weight`) are made in the forward (Wᵀ's where x's gradient will be asked for), and the
backward keeps Wᵀ's with x and the counts, no bf16 weight. Under bf16 weight copies (one process)
`Fp8WeightCache` (fp8/weights.py) makes both once per optimizer step instead and hands them in by
functional_call as this module's `fp8_fc*` buffers (empty and non-persistent otherwise: the state
dict is `GroupedExperts`'). The values are the same either way (the same rounding of the same
weight), and so are the saved tensors' shapes: activation recompute, whose rerun forward runs
without the cache, saves what the cached forward saved.

Rowwise scales are per token row or per weight row of this rank's tensors: nothing is reduced
across ranks, so expert parallelism (each rank's rows for its local experts) and tensor-parallel
experts (fc1/fc2 widths split) run it unchanged; a split width that is not a multiple of 16 runs
the emulation.
"""

from __future__ import annotations

from typing import cast

import torch

from meshtrain.kernels import dispatch
from meshtrain.services.trainer.fp8.scaling import E4M3, FP8_MAX, amax, amax_to_scale, cast_to_fp8
from meshtrain.services.trainer.model.grouped_gemm import expert_weight_grad
from meshtrain.services.trainer.model.moe import GroupedExperts


def quantize_rows(t: torch.Tensor, margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast each row (last dimension) of `t` to e4m3 with its own scale, amax(row) -> 448.

    Args:
        t: (..., K) any float dtype.
        margin: scale down by 2^margin (train.fp8_margin).

    Returns:
        (q, inv): q (..., K) float8_e4m3fn, saturated at ±448; inv (...,) fp32 contiguous, the
        dequantizing factor of each row (q · inv ≈ t). An all-zero row casts to zeros with a
        finite factor (`AMAX_FLOOR`).
    """
    scale = amax_to_scale(amax(t, dim=-1), FP8_MAX[E4M3], margin)  # (..., 1)
    return cast_to_fp8(t, scale, E4M3), scale.reciprocal().squeeze(-1).contiguous()


def scaled_grouped_mm_available(x: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether `torch._scaled_grouped_mm` takes this GEMM: CUDA compute capability 9.x (Hopper,
    the architecture it is tested on; others run the emulation), and both weight dimensions
    multiples of 16."""
    return (
        hasattr(torch, "_scaled_grouped_mm")
        and x.is_cuda
        and torch.cuda.get_device_capability(x.device)[0] == 9
        and in_features % 16 == 0
        and out_features % 16 == 0
    )


def fp8_grouped_mm(
    aq: torch.Tensor,
    a_inv: torch.Tensor,
    bq: torch.Tensor,
    b_inv: torch.Tensor,
    counts: torch.Tensor,
    kernel: bool,
) -> torch.Tensor:
    """Rows of `aq` in expert order times each expert's `bq` transposed, dequantized, in bf16.

    Args:
        aq: (rows, K) e4m3 row-major; a_inv (rows,) fp32 per-row factors.
        bq: (experts, N, K) e4m3 contiguous (nn.Linear's layout); b_inv (experts, N) fp32.
        counts: (experts,) int64 rows per expert.
        kernel: one `torch._scaled_grouped_mm` (see `scaled_grouped_mm_available`); else the
            emulation op.

    Returns:
        (rows, N) bf16.
    """
    if kernel:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._scaled_grouped_mm(
            aq,
            bq.transpose(1, 2),  # (experts, K, N), column-major in the last two dims
            a_inv,
            b_inv,
            offs=offs,
            out_dtype=torch.bfloat16,
        )
    return fp8_grouped_mm_emulated(aq, a_inv, bq, b_inv, counts)


@torch.library.custom_op("meshtrain::fp8_grouped_mm_emulated", mutates_args=())
def fp8_grouped_mm_emulated(
    aq: torch.Tensor,
    a_inv: torch.Tensor,
    bq: torch.Tensor,
    b_inv: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """`fp8_grouped_mm` without the kernel: per expert (aq · a_inv) @ (bq · b_inv)ᵀ in fp32 from
    the same FP8 values, rounded to bf16; rows past counts.sum() come out zero."""
    with torch.autocast(aq.device.type, enabled=False):
        out = torch.zeros(aq.shape[0], bq.shape[1], dtype=torch.bfloat16, device=aq.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = aq[start : start + n].float() * a_inv[start : start + n, None]
                w = bq[e].float() * b_inv[e][:, None]  # (N, K)
                out[start : start + n] = (rows @ w.t()).to(torch.bfloat16)
            start += n
    return out


@fp8_grouped_mm_emulated.register_fake
def _(aq, a_inv, bq, b_inv, counts):
    return aq.new_empty(aq.shape[0], bq.shape[1], dtype=torch.bfloat16)


class _Fp8GroupedLinear(torch.autograd.Function):
    """x (rows, K) · weight (experts, N, K) per expert: forward and dgrad in FP8, wgrad bf16.

    `wq, w_inv, wtq, wt_inv`: the weight's two quantizations (`quantize_weight`) where
    `Fp8WeightCache` made them this step, else None: quantized here. `dgrad`: the backward will
    compute x's gradient, so the forward keeps the transpose's quantization for it (made here
    from the weight where not given). Either way the backward keeps x, the counts and that
    quantization, tensors of the same shapes, so activation recompute (whose rerun has no cache)
    saves what the forward saved. `main_grad`: the fp32 weight's `.grad`, which the backward adds
    the weight's gradient into (returning none for the weight), or None."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        counts,
        margin: int,
        kernel: bool,
        dgrad: bool,
        wq,
        w_inv,
        wtq,
        wt_inv,
        main_grad,
    ):
        x2 = x.to(torch.bfloat16)  # one rounding path whatever arrives (fp32 or bf16)
        xq, x_inv = quantize_rows(x2, margin)  # per token over K
        if wq is None:
            w = weight.to(torch.bfloat16)  # (G, N, K)
            wq, w_inv = quantize_rows(w, margin)  # per output row over K
            if dgrad:  # per column over N: Wᵀ (G, K, N) by rows
                wtq, wt_inv = quantize_rows(w.transpose(1, 2).contiguous(), margin)
        y = fp8_grouped_mm(xq, x_inv, wq, w_inv, counts, kernel)  # (rows, N)
        if not dgrad:
            wtq = wt_inv = None
        ctx.save_for_backward(x2, counts, wtq, wt_inv)  # no weight: the wgrad needs x only
        ctx.margin, ctx.kernel = margin, kernel
        ctx.main_grad = main_grad  # not saved: added into in place before the backward
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, counts, wtq, wt_inv = ctx.saved_tensors
        dy2 = dy.to(torch.bfloat16).contiguous()  # (rows, N)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx = dy · W: sums over N
            if wtq is None:
                raise RuntimeError(
                    "fp8_grouped_linear: x's gradient is asked for, but the forward ran where it "
                    "needed none (no grad mode or x not requiring grad) and kept no Wᵀ"
                )
            dyq, dy_inv = quantize_rows(dy2, ctx.margin)  # per token over N
            dx = fp8_grouped_mm(dyq, dy_inv, wtq, wt_inv, counts, ctx.kernel)
            dx = dx.to(ctx.x_dtype)
        if ctx.main_grad is not None or ctx.needs_input_grad[1]:
            # dW = dyᵀ · x per expert, bf16 (see the module doc), or added into the fp32 main
            # gradient
            dw = expert_weight_grad(dy2, x2, counts, ctx.kernel, ctx.main_grad)
            dw = None if dw is None else dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None, None, None, None


QuantizedWeight = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""An expert weight's (wq, w_inv, wtq, wt_inv): `quantize_rows` of its bf16 cast (G, N, K) and
of that cast's contiguous transpose (G, K, N), as `Fp8WeightCache` keeps them for a step."""


def quantize_weight(weight: torch.Tensor, margin: int = 0) -> QuantizedWeight:
    """Both quantizations of an expert weight (G, N, K) that `fp8_grouped_linear` would make from
    it: the forward's (per output row over K) and the dgrad's (per input column over N)."""
    w = weight.to(torch.bfloat16)
    wq, w_inv = quantize_rows(w, margin)
    wtq, wt_inv = quantize_rows(w.transpose(1, 2).contiguous(), margin)
    return wq, w_inv, wtq, wt_inv


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    grouped: bool,
    margin: int = 0,
    quantized: QuantizedWeight | None = None,
    main_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """`model.grouped_gemm.grouped_linear` with the forward and input-gradient GEMMs in FP8.

    Args:
        x: (rows, in) grouped by expert, counts[e] rows for expert e.
        weight: (experts, out, in), fp32 master or bf16.
        counts: (experts,) int64.
        grouped: model.moe_grouped_gemm: `torch._scaled_grouped_mm` where it runs (per GEMM:
            in and out multiples of 16, for the forward and the dgrad alike); else the emulation.
        margin: train.fp8_margin.
        quantized: `quantize_weight(weight, margin)` made beforehand (this step's, by
            `Fp8WeightCache`), used instead of quantizing the weight here. None: quantized here,
            to the same values (Wᵀ's quantization in the forward too, for the backward, where
            x's gradient will be asked for).
        main_grad: as `grouped_linear`'s: the fp32 weight's `.grad`, which the backward adds
            the weight's gradient into, one fp32-output GEMM per expert; None: through autograd.

    Returns:
        (rows, out) in x's dtype (autocast's under autocast).
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    out_f, in_f = weight.shape[1], weight.shape[2]
    kernel = grouped and scaled_grouped_mm_available(x, in_f, out_f)
    # decided here, not from ctx in the forward (True there under no_grad too): a plain bool
    dgrad = torch.is_grad_enabled() and x.requires_grad
    with torch.autocast(device, enabled=False):  # the casts and GEMMs choose their own dtypes
        return _Fp8GroupedLinear.apply(
            x,
            weight,
            counts,
            margin,
            kernel,
            dgrad,
            *(quantized or (None, None, None, None)),
            main_grad,
        )


class Fp8GroupedExperts(GroupedExperts):
    """`GroupedExperts` whose fc1 and fc2 run `fp8_grouped_linear`: the same parameters, names
    and state dict (made by `make_fp8` on an existing block, as `Fp8Linear`)."""

    margin: int = 0
    # Empty (non-persistent: not in the state dict), except where `Fp8WeightCache` passes this
    # step's quantized weights in (by functional_call): `QuantizedWeight` of fc1 and of fc2
    fp8_fc1_weight: torch.Tensor
    fp8_fc1_weight_inv: torch.Tensor
    fp8_fc1_weight_t: torch.Tensor
    fp8_fc1_weight_t_inv: torch.Tensor
    fp8_fc2_weight: torch.Tensor
    fp8_fc2_weight_inv: torch.Tensor
    fp8_fc2_weight_t: torch.Tensor
    fp8_fc2_weight_t_inv: torch.Tensor

    def make_fp8(self, margin: int) -> None:
        """Called once on a `GroupedExperts` whose class was swapped to this one."""
        self.margin = margin
        for name in FP8_EXPERT_BUFFERS:
            empty = torch.empty(0, device=self.fc1.weight.device)
            self.register_buffer(name, empty, persistent=False)

    def quantized(self, fc: str) -> QuantizedWeight | None:
        """fc ('fc1' or 'fc2')'s cached quantization where one was passed in, else None."""
        parts = tuple(getattr(self, f"fp8_{fc}_{suffix}") for suffix in _SUFFIXES)
        return cast(QuantizedWeight, parts) if parts[0].numel() else None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (rows, hidden) grouped by local expert -> (rows, hidden)."""
        fc1, fc2 = self.quantized("fc1"), self.quantized("fc2")
        h = fp8_grouped_linear(
            x, self.fc1.weight, counts, self.grouped, self.margin, fc1, self.fc1.main_grad()
        )
        h = dispatch.swiglu(h) if self.swiglu else dispatch.gelu(h)
        return fp8_grouped_linear(
            h, self.fc2.weight, counts, self.grouped, self.margin, fc2, self.fc2.main_grad()
        )


_SUFFIXES = ("weight", "weight_inv", "weight_t", "weight_t_inv")
FP8_EXPERT_BUFFERS = tuple(f"fp8_{fc}_{suffix}" for fc in ("fc1", "fc2") for suffix in _SUFFIXES)
"""`Fp8GroupedExperts`'s buffer names, in `QuantizedWeight`'s order for fc1, then fc2."""


__all__ = [
    "FP8_EXPERT_BUFFERS",
    "Fp8GroupedExperts",
    "QuantizedWeight",
    "fp8_grouped_linear",
    "fp8_grouped_mm",
    "fp8_grouped_mm_emulated",
    "quantize_rows",
    "quantize_weight",
    "scaled_grouped_mm_available",
]
