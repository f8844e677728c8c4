"""FP8 scaling: formats, the amax → scale rule, saturating casts and the delayed amax history.

A tensor goes to FP8 as `q = saturate(x · s)` with `s = fp8_max / amax / 2^margin`, and a
GEMM of two such tensors is dequantized by the reciprocals (`torch._scaled_mm`'s scale_a and
scale_b). `amax` is the tensor's largest magnitude: the current one (dynamic, 'tensorwise'),
one per row ('rowwise'), or the largest of the last `history_len` steps' ('delayed', as
Transformer Engine's DelayedScaling with amax_compute_algo 'max'; 'most_recent' takes the last
step's). Values beyond the format's range saturate to ±fp8_max instead of becoming inf or NaN.
All of this is plain torch, so the CPU tests check it against a reference. With
`Recipe.fused_casts` the layers cast through `cast_transpose` and `tensor_amax` instead: on CUDA
one Triton pass writes the FP8 tensor, its transpose and (delayed scaling) its amax
(`meshtrain.kernels.fp8_cast`), bit-equal to the plain casts; elsewhere the plain torch ops.

    fmt = FORMATS["hybrid"]                 # e4m3 forward, e5m2 gradients
    s = amax_to_scale(x.abs().amax(), fmt.forward_max, margin=0)
    q = cast_to_fp8(x, s, fmt.forward)      # float8_e4m3fn, saturated
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.kernels import dispatch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344
AMAX_FLOOR = 1e-12
"""An all-zero tensor's amax is taken as this (its scale stays finite; zeros cast to zeros)."""

ROLES = ("input", "weight", "grad_output")
"""The three tensors an FP8 linear layer casts, in the order of the delayed-scaling state's rows."""


@dataclass(frozen=True)
class Format:
    """The FP8 dtypes of one `train.fp8` setting: activations and weights, and gradients."""

    forward: torch.dtype
    backward: torch.dtype

    @property
    def forward_max(self) -> float:
        return FP8_MAX[self.forward]

    @property
    def backward_max(self) -> float:
        return FP8_MAX[self.backward]

    def role_max(self) -> tuple[float, float, float]:
        """fp8_max of each of `ROLES`."""
        return (self.forward_max, self.forward_max, self.backward_max)


FORMATS = {"e4m3": Format(E4M3, E4M3), "hybrid": Format(E4M3, E5M2)}
"""Megatron's --fp8-format names: 'e4m3' everywhere, or 'hybrid' (e5m2 gradients, whose wider
range and coarser precision suit them)."""


@dataclass(frozen=True)
class Recipe:
    """How an FP8 run scales its tensors (the train.fp8* keys).

    recipe: 'tensorwise' (one scale per tensor from its current amax), 'rowwise' (one scale per
    row of each GEMM operand, along the dimension the GEMM sums over; e4m3 only) or 'delayed'
    (one scale per tensor from the amax history of earlier steps).
    """

    format: str = "hybrid"
    recipe: str = "tensorwise"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0
    fused_casts: bool = True
    """Cast through the fused kernels (`cast_transpose`); False: the separate torch ops (the
    same values; for A/B timing)."""
    fused_in_compile: bool = False
    """With fused_casts: inside torch.compile too (Inductor launches the kernels as they are);
    False: compiled regions trace the torch ops, which Inductor fuses with their neighbours."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(
                f"unknown FP8 format {self.format!r}; the formats are {', '.join(FORMATS)}"
            )
        if self.recipe not in ("tensorwise", "rowwise", "delayed"):
            raise ValueError(
                f"unknown FP8 recipe {self.recipe!r}; the recipes are tensorwise, rowwise, delayed"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"unknown amax compute algorithm {self.amax_compute_algo!r}: max or most_recent"
            )
        if self.amax_history_len < 1:
            raise ValueError(
                f"the amax history needs at least one entry, got {self.amax_history_len}"
            )

    @property
    def dtypes(self) -> Format:
        return FORMATS[self.format]

    def fused_now(self) -> bool:
        """Whether a cast made here goes through the fused kernels: fused_casts, and outside
        torch.compile unless fused_in_compile (read while dynamo traces, so each compiled
        region keeps the choice it was traced with)."""
        return self.fused_casts and (self.fused_in_compile or not torch.compiler.is_compiling())


def amax_to_scale(amax: torch.Tensor, fp8_max: float, margin: int = 0) -> torch.Tensor:
    """fp8_max / amax / 2^margin in fp32, elementwise (amax: a scalar, or one per row)."""
    return (fp8_max / amax.float().clamp(min=AMAX_FLOOR)) / float(2**margin)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x · scale rounded to `dtype`, saturated at ±fp8_max (scale: a scalar or broadcastable)."""
    limit = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def tensor_amax(x: torch.Tensor, fused: bool) -> torch.Tensor:
    """`amax(x)` of the whole tensor; `fused`: by the dispatched kernel (one read on CUDA; the
    layers pass `Recipe.fused_now()`)."""
    return dispatch.fp8_amax(x) if fused else amax(x)


def cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    fused: bool,
    transpose: bool = True,
    with_amax: bool = False,
    out: torch.Tensor | None = None,
    out_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x (M, N) cast to `dtype` with one scale, its contiguous transpose (N, M) if `transpose`,
    and amax(|x|) if `with_amax` (None where not asked), written into `out` / `out_t` if given.

    `fused`: the dispatched kernel (`meshtrain.kernels.fp8_cast` on CUDA: one pass); else
    `cast_to_fp8`, a transposing copy and `amax`, each a pass of its own. Bit-equal either way.
    The layers pass `Recipe.fused_now()`: by default torch.compile traces the torch ops.
    """
    if fused:
        return dispatch.fp8_cast_transpose(x, scale, dtype, transpose, with_amax, out, out_t)
    q = cast_to_fp8(x, scale, dtype)
    if out is not None:
        q = out.copy_(q)
    qt = None
    if transpose:
        qt = out_t.copy_(q.t()) if out_t is not None else q.t().contiguous()
    return q, qt, amax(x) if with_amax else None


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The largest magnitude of x (dim None: of the whole tensor, a 0-d fp32 tensor; else along
    `dim`, kept as a size-1 dimension)."""
    a = x.abs()
    return (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()


def scale_from_history(
    history: torch.Tensor, role_max: torch.Tensor, algo: str, margin: int, previous: torch.Tensor
) -> torch.Tensor:
    """The delayed scales (one per row of `history`): fp8_max over the history's amax ('max':
    its largest entry, 'most_recent': entry 0), keeping `previous` where nothing was recorded.

    history: (..., L) fp32, entry 0 the newest step; role_max and previous broadcast to (...).
    """
    recent = history.amax(dim=-1) if algo == "max" else history[..., 0]
    fresh = (role_max / recent.clamp(min=AMAX_FLOOR)) / float(2**margin)
    return torch.where(recent > 0, fresh, previous)


def roll_history(history: torch.Tensor) -> None:
    """Start a new step's entry: every entry moves one older (the oldest drops) and entry 0 is
    zeroed, to be raised by the step's casts (in place)."""
    history.copy_(torch.roll(history, shifts=1, dims=-1))
    history[..., 0] = 0.0
