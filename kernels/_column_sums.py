"""Column sums of the norm backward kernels' fp32 partials, cast to the gradients' dtypes: one
launch.

The norm backward kernels (`kernels/rms_norm.py`, `kernels/layer_norm.py`) leave one fp32
partial row per program of the weight gradient (programs x hidden), and LayerNorm a second
buffer for the bias. Summed with torch that is a reduction kernel and a cast kernel per
buffer: four launches for LayerNorm, a noticeable share of a backward pass this short
(measured: BENCHMARKS.md, 'Kernels'). This kernel sums one or two buffers and writes each result
straight in its parameter's dtype, in one launch. Each program owns a slice of columns and
walks every partial row in a fixed order, so the result is deterministic (no atomics).

Autotuned over the column slice, the partial rows per tile and warps, keyed on the hidden size
and the partial count; it only writes fresh outputs, so autotune's repeated launches are
harmless. Under the CPU interpreter, or with MESHTRAIN_KERNEL_AUTOTUNE=0, the first config
alone runs.
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

from meshtrain.kernels._launch import autotuning, wrap_triton

_CONFIGS = [
    triton.Config({"COLS": c, "PARTS": p}, num_warps=w)
    for c, p, w in ((32, 32, 4), (16, 64, 4), (64, 32, 4), (32, 64, 8), (128, 16, 4), (16, 32, 2))
]
_CONFIGS += [
    triton.Config({"COLS": c, "PARTS": p}, num_warps=w)
    for c in (4, 8, 16, 32)
    for p in (128, 256)
    for w in (4, 8)
]
"""(columns per program, partial rows per tile, warps); the first is the untuned launch.

The second list gives narrow column slices (more programs: at hidden 768-1024 a 32-column slice
leaves 24-32 programs for 132 SMs) over deep tiles of partial rows; they roughly halve the
LayerNorm backward's two sums (measured: BENCHMARKS.md, 'Kernel design choices')."""


def _prune(configs, named_args, **kwargs):
    return configs if autotuning() else configs[:1]


@triton.autotune(
    configs=_CONFIGS, key=["n_cols", "n_parts"], prune_configs_by={"early_config_prune": _prune}
)
@triton.jit
def _column_sums(
    a_ptr,
    b_ptr,
    out_a_ptr,
    out_b_ptr,
    n_parts,
    n_cols,
    HAS_B: tl.constexpr,
    COLS: tl.constexpr,
    PARTS: tl.constexpr,
):
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    cols_ok = cols < n_cols
    acc_a = tl.zeros((PARTS, COLS), dtype=tl.float32)
    acc_b = tl.zeros((PARTS, COLS), dtype=tl.float32)
    for start in range(0, n_parts, PARTS):
        parts = start + tl.arange(0, PARTS)
        mask = (parts < n_parts)[:, None] & cols_ok[None, :]
        offs = parts[:, None] * n_cols + cols[None, :]
        acc_a += tl.load(a_ptr + offs, mask=mask, other=0.0)
        if HAS_B:
            acc_b += tl.load(b_ptr + offs, mask=mask, other=0.0)
    tl.store(out_a_ptr + cols, tl.sum(acc_a, axis=0).to(out_a_ptr.dtype.element_ty), mask=cols_ok)
    if HAS_B:
        tl.store(
            out_b_ptr + cols, tl.sum(acc_b, axis=0).to(out_b_ptr.dtype.element_ty), mask=cols_ok
        )


def column_sums(
    a: torch.Tensor,
    a_dtype: torch.dtype,
    b: torch.Tensor | None = None,
    b_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a.sum(0) in a_dtype, b.sum(0) in b_dtype or None), summed in fp32 in one launch.

    Args:
        a: (parts, n) fp32 partial rows, contiguous.
        a_dtype: dtype of the first result.
        b: optional second (parts, n) fp32 buffer of the same shape.
        b_dtype: dtype of the second result (required with `b`).
    """
    parts, n = a.shape
    bad_b = b is not None and (
        b.shape != a.shape or not b.is_contiguous() or b.dtype != torch.float32
    )
    if not a.is_contiguous() or a.dtype != torch.float32 or bad_b:
        raise ValueError(
            f"column_sums takes contiguous fp32 partials of one shape, got {a.shape} {a.dtype}"
            f"{'' if b is None else f' and {b.shape}'}"
        )
    out_a = torch.empty(n, dtype=a_dtype, device=a.device)
    out_b = None if b is None else torch.empty(n, dtype=b_dtype, device=a.device)
    wrap_triton(_column_sums)[lambda meta: (triton.cdiv(n, meta["COLS"]),)](
        a,
        a if b is None else b,
        out_a,
        out_a if out_b is None else out_b,
        parts,
        n,
        HAS_B=b is not None,
    )
    return out_a, out_b
