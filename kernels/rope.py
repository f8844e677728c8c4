"""Rotary position embedding in Triton, rotate-half convention (Hugging Face Llama's).

y = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] on the halves of head_dim. One
program handles a few positions of one sequence for every head at once, so each cos/sin row is read
once per program and reused across heads. q and k arrive as strided views of the fused qkv
projection ((b, s, heads, d) transposed to (b, heads, s, d)); the kernel reads them through their
strides instead of copying, and writes a contiguous (b, heads, s, d) output, the layout SDPA
prefers.

Backward is the transpose of the same rotation: dx1 = c1 dy1 + s2 dy2, dx2 = c2 dy2 - s1 dy1,
which is the forward formula with sin's halves swapped and negated, so one kernel serves
both (`BACKWARD` flag). The kernel is autotuned over positions per program and warps (key:
heads, head_dim, sequence-length bucket; `_configs`); it only writes a fresh output, so
autotune's repeated launches are harmless. Eager autograd goes through `_RoPE`, torch.compile
through the custom op `meshtrain::rope` (one opaque node, fake implementation for shapes).
Spec: `meshtrain.kernels.reference.rope`.
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

from meshtrain.kernels._launch import autotuning, kernel_op, row_bucket, wrap_triton


def _heuristic(block_h: int, block_d: int, seq: int) -> triton.Config:
    # several positions per program so each moves ~8k values: one position of a few heads is
    # too little work to hide a launch's and a load's latency
    pos = max(1, min(triton.next_power_of_2(seq), 4096 // (block_h * block_d)))
    return triton.Config({"POS": pos}, num_warps=max(1, min(8, pos * block_h * block_d // 512)))


def _prune(configs, named_args, **kwargs):
    """Tiles of 1k-16k half-rows' values (each value is loaded twice, once per half), at
    least 4 and at most 64 per lane, no more positions than the sequence; plus the heuristic."""
    block_h, block_d, seq = kwargs["BLOCK_H"], kwargs["BLOCK_D"], named_args["seq"]
    default = _heuristic(block_h, block_d, seq)
    if not autotuning():
        return [default]
    keep = [default]
    for c in configs:
        pos = c.kwargs["POS"]
        tile = pos * block_h * block_d
        if (
            pos <= row_bucket(seq)
            and 1024 <= tile <= 16384
            and 4 <= tile // (32 * c.num_warps) <= 64
            and (pos, c.num_warps) != (default.kwargs["POS"], default.num_warps)
        ):
            keep.append(c)
    return keep


_configs = [
    triton.Config({"POS": p}, num_warps=w) for p in (1, 2, 4, 8, 16, 32, 64) for w in (2, 4, 8, 16)
]


@triton.autotune(
    configs=_configs,
    key=["seq_bucket", "n_heads", "half"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    t_sb,
    x_sb,
    x_sh,
    x_ss,
    y_sb,
    y_sh,
    y_ss,
    seq,
    seq_bucket,
    n_heads,
    half,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    POS: tl.constexpr,
):
    # a tile of POS positions x every head, flattened to (POS * BLOCK_H, BLOCK_D) rows
    r = tl.arange(0, POS * BLOCK_H)
    pos = (tl.program_id(0) * POS + r // BLOCK_H).to(tl.int64)[:, None]
    heads = (r % BLOCK_H)[:, None]
    b = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    table_mask = (pos < seq) & (cols < half)
    mask = table_mask & (heads < n_heads)
    table = b * t_sb + pos * 2 * half + cols  # t_sb 0: one table for every sequence
    c1 = tl.load(cos_ptr + table, mask=table_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + half, mask=table_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=table_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + half, mask=table_mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # transpose of the rotation: swap sin's halves and negate them
        t = s1
        s1 = -s2
        s2 = -t
    x_row = x_ptr + b * x_sb + pos * x_ss + heads * x_sh
    x1 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
    y_row = y_ptr + b * y_sb + pos * y_ss + heads * y_sh
    tl.store(y_row + cols, (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + half + cols, (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, s, d = x.shape
    y = torch.empty((b, h, s, d), dtype=x.dtype, device=x.device)
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d // 2)
    wrap_triton(_rope_kernel)[lambda meta: (triton.cdiv(s, meta["POS"]), b)](
        x,
        cos,
        sin,
        y,
        cos.shape[1] * d if cos.dim() == 3 else 0,  # per-sequence tables (contiguous) or one
        x.stride(0),
        x.stride(1),
        x.stride(2),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        s,
        row_bucket(s),
        h,
        d // 2,
        BACKWARD=backward,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
    return y


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, backward=True), None, None


# ---- the same launcher as custom ops, for torch.compile ----


@kernel_op("meshtrain::rope")
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(x, cos.contiguous(), sin.contiguous(), backward=False)


@kernel_op("meshtrain::rope_backward")
def _rope_backward_op(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(dy, cos.contiguous(), sin.contiguous(), backward=True)


@_rope_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


@_rope_backward_op.register_fake
def _(dy, cos, sin):
    return dy.new_empty(dy.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _op_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return _rope_backward_op(dy, cos, sin), None, None


_rope_op.register_autograd(_op_backward, setup_context=_setup)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention (the one Hugging Face Llama uses).

    Args:
        x: (batch, heads, seq, head_dim), any strides; head_dim even.
        cos, sin: (seq, head_dim) from `rope_cos_sin`, or (batch, seq, head_dim): each
            sequence's own rows (positions restarting at each packed document); not
            differentiated.

    Returns:
        (batch, heads, seq, head_dim), contiguous, in x's dtype.
    """
    if (
        x.dim() != 4
        or x.shape[-1] % 2
        or cos.shape not in ((x.shape[2], x.shape[3]), (x.shape[0], x.shape[2], x.shape[3]))
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"rope needs x (b, h, s, even d) and cos/sin (s, d) or (b, s, d); got "
            f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if torch.compiler.is_compiling():
        return _rope_op(x, cos, sin)
    return _RoPE.apply(x, cos, sin)
