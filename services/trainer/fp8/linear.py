"""FP8 linear layers: y = x W^T + b with all three GEMMs on FP8 operands (`torch._scaled_mm`).

Forward: x and W are scaled and cast to the format's forward dtype (e4m3), multiplied with
bf16 output, and dequantized by the reciprocal scales inside the GEMM. Backward: the output
gradient is cast to the backward dtype (e5m2 under 'hybrid') and dx = dy·W and dW = dyᵀ·x run
as FP8 GEMMs too, from the forward's FP8 copies of x and W (tensorwise and delayed: nothing is
cast twice) or from their bf16 values re-cast along the other dimension (rowwise: each scale
belongs to a row of the dimension the GEMM sums over, so dx and dW need W and x scaled per
column). The fp32 master weights, their gradients and the optimizer never change dtype: W
arrives as the fp32 parameter or its bf16 weight copy, and dW leaves as a bf16 GEMM result
added to the fp32 gradient (straight into it when gradient accumulation fusion gives the main
gradient).

Tensor parallelism: a tensor whose shard differs per rank (a column-parallel weight and its
output gradient, a row-parallel weight and its input) takes the max of the ranks' amaxes, so
every rank uses the scale one process would (tensorwise; delayed scaling casts with the scale
of earlier steps and reduces its whole history once per step instead); rowwise scales stay per
shard. Under sequence parallelism a column-parallel layer may take its input as the rank's
sequence chunk (`Fp8Gemm(seq_group=...)`): the chunk is cast with the scale of the whole input and
all-gathered as FP8 bytes (half the bytes of bf16, and the same values as casting after a bf16
gather); its input gradient is reduce-scattered in bf16.

Context parallelism: each cp rank holds its own tokens of every micro-batch, so an activation
and an output gradient are pieces of one tensor, as a tp shard is: their amaxes are max-reduced
over cp too (over tp x cp where tp also splits them), and a cp=2 run casts with the scales of
cp=1. Data-parallel ranks are not reduced: one process scales each micro-batch by its own amax
as well. Rowwise scales are per token row and need no reduction, except the weight gradient's,
which are per feature along the tokens (`Groups.tokens`).

    gemm = Fp8Gemm(recipe)                 # one per layer (the delayed state is per layer)
    y = gemm(x, weight, bias)              # the F.linear signature
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

from meshtrain.services.trainer.fp8.scaling import (
    Recipe,
    amax,
    amax_to_scale,
    cast_to_fp8,
    cast_transpose,
    tensor_amax,
)
from meshtrain.services.trainer.parallel import mappings as M

E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Groups:
    """The ranks over which each tensor's amax is max-reduced: those holding other pieces of
    the same tensor (None: the tensor is whole on every rank, or alone). The weight's are its
    tp peers; an activation's and an output gradient's are its cp peers (their own tokens of the
    micro-batch) and, where tp splits it, its tp peers too (the mesh's "tp_cp" group).
    `tokens`: the cp group alone, over which rowwise scaling reduces the weight gradient's
    per-feature scales (the only rowwise scales taken across tokens)."""

    input: dist.ProcessGroup | None = None
    weight: dist.ProcessGroup | None = None
    grad_output: dist.ProcessGroup | None = None
    tokens: dist.ProcessGroup | None = None


def _all_max(a: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`a` max-reduced over `group` (a functional collective: traceable by torch.compile)."""
    if group is None or dist.get_world_size(group) == 1:
        return a
    out = funcol.all_reduce(a, "max", group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def _reduced_amax(
    x: torch.Tensor, group: dist.ProcessGroup | None, fused: bool = False
) -> torch.Tensor:
    return _all_max(tensor_amax(x, fused), group)


def _scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    fast_accum: bool = False,
) -> torch.Tensor:
    """(a · scale_a) @ (b · scale_b) in bf16, a and b FP8 (a row-major, b column-major; each
    scale a scalar or one per row of a / column of b). On CUDA one cuBLAS FP8 GEMM; elsewhere
    (PyTorch's CPU FP8 GEMM is a scalar loop, seconds for a small layer) the same FP8 values
    dequantized and multiplied in fp32, exact products summed in another order."""
    if a.is_cuda:
        return torch._scaled_mm(
            a,
            b,
            scale_a=scale_a,
            scale_b=scale_b,
            out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(torch.bfloat16)


def _deliver_weight_grad(
    ctx, main_grad: torch.Tensor | None, dw: torch.Tensor
) -> torch.Tensor | None:
    """The weight gradient for autograd (in the weight's dtype), or None once added into the
    fused main gradient."""
    if ctx.fused:
        assert main_grad is not None  # fused: the weight has a main gradient
        main_grad.add_(dw)
        return None
    return dw.to(ctx.w_dtype)


def _gather_sequence(xq: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Size]:
    """All-gather FP8 activations (b, s/tp, K) along the sequence as bytes (collectives take no
    FP8 dtype): the (b·s, K) row-major GEMM operand, and the gathered (b, s, K) shape."""
    full = M.all_gather(xq.view(torch.uint8), M.SEQ_DIM, group).view(
        xq.dtype
    )  # (b, s, K), a strided view
    return full.reshape(-1, full.shape[-1]), full.shape


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (what `_scaled_mm` wants as its second operand)."""
    return t.t().contiguous().t()


def _cast(t, role, recipe, dtype, group, history, scale, delayed, transpose, made=None):
    """Scale and cast one operand of `_TensorScaled` (role: its row in the delayed state, 0 input,
    1 weight, 2 output gradient): (scale, (FP8 t, its transpose or None, amax or None)).

    Current scaling takes the amax first (over `group`) and casts with the scale from it;
    delayed scaling casts with the earlier steps' scale, the amax for the history coming from
    the same pass. Either way the amax raises the history's entry (when one is recorded).
    `made`: (FP8 t or None, amax(t)) from the kernel that produced t (`Fp8Gemm.offer_input`):
    delayed, t's FP8 copy is taken as it is (its transpose is an FP8 copy); current, the amax.
    """
    fused = recipe.fused_now()
    if made is not None and delayed:
        q, a = made
        q = q.reshape(t.shape)  # (M, K)
        out = (q, q.t().contiguous() if transpose else None, a)
        s = scale[role]
    elif delayed:
        s = scale[role]
        out = cast_transpose(t, s, dtype, fused, transpose, with_amax=history is not None)
        a = out[2]
    else:
        a = _reduced_amax(t, group, fused) if made is None else _all_max(made[1], group)
        s = amax_to_scale(a, torch.finfo(dtype).max, recipe.margin)
        out = cast_transpose(t, s, dtype, fused, transpose)
    if history is not None:
        assert a is not None  # asked of the cast wherever a history records it
        history[role, 0] = torch.maximum(history[role, 0], a)
    return s, out


class _TensorScaled(torch.autograd.Function):
    """One scale per tensor: the current amax (dynamic) or the delayed state's scale."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        main_grad,
        recipe: Recipe,
        groups: Groups,
        history,
        scale,
        delayed: bool,
        wq=None,
        wq_t=None,
        sw=None,
        seq_group=None,
        wgrad: bool = True,
        made=None,
    ):
        """wq, wq_t, sw: the weight already cast this step (`Fp8WeightCache`: wq (N, K) and its
        transpose (K, N), both FP8, and its scale); None: cast here. seq_group: x is this rank's
        sequence chunk (b, s/tp, K), cast to FP8 and all-gathered along the sequence over this
        group before the GEMM (sequence parallelism); its gradient is reduce-scattered back.
        wgrad: the backward will compute the weight gradient (x's transpose is then cast here,
        with x, where the casts are fused). made: x's FP8 copy and amax from the kernel that
        produced x (`Fp8Gemm.offer_input`), in place of casting x here."""
        fmt, w_dtype, fused = recipe.dtypes, weight.dtype, recipe.fused_now()
        # from bf16 whatever arrives (an fp32 master weight, its bf16 copy): one rounding path
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # (M, K), M this rank's tokens
        # x's transpose (K, M) is the weight gradient's operand: written by the cast where it
        # is cast whole (a gathered sequence is transposed after its gather, in the backward)
        transpose_x = fused and wgrad and seq_group is None
        # record this micro-batch's amaxes in the history, for the next steps' scales
        sx, (xq, xq_t, ax) = _cast(
            x2, 0, recipe, fmt.forward, groups.input, history, scale, delayed, transpose_x, made
        )  # (M, K), (K, M) or None
        if wq is None:
            weight = weight.to(torch.bfloat16)  # (N, K)
            sw, (wq, wq_t, _) = _cast(
                weight, 1, recipe, fmt.forward, groups.weight, history, scale, delayed, True
            )  # (N, K), (K, N)
        x_shape = x.shape
        if (
            seq_group is not None
        ):  # gather the FP8 bytes: half of bf16's, the same values as casting after
            xq, x_shape = _gather_sequence(xq.view(x.shape), seq_group)  # (tp·M, K), (b, s, K)
        y = _scaled_mm(xq, wq.t(), sx.reciprocal(), sw.reciprocal(), fast_accum=True)  # (M, N)
        if bias is not None:
            y = y + bias.to(y.dtype)
        # W's transpose (K, N) is the input gradient's operand; cast here or given, the same tensor
        # is saved either way (activation recompute checks that the rerun saves alike)
        ctx.save_for_backward(xq if xq_t is None else xq_t, wq_t, sx, sw)
        ctx.x_transposed = xq_t is not None
        # Not saved (autograd would check their versions): the main gradient of a tied weight
        # and the stacked history other layers write into change between forward and backward.
        ctx.main_grad, ctx.history, ctx.scale = main_grad, history, scale
        ctx.recipe, ctx.groups, ctx.delayed, ctx.seq_group = recipe, groups, delayed, seq_group
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x_shape, x.dtype, w_dtype
        ctx.has_bias, ctx.fused = bias is not None, main_grad is not None
        return y.view(*x_shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x_saved, wq_t, sx, sw = ctx.saved_tensors
        w_col = wq_t.t()  # W (N, K), column-major
        main_grad, history, scale = ctx.main_grad, ctx.history, ctx.scale
        recipe = ctx.recipe
        fmt = recipe.dtypes
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)  # (M, N)
        wgrad = ctx.fused or ctx.needs_input_grad[1]
        sdy, (dyq, dyq_t, _) = _cast(
            dy2, 2, recipe, fmt.backward, ctx.groups.grad_output, history, scale, ctx.delayed, wgrad
        )  # (M, N), (N, M)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _scaled_mm(dyq, w_col, sdy.reciprocal(), sw.reciprocal())  # (M, N) @ (N, K)
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
            if (
                ctx.seq_group is not None
            ):  # the gather's adjoint: sum over tp, keep this rank's chunk
                dx = M.reduce_scatter(dx, M.SEQ_DIM, ctx.seq_group)  # (b, s/tp, K)
        if wgrad:
            x_col = x_saved.t() if ctx.x_transposed else _col_major(x_saved)  # (M, K) col-major
            dw = _scaled_mm(dyq_t, x_col, sdy.reciprocal(), sx.reciprocal())  # (N, M) @ (M, K)
            dw = _deliver_weight_grad(ctx, main_grad, dw)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None, None, None


class _RowScaled(torch.autograd.Function):
    """One scale per row of each GEMM operand along the summed dimension (e4m3 everywhere)."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad, recipe: Recipe, tokens=None):
        """tokens: the group splitting the tokens (cp), over which the weight gradient's
        per-feature scales are reduced (see the backward)."""
        m = recipe.dtypes.forward_max
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # (M, K)
        w = weight.to(torch.bfloat16)  # (N, K)
        sx = amax_to_scale(amax(x2, dim=1), m, recipe.margin)  # (M, 1)
        sw = amax_to_scale(amax(w, dim=1), m, recipe.margin)  # (N, 1)
        y = _scaled_mm(
            cast_to_fp8(x2, sx, E4M3),
            cast_to_fp8(w, sw, E4M3).t(),
            sx.reciprocal(),
            sw.reciprocal().reshape(1, -1),
            fast_accum=True,
        )  # (M, N)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x2, w)
        ctx.main_grad = main_grad  # not saved: a tied weight's backward adds into it meanwhile
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = recipe, x.shape, x.dtype, weight.dtype
        ctx.has_bias, ctx.fused, ctx.tokens = bias is not None, main_grad is not None, tokens
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        main_grad = ctx.main_grad
        m, margin = ctx.recipe.dtypes.forward_max, ctx.recipe.margin
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)  # (M, N)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx = dy W: sums over N
            s_dy = amax_to_scale(amax(dy2, dim=1), m, margin)  # (M, 1)
            s_w = amax_to_scale(amax(w, dim=0), m, margin)  # (1, K)
            dx = _scaled_mm(
                cast_to_fp8(dy2, s_dy, E4M3),
                _col_major(cast_to_fp8(w, s_w, E4M3)),
                s_dy.reciprocal(),
                s_w.reciprocal(),
            )
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        if ctx.fused or ctx.needs_input_grad[1]:  # dW = dy^T x: sums over M
            # The scales above are per token (x's and dy's rows: whole on this rank, so no
            # reduction under cp) or per feature of the whole weight. These are per feature
            # along the tokens, which cp splits: max-reduced over the cp ranks, each feature's
            # scale is the one of the micro-batch's tokens, as in one process.
            s_dy = amax_to_scale(_all_max(amax(dy2, dim=0), ctx.tokens), m, margin)  # (1, N)
            s_x = amax_to_scale(_all_max(amax(x2, dim=0), ctx.tokens), m, margin)  # (1, K)
            dw = _scaled_mm(
                cast_to_fp8(dy2, s_dy, E4M3).t().contiguous(),
                _col_major(cast_to_fp8(x2, s_x, E4M3)),
                s_dy.reciprocal().reshape(-1, 1),
                s_x.reciprocal(),
            )  # (N, M) @ (M, K)
            dw = _deliver_weight_grad(ctx, main_grad, dw)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None


class DelayedState:
    """The amax histories and scales of every delayed-scaling layer of a model, stacked, so the
    once-per-step update is a few kernels and one reduction whatever the layer count.

    history: (layers, 3, L) fp32, entry 0 the current step's (raised by every cast); scale:
    (layers, 3) the scales this step casts with. `ready` turns true after the first step: until
    then the layers scale by the current amax (no history yet), as 'tensorwise'.
    """

    def __init__(self, layers: int, history_len: int, device: torch.device):
        self.history = torch.zeros(layers, 3, history_len, device=device)
        self.scale = torch.ones(layers, 3, device=device)
        self.ready = False


class Fp8Gemm:
    """`F.linear(x, weight, bias)` on FP8 operands for one layer (see the module doc).

    Args:
        recipe: the scaling recipe and formats.
        groups: the amax groups (tensor and context parallel peers; see `Groups`).
        delayed: the model's `DelayedState` and this layer's index in it (recipe 'delayed').
        seq_group: sequence parallelism's group, for a column-parallel layer that gathers its
            input itself: x arrives as this rank's sequence chunk and is all-gathered in FP8
            (`gathers_sequence`). Where the bytes cannot be gathered in FP8 (rowwise scales, or a
            gathered token count cuBLAS refuses) it is gathered in bf16 first, as without FP8.
    """

    def __init__(
        self,
        recipe: Recipe,
        groups: Groups = Groups(),
        delayed: tuple[DelayedState, int] | None = None,
        seq_group: dist.ProcessGroup | None = None,
    ):
        if (recipe.recipe == "delayed") != (delayed is not None):
            raise ValueError("a delayed-scaling FP8 layer needs its state (and only it does)")
        if seq_group is not None and (
            groups.input is None
            or not set(dist.get_process_group_ranks(seq_group))
            <= set(dist.get_process_group_ranks(groups.input))
        ):
            raise ValueError(
                "an FP8 layer that gathers its input reduces the input's amax over that group "
                "(or one holding it: tp x cp)"
            )
        self.recipe, self.groups, self.delayed, self.seq_group = recipe, groups, delayed, seq_group
        self._offered: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int] | None = None

    def input_plan(self) -> tuple[torch.dtype, torch.Tensor | None] | None:
        """What the kernel producing this GEMM's input may make in its own pass (Transformer
        Engine's LayerNormLinear): None, nothing (rowwise scales, casts not fused, or inside
        torch.compile, where Inductor fuses the casts itself); else (the FP8 dtype, the scale to
        cast with now: delayed scaling's, or None where the scale waits for the input's amax)."""
        eager_fused = self.recipe.fused_casts and not torch.compiler.is_compiling()
        if self.recipe.recipe == "rowwise" or not eager_fused:
            return None
        scale = None
        if self.delayed is not None and self.delayed[0].ready:
            state, i = self.delayed
            scale = state.scale[i, 0]
        return self.recipe.dtypes.forward, scale

    def offer_input(self, y: torch.Tensor, q: torch.Tensor | None, amax: torch.Tensor) -> None:
        """Hand over y's FP8 copy (q, made with `input_plan`'s scale; None without one) and
        amax(|bf16(y)|), made by the kernel that produced y. The next call takes them in place
        of casting if its input is y (the same bytes: y itself or an alias, not a copy or a
        padded or gathered tensor); any other input is cast as usual and the offer dropped."""
        self._offered = (y, q, amax, y._version)

    def _take_offer(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        offered, self._offered = self._offered, None
        if offered is None or torch.compiler.is_compiling():
            return None
        y, q, amax, version = offered
        same = x is y or (
            x.data_ptr() == y.data_ptr()
            and x.shape == y.shape
            and x.stride() == y.stride()
            and x.dtype == y.dtype
            and x.device == y.device
        )
        # and nothing wrote into it since (an alias shares its base's version counter)
        return (q, amax) if same and x._version == version else None

    @property
    def gathers_sequence(self) -> bool:
        """Whether x arrives as a sequence chunk that this GEMM gathers (see the class doc)."""
        return self.seq_group is not None

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        main_grad: torch.Tensor | None = None,
        cast: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`cast`: (FP8 weight, its transpose, its scale) from `Fp8WeightCache` (not rowwise)."""
        made = self._take_offer(x)
        if self.seq_group is not None:
            gathered = x.numel() // x.shape[-1] * dist.get_world_size(self.seq_group)
            if self.recipe.recipe != "rowwise" and not (x.is_cuda and gathered % 16):
                return self._gemm(x, weight, bias, main_grad, cast, self.seq_group, made)
            x = M.gather_from_sequence(
                x, self.seq_group
            )  # in bf16, then as an input that arrived whole
        tokens = x.numel() // x.shape[-1]
        if x.is_cuda and tokens % 16:
            # cuBLAS's FP8 GEMM takes dimensions in multiples of 16, the token count (the weight
            # gradient's summed dimension) too: zero rows, which change no amax and no sum
            rows = x.reshape(tokens, x.shape[-1])
            padded = torch.cat([rows, rows.new_zeros(-tokens % 16, x.shape[-1])])
            y = self._gemm(padded, weight, bias, main_grad, cast, None)[:tokens]
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return self._gemm(x, weight, bias, main_grad, cast, None, made)

    def _gemm(self, x, weight, bias, main_grad, cast, seq_group, made=None) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            if self.recipe.recipe == "rowwise":
                return _RowScaled.apply(x, weight, bias, main_grad, self.recipe, self.groups.tokens)
            history = scale = None
            ready = False
            groups = self.groups
            if self.delayed is not None:
                state, i = self.delayed
                scale, ready = state.scale[i], state.ready
                history = (
                    state.history[i] if torch.is_grad_enabled() else None
                )  # evaluation records nothing
                if ready:  # casts with the history's scale: the amaxes are only recorded, and
                    # step_end reduces the history over tp and dp x cp: no collective here
                    groups = Groups()
            return _TensorScaled.apply(
                x,
                weight,
                bias,
                main_grad,
                self.recipe,
                groups,
                history,
                scale,
                ready,
                *(cast or (None, None, None)),
                seq_group,
                # decided here, not from ctx in the forward: a plain bool under torch.compile too
                torch.is_grad_enabled() and (main_grad is not None or weight.requires_grad),
                made if made is None or made[0] is not None or not ready else None,
            )


class Fp8Linear(nn.Linear):
    """An `nn.Linear` (same parameters and state dict) whose forward runs `Fp8Gemm`.

    Under bf16 weight copies it is handed the bf16 copy; with gradient accumulation fusion
    (`main_weight` set by `WeightCopies`) the weight gradient goes into the fp32 weight's
    `.grad` inside the backward, as `MainGradLinear` does.
    """

    adds_into_main_grad = True  # WeightCopies may fuse its gradient accumulation
    fp8: Fp8Gemm
    # Empty, except where `Fp8WeightCache` passes this step's cast weight in (by functional_call)
    fp8_weight: torch.Tensor
    fp8_weight_t: torch.Tensor
    fp8_weight_scale: torch.Tensor

    def make_fp8(self, gemm: Fp8Gemm) -> None:
        """Turn this `nn.Linear` (already of this class) into an FP8 layer running `gemm`."""
        self.fp8 = gemm
        for name in ("fp8_weight", "fp8_weight_t", "fp8_weight_scale"):
            self.register_buffer(name, torch.empty(0, device=self.weight.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main_grad = None
        main = getattr(self, "main_weight", None)
        if main is not None and self.weight is not main[0] and torch.is_grad_enabled():
            main_grad = main[0].grad
            if main_grad is None:
                raise RuntimeError(
                    f"{tuple(main[0].shape)} weight: its fused gradient needs an fp32 .grad to add "
                    "into; WeightCopies.refresh() allocates it"
                )
        cast = None
        if self.fp8_weight.numel():  # given this step's cast (training on the weight copies)
            cast = (self.fp8_weight, self.fp8_weight_t, self.fp8_weight_scale)
        return self.fp8(x, self.weight, self.bias, main_grad, cast)


def fp8_ready_shape(in_features: int, out_features: int) -> bool:
    """Whether cuBLAS's FP8 GEMM takes this weight (both dimensions multiples of 16)."""
    return in_features % 16 == 0 and out_features % 16 == 0


__all__ = ["DelayedState", "Fp8Gemm", "Fp8Linear", "Groups", "fp8_ready_shape"]
