"""FP8 casts in Triton: amax, and the saturating cast with its transposed copy in one pass.

An FP8 linear layer casts each GEMM operand once and needs it in two layouts: the input x as
(M, K) row-major for the forward GEMM and as xᵀ (K, M) for the weight gradient, the output
gradient dy as (M, N) for the input gradient and dyᵀ for the weight gradient, the weight W
(N, K) and Wᵀ. Unfused that is an amax reduction, a cast and a transposing copy, each a pass over
memory. `fp8_cast_transpose` reads x once and writes q = saturate(x · scale) in the FP8 dtype,
its contiguous transpose (Transformer Engine's cast_transpose) and, where asked, amax(|x|) of
the same pass: delayed scaling casts with an earlier step's scale and records this step's amax
for the next. Current scaling needs the amax before the cast: `fp8_amax` (one read) then the
cast. The amax is reduced as the int32 bits of |x| (non-negative floats order as their bits,
NaN above inf), so an atomic max across programs is exact and a NaN propagates as torch's amax
does. The cast is torch's: x in fp32 times the fp32 scale, clamped to ±fp8_max (NaN kept),
rounded to nearest even: bit-equal to `meshtrain.kernels.reference.fp8_cast_transpose`.
Custom ops `meshtrain::fp8_amax` and `meshtrain::fp8_cast_transpose` carry them into
torch.compile graphs.
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import torch
import triton
import triton.language as tl

from meshtrain.kernels._launch import autotuning, interpreting, kernel_op, sm_count, wrap_triton

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_EXPONENT_BIAS = {torch.float8_e4m3fn: 7, torch.float8_e5m2: 15}
AMAX_BLOCK = 4096
AMAX_PROGRAMS_PER_SM = 8


def _tile_configs() -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, warps) of the cast_transpose tiles; the first is the untuned launch."""
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=1)
        for m, n, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4))
    ]


def _prune_tiles(configs, named_args, **kwargs):
    """The heuristic tile alone unless autotuning (the CPU interpreter times nothing)."""
    return configs if autotuning() else configs[:1]


@triton.jit
def _fp8_amax(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    """amax(|x|) of a contiguous x: each program strides over blocks, one atomic max at its end."""
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for first in tl.range(start, n, step):
        index = first + offsets
        x = tl.load(x_ptr + index, mask=index < n, other=0.0).to(tl.float32)
        # |x| as int32 bits: non-negative floats order as their bits, NaN above inf
        acc = tl.maximum(acc, tl.abs(x).to(tl.int32, bitcast=True))
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(acc, axis=0))


@triton.jit
def _fp8_codes(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """The FP8 bytes (int32) of y (fp32, already saturated), rounded to nearest even, built in
    integer arithmetic. Only for Triton's CPU interpreter, whose fp32 -> fp8 conversion drops the
    carry when a mantissa rounds up into the next power of two (127.5 -> 64 in e4m3, not 128)
    and turns NaN into a finite value; a GPU's conversion instruction is correct."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MANT
    lsb = (bits >> SHIFT) & 1
    # round the fp32 mantissa to MANT bits; a carry out of it moves into the exponent
    rounded = (bits + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT
    normal = rounded - ((127 - BIAS) << MANT)  # re-biased exponent and mantissa
    # below the smallest normal (2^(1 - BIAS)) the grid is uniform, 2^(1 - BIAS - MANT): adding
    # C = 2^(1 - BIAS - MANT + 23) makes fp32's round-to-nearest-even round on that grid
    C: tl.constexpr = 2.0 ** (1 - BIAS - MANT + 23)
    small = a < 2.0 ** (1 - BIAS)
    subnormal = ((tl.where(small, a, 0.0) + C) - C) * (2.0 ** (MANT - 1 + BIAS))  # 0 .. 2^MANT
    code = tl.where(small, subnormal.to(tl.int32), normal)
    code = tl.where(y != y, 0x7F, code)  # NaN (both formats)
    return tl.where(y.to(tl.int32, bitcast=True) < 0, code | 0x80, code)  # the sign, -0.0 too


@triton.jit
def saturated_fp8(
    y,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    BYTES: tl.constexpr,
    E5M2: tl.constexpr,
):
    """y (fp32, already scaled) saturated at ±FP8_MAX and rounded to nearest even to FP8 (E5M2:
    float8_e5m2, else float8_e4m3fn): torch's cast, returned as its bytes (uint8). For every
    kernel that writes an FP8 copy (`fp8_constants` gives the constexprs of a dtype).

    Kernels store into the FP8 tensor viewed as bytes (`fp8_bytes`): under torch.compile
    Inductor autotunes a user kernel on random tensors of each argument's dtype, and torch
    cannot draw random FP8 tensors."""
    # saturate as torch's clamp does: comparisons leave NaN as it is (min/max might drop it)
    y = tl.where(y > FP8_MAX, FP8_MAX, y)
    y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
    if BYTES:  # the CPU interpreter (see _fp8_codes)
        return _fp8_codes(y, MANT, BIAS).to(tl.uint8)
    if E5M2:
        return y.to(tl.float8e5).to(tl.uint8, bitcast=True)  # round to nearest even
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def bf16_rounded(y, BYTES: tl.constexpr):
    """y (fp32) rounded to the nearest bf16, to nearest even, back in fp32: what an FP8 linear
    casts from a tensor that arrives in another dtype. BYTES (the CPU interpreter): in integer
    arithmetic, because the interpreter's fp32 -> bf16 conversion does not round to nearest."""
    if BYTES:
        bits = y.to(tl.int32, bitcast=True)
        lsb = (bits >> 16) & 1
        rounded = ((bits + 0x7FFF + lsb) & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000
        return tl.where(y != y, y, rounded)  # NaN as it is (its payload would carry)
    return y.to(tl.bfloat16).to(tl.float32)


def fp8_constants(dtype: torch.dtype) -> dict:
    """The constexprs `saturated_fp8` takes for an FP8 `dtype`."""
    return dict(
        FP8_MAX=torch.finfo(dtype).max,
        MANT=_MANTISSA[dtype],
        BIAS=_EXPONENT_BIAS[dtype],
        BYTES=interpreting(),
        E5M2=dtype == torch.float8_e5m2,
    )


def fp8_bytes(q: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as its bytes: what a kernel calling `saturated_fp8` stores into."""
    return q.view(torch.uint8)


@triton.autotune(
    configs=_tile_configs(),
    key=["M", "N", "TRANSPOSE", "AMAX"],
    prune_configs_by={"early_config_prune": _prune_tiles},
)
@triton.jit
def _fp8_cast_transpose(
    x_ptr,
    scale_ptr,
    q_ptr,
    qt_ptr,
    amax_ptr,
    M,
    N,
    stride_xm,
    stride_xn,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    BYTES: tl.constexpr,
    E5M2: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    AMAX: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile: q (M, N) row-major, qᵀ (N, M) row-major, amax (as bits)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0
    ).to(tl.float32)
    q = saturated_fp8(x * tl.load(scale_ptr), FP8_MAX, MANT, BIAS, BYTES, E5M2)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
    if TRANSPOSE:
        mask_t = (cols < N)[:, None] & (rows < M)[None, :]
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q), mask=mask_t)
    if AMAX:
        bits = tl.abs(x).to(tl.int32, bitcast=True)  # (BLOCK_M, BLOCK_N); masked-off lanes 0
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), tl.max(tl.max(bits, axis=1), axis=0))


def _check_scale(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if scale.numel() != 1:
        raise ValueError(
            f"fp8 cast: one scale per tensor, got a scale of shape {tuple(scale.shape)}"
        )
    if scale.device != x.device:
        raise ValueError(f"fp8 cast: the scale is on {scale.device}, the tensor on {x.device}")
    return scale.reshape(()).float()


def _amax(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    if n == 0:
        return out
    blocks = triton.cdiv(n, AMAX_BLOCK)
    limit = 4 if interpreting() else AMAX_PROGRAMS_PER_SM * sm_count(x.device.index or 0)
    wrap_triton(_fp8_amax)[(min(blocks, limit),)](flat, out, n, BLOCK=AMAX_BLOCK, num_warps=8)
    return out


def _cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    q: torch.Tensor,
    qt: torch.Tensor,
    transpose: bool,
    with_amax: bool,
) -> torch.Tensor:
    """Launch into q (M, N) and qt (N, M) (either may be a caller's buffer); returns the amax."""
    m, n = x.shape
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    if m * n == 0:
        return amax
    int64 = max(x.numel(), abs(x.stride(0)) * m, abs(x.stride(1)) * n) >= 2**31

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

    wrap_triton(_fp8_cast_transpose)[grid](
        x,
        scale,
        fp8_bytes(q),
        fp8_bytes(qt),
        amax,
        m,
        n,
        x.stride(0),
        x.stride(1),
        **fp8_constants(q.dtype),
        TRANSPOSE=transpose,
        AMAX=with_amax,
        INT64=int64,
    )
    return amax


def check_fp8_target(
    who: str, dtype: torch.dtype, scale: torch.Tensor | None, x: torch.Tensor
) -> None:
    """The FP8 `dtype` a kernel of `who` writes, and its cast's `scale` (None: none given): one
    fp32 value on x's device."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{who} to {dtype}: the FP8 dtypes are float8_e4m3fn and float8_e5m2")
    if scale is not None and (scale.numel() != 1 or scale.device != x.device):
        raise ValueError(f"{who}: the scale is one fp32 value on the input's device")


def _check(x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dim() != 2:
        raise ValueError(f"fp8_cast_transpose takes a 2-D tensor, got shape {tuple(x.shape)}")
    check_fp8_target("fp8 cast", dtype, None, x)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8 cast of a {x.dtype} tensor: takes fp32, bf16 or fp16")


# ---- custom ops, for torch.compile (functional: fresh outputs, nothing mutated) ----


@kernel_op("meshtrain::fp8_amax")
def _fp8_amax_op(x: torch.Tensor) -> torch.Tensor:
    return _amax(x)


@_fp8_amax_op.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


@kernel_op("meshtrain::fp8_cast_transpose")
def _fp8_cast_transpose_op(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool, with_amax: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    qt = torch.empty(x.shape[::-1] if transpose else (0,), dtype=dtype, device=x.device)
    amax = _cast_transpose(x, scale, q, qt, transpose, with_amax)
    return q, qt, amax


@_fp8_cast_transpose_op.register_fake
def _(x, scale, dtype, transpose, with_amax):
    qt = x.new_empty(x.shape[::-1] if transpose else (0,), dtype=dtype)
    return x.new_empty(x.shape, dtype=dtype), qt, x.new_empty((), dtype=torch.float32)


# ---- the public functions ----


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) as a 0-d fp32 tensor (0 for an empty x; NaN where x holds one)."""
    if torch.compiler.is_compiling():
        return _fp8_amax_op(x)
    return _amax(x)


def fp8_cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    transpose: bool = True,
    amax: bool = False,
    out: torch.Tensor | None = None,
    out_t: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x (M, N) cast to FP8 with one scale, its transpose and its amax, in one pass.

    Args:
        x: (M, N) fp32, bf16 or fp16, any strides.
        scale: one fp32 value (0-d or 1 element) on x's device; q = saturate(x · scale).
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        transpose: also write qᵀ (N, M), contiguous.
        amax: also return amax(|x|) (0-d fp32) from the same pass.
        out, out_t: buffers to write q (M, N) and qᵀ (N, M) into, contiguous, of `dtype`
            (eager only: a compiled graph takes the fresh outputs).

    Returns:
        (q, qᵀ or None, amax or None).
    """
    _check(x, dtype)
    scale = _check_scale(scale, x)
    if torch.compiler.is_compiling():
        if out is not None or out_t is not None:
            raise ValueError("fp8_cast_transpose: out= buffers are for eager calls")
        q, qt, a = _fp8_cast_transpose_op(x, scale, dtype, transpose, amax)
        return q, qt if transpose else None, a if amax else None
    for name, buf, shape in (("out", out, x.shape), ("out_t", out_t, x.shape[::-1])):
        if buf is not None and (
            buf.shape != shape or buf.dtype != dtype or not buf.is_contiguous()
        ):
            raise ValueError(
                f"fp8_cast_transpose: {name} must be a contiguous {dtype} tensor of shape "
                f"{tuple(shape)}, got {buf.dtype} {tuple(buf.shape)}"
            )
    q = out if out is not None else torch.empty(x.shape, dtype=dtype, device=x.device)
    qt = None
    if transpose:
        qt = (
            out_t if out_t is not None else torch.empty(x.shape[::-1], dtype=dtype, device=x.device)
        )
    a = _cast_transpose(x, scale, q, q if qt is None else qt, transpose, amax)
    return q, qt, a if amax else None
