"""FP8 grouped expert GEMMs: a MoE block's expert projections on row-scaled e4m3 operands.

`Fp8GroupedExperts` (what `apply_fp8` makes of a block's `GroupedExperts` under
train.fp8_experts) runs fc1 and fc2 through `fp8_grouped_linear`:

    forward  y  = x · Wᵀ      x scaled per row over K (in), W per output row over K
    dgrad    dx = dy · W      dy scaled per row over N (out), W per column over N (Wᵀ's rows)
    wgrad    dW = dyᵀ · x     bf16 (`torch._grouped_mm`, or the per-expert loop)

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

Rowwise scales are per token row or per weight row of this rank's tensors: nothing is reduced
across ranks, so expert parallelism (each rank's rows for its local experts) and tensor-parallel
experts (fc1/fc2 widths split) run it unchanged; a split width that is not a multiple of 16 runs
the emulation.
"""

from __future__ import annotations

import torch

from meshtrain.kernels import dispatch
from meshtrain.services.trainer.fp8.scaling import E4M3, FP8_MAX, amax, amax_to_scale, cast_to_fp8
from meshtrain.services.trainer.model.grouped_gemm import grouped_mm_loop_weight_grad
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
    """x (rows, K) · weight (experts, N, K) per expert: forward and dgrad in FP8, wgrad bf16."""

    @staticmethod
    def forward(ctx, x, weight, counts, margin: int, kernel: bool):
        x2 = x.to(torch.bfloat16)  # one rounding path whatever arrives (fp32 or bf16)
        w = weight.to(torch.bfloat16)  # (G, N, K)
        xq, x_inv = quantize_rows(x2, margin)  # per token over K
        wq, w_inv = quantize_rows(w, margin)  # per output row over K
        y = fp8_grouped_mm(xq, x_inv, wq, w_inv, counts, kernel)  # (rows, N)
        ctx.save_for_backward(x2, w, counts)
        ctx.margin, ctx.kernel = margin, kernel
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, w, counts = ctx.saved_tensors
        dy2 = dy.to(torch.bfloat16).contiguous()  # (rows, N)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx = dy · W: sums over N
            dyq, dy_inv = quantize_rows(dy2, ctx.margin)  # per token over N
            wtq, wt_inv = quantize_rows(w.transpose(1, 2).contiguous(), ctx.margin)  # (G, K, N)
            dx = fp8_grouped_mm(dyq, dy_inv, wtq, wt_inv, counts, ctx.kernel)
            dx = dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # dW = dyᵀ · x per expert, bf16 (see the module doc)
            if ctx.kernel:  # torch._grouped_mm's own weight gradient: (G, K, N), transposed
                offs = torch.cumsum(counts, 0).to(torch.int32)
                dw = torch._grouped_mm(x2.t(), dy2, offs=offs).transpose(1, 2)
            else:
                dw = grouped_mm_loop_weight_grad(dy2, x2, counts)
            dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None


def fp8_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool, margin: int = 0
) -> torch.Tensor:
    """`model.grouped_gemm.grouped_linear` with the forward and input-gradient GEMMs in FP8.

    Args:
        x: (rows, in) grouped by expert, counts[e] rows for expert e.
        weight: (experts, out, in), fp32 master or bf16.
        counts: (experts,) int64.
        grouped: model.moe_grouped_gemm: `torch._scaled_grouped_mm` where it runs (per GEMM:
            in and out multiples of 16, for the forward and the dgrad alike); else the emulation.
        margin: train.fp8_margin.

    Returns:
        (rows, out) in x's dtype (autocast's under autocast).
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    out_f, in_f = weight.shape[1], weight.shape[2]
    kernel = grouped and scaled_grouped_mm_available(x, in_f, out_f)
    with torch.autocast(device, enabled=False):  # the casts and GEMMs choose their own dtypes
        return _Fp8GroupedLinear.apply(x, weight, counts, margin, kernel)


class Fp8GroupedExperts(GroupedExperts):
    """`GroupedExperts` whose fc1 and fc2 run `fp8_grouped_linear`: the same parameters, names
    and state dict (made by `make_fp8` on an existing block, as `Fp8Linear`)."""

    margin: int = 0

    def make_fp8(self, margin: int) -> None:
        """Called once on a `GroupedExperts` whose class was swapped to this one."""
        self.margin = margin

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (rows, hidden) grouped by local expert -> (rows, hidden)."""
        h = fp8_grouped_linear(x, self.fc1.weight, counts, self.grouped, self.margin)
        h = dispatch.swiglu(h) if self.swiglu else dispatch.gelu(h)
        return fp8_grouped_linear(h, self.fc2.weight, counts, self.grouped, self.margin)


__all__ = [
    "Fp8GroupedExperts",
    "fp8_grouped_linear",
    "fp8_grouped_mm",
    "fp8_grouped_mm_emulated",
    "quantize_rows",
    "scaled_grouped_mm_available",
]
