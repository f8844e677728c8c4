"""Launch arithmetic shared by the Triton kernels: block sizes, autotune spaces, program counts.

Kept out of the kernel files because every row-wise kernel makes the same choices; the
kernels themselves stay one per file.

Row-wise kernels (the norms) are autotuned: `row_configs` spans rows per program and warps,
and `prune_row_configs` keeps, for the row width at hand, the configs whose tile fits in
registers. The autotune key is the row width plus a power-of-two bucket of the row count
(`row_bucket`), so a training run tunes once per norm shape. The heuristic config (the launch
used before autotuning) is always in the space, so tuning can only pick something at least as
fast. Under Triton's CPU interpreter, or with MESHTRAIN_KERNEL_AUTOTUNE=0, the pruning
returns the heuristic alone and nothing is timed.

Every launch goes through `wrap_triton(kernel)` and every op's launcher is registered with
`kernel_op`: on a GPU build that is a `torch.library.triton_op`, whose body torch.compile
traces, so Inductor sees the Triton kernels themselves and launches them from its generated
code (no Python call out of the compiled graph, tuned at compile time). Under the CPU
interpreter kernels cannot be traced, so there the op is an opaque `custom_op`.
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import functools
import os

import torch
import torch.utils._python_dispatch
import triton
import triton.language as tl

# A row-wise kernel holds a whole row in registers; past this many elements it would spill,
# so wider rows are refused rather than silently slow (hidden sizes up to 16k fit).
MAX_ROW_BLOCK = 16384


def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def wrap_triton(kernel):
    """`kernel`, launchable from a traced function: `torch.library.wrap_triton(kernel)`.

    Only while a dispatch mode is active, that is, while AOT autograd traces a triton_op's
    body for torch.compile. Plain eager calls (the autograd Functions, an op run on real
    tensors) get the kernel itself and launch it directly, as before there were triton_ops,
    without a detour through the tracing wrapper. Also the kernel itself under the interpreter
    (its kernels cannot be traced) and on a torch without `wrap_triton` (before 2.6).

    Launchers call it by this name on the kernel's own name (`wrap_triton(_rms_norm_fwd)[grid]
    (...)`): torch scans a triton_op's source for exactly that pattern to find its kernels and
    hash their source into the compile cache's key, so an edited kernel is recompiled instead
    of served stale from the cache.
    """
    if interpreting() or not hasattr(torch.library, "wrap_triton") or not tracing():
        return kernel
    if isinstance(kernel, triton.runtime.Autotuner) and len(kernel.configs) > 1:
        return _TunedWhileTracing(kernel)
    return torch.library.wrap_triton(kernel)


class _TunedWhileTracing:
    """An autotuned kernel launched from a traced op, handed to Inductor with one config: eager's.

    Inductor launches a user's autotuned kernel by timing every config of its list again, with its
    own benchmarker, when the compiled graph first runs, and its pick moved from run to run, so the
    same kernel ran slower in one compiled graph than in the next and than eager (measured:
    BENCHMARKS.md, 'Kernel design choices'). Here the kernel is tuned while the op is traced, by
    Triton's autotuner on scratch tensors of the traced shapes (its pruning included), and Inductor
    gets an autotuner holding that config alone, so compiled and eager launches run the same tile.
    Shapes that are not static fall back to Inductor's own tuning.
    """

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            config = _eager_choice(self.kernel, grid, args, kwargs)
            kernel = self.kernel if config is None else _with_config(self.kernel, config)
            return torch.library.wrap_triton(kernel)[grid](*args, **kwargs)

        return launch


def _eager_choice(kernel, grid, args, kwargs):
    """The config Triton's autotuner picks for these (traced) arguments; None where it cannot
    launch them (symbolic shapes, host tensors: a trace without a GPU)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not all(isinstance(d, int) for t in tensors for d in (*t.shape, *t.stride())):
        return None
    if any(t.device.type == "cpu" for t in tensors):
        return None
    if not all(
        isinstance(a, (torch.Tensor, int, float, bool, type(None)))
        for a in (*args, *kwargs.values())
    ):
        return None
    with (
        torch.utils._python_dispatch._disable_current_modes()
    ):  # out of fake / proxy tracing: real launches
        kernel[grid](*map(_scratch_like, args), **{k: _scratch_like(v) for k, v in kwargs.items()})
    return kernel.best_config


def _scratch_like(a):
    """A real tensor of `a`'s shape, strides, dtype and device (random floats, zero integers); other
    values as they are."""
    if not isinstance(a, torch.Tensor):
        return a
    t = torch.empty_strided(tuple(a.shape), tuple(a.stride()), dtype=a.dtype, device=a.device)
    return t.normal_() if t.is_floating_point() else t.zero_()


_ONE_CONFIG: dict[tuple[int, str], object] = {}


def _with_config(kernel, config):
    """An autotuner over `kernel`'s function with `config` alone (one per kernel and config)."""
    key = (id(kernel), str(config))
    if key not in _ONE_CONFIG:
        _ONE_CONFIG[key] = triton.autotune(
            configs=[config],
            key=list(kernel.keys),
            reset_to_zero=getattr(kernel, "reset_to_zero", None) or None,
            restore_value=getattr(kernel, "restore_value", None) or None,
        )(kernel.fn)
    return _ONE_CONFIG[key]


def tracing() -> bool:
    """Whether a TorchDispatchMode (AOT autograd's functionalization / proxy tracing) is active."""
    current = getattr(torch.utils._python_dispatch, "_get_current_dispatch_mode", None)
    return current is None or current() is not None


def kernel_op(name: str):
    """Decorator: register a launcher (its inputs unmutated) as the custom op `name`.

    A `triton_op` where Triton compiles for a GPU (torch.compile traces into it and Inductor
    launches its kernels directly); a plain, opaque `custom_op` under the CPU interpreter or
    on a torch without `triton_op` (before 2.6). Either way the op's fake implementation is the
    one the caller registers.
    """

    def register(fn):
        if interpreting() or not hasattr(torch.library, "triton_op"):
            return torch.library.custom_op(name, mutates_args=())(fn)
        return torch.library.triton_op(name, mutates_args=())(fn)

    return register


def autotuning() -> bool:
    """Whether launches may time several configs: on a GPU, unless MESHTRAIN_KERNEL_AUTOTUNE=0."""
    return not interpreting() and os.environ.get("MESHTRAIN_KERNEL_AUTOTUNE", "1") != "0"


def row_block(n: int) -> int:
    """Power-of-two block covering a row of `n` elements."""
    block = triton.next_power_of_2(n)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"row of {n} elements exceeds the kernel's limit of {MAX_ROW_BLOCK}")
    return block


def row_bucket(n_rows: int) -> int:
    """The row count rounded up to a power of two: the autotune key's row part."""
    return triton.next_power_of_2(max(1, n_rows))


def row_warps(elements: int) -> int:
    """Warps for a tile of `elements` values: about 16 per lane, between 1 and 8 warps."""
    return max(1, min(8, elements // 512))


def rows_per_tile(block: int, values: int = 4096) -> int:
    """Rows a norm kernel handles at once, so a tile holds ~`values` values whatever the width.

    Narrow rows (hidden 768-1024) alone make programs too short to keep enough loads in
    flight; stacking rows gives each program a bigger, still register-resident tile.
    Backward asks for half as many values: it holds x, dy and a weight-gradient row at once.
    """
    return max(1, min(16, values // block))


def heuristic_config(block: int, backward: bool) -> triton.Config:
    """The untuned launch: ~4k values per tile forward, ~2k backward, ~16 values per lane."""
    rows = rows_per_tile(block, 2048 if backward else 4096)
    return triton.Config({"ROWS": rows}, num_warps=row_warps(rows * block), num_stages=1)


def row_configs(backward: bool) -> list[triton.Config]:
    """The autotune space of a norm kernel, before pruning to a row width.

    One pipeline stage throughout: forward has no loop, and backward issues each tile's loads
    a tile ahead itself, which was faster than Triton's software pipelining of the plain loop
    (3 stages) at every hidden size tried (measured: BENCHMARKS.md, 'Kernel design choices').
    """
    return [
        triton.Config({"ROWS": r}, num_warps=w, num_stages=1)
        for r in (1, 2, 4, 8, 16, 32)
        for w in (1, 2, 4, 8, 16)
    ]


def prune_row_configs(backward: bool):
    """An `early_config_prune` for `row_configs`: tiles that fit the row width at hand.

    Keeps tiles of at most 16k values forward (8k backward, which holds x, dy and the
    gradient rows at once), 4-64 values per lane forward and 8-32 backward (fewer leaves
    lanes idle or loads narrow, more spills), and no more rows than the launch has: 10-20
    candidates at hidden sizes 1k-2k. Always includes the heuristic; returns it alone when
    not autotuning.
    """
    max_tile = 8192 if backward else 16384
    min_per_lane, max_per_lane = (8, 32) if backward else (4, 64)

    def prune(configs, named_args, **kwargs):
        block = kwargs["BLOCK"]
        default = heuristic_config(block, backward)
        if not autotuning():
            return [default]
        rows_cap = row_bucket(named_args["n_rows"])
        keep = [default]
        for c in configs:
            rows = c.kwargs["ROWS"]
            tile = rows * block
            per_lane = tile // (32 * c.num_warps)
            fits = (
                rows <= rows_cap
                and tile <= max(max_tile, block)
                and min_per_lane <= per_lane <= max_per_lane
            )
            if fits and (rows, c.num_warps, c.num_stages) != (
                default.kwargs["ROWS"],
                default.num_warps,
                default.num_stages,
            ):
                keep.append(c)
        return keep

    return prune


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


REDUCTION_PROGRAMS_PER_SM = 4
"""Programs per SM of the norms' backward kernels (`reduction_programs`).

Chosen with the prefetching backward loop (measured: BENCHMARKS.md, 'Kernel design choices'):
fewer, longer programs keep the loop's next loads in flight with fewer partial rows to sum.
"""


def reduction_programs(
    rows: int, device: torch.device, per_sm: int | None = None
) -> tuple[int, int]:
    """(programs, rows each) for a kernel that also reduces a per-column sum (norm weight grads).

    Each program walks its rows tile by tile (a contiguous run, `_row_tile`, or every
    programs-th row, `_row_tile_interleaved`) and writes one fp32 partial row;
    a few programs per SM (`REDUCTION_PROGRAMS_PER_SM` unless `per_sm` is given) keep the GPU
    busy while the partials (programs x hidden) stay a few percent of the traffic.
    The count does not depend on the autotuned tile, so the partial buffer is sized before
    the launch and every program writes its whole partial row (no zero-fill, nothing for
    autotune's repeated launches to corrupt). Under the CPU interpreter a handful suffices.
    """
    if rows == 0:
        # one program, no rows: it writes a zero partial row, so the weight gradient of an
        # empty batch is 0 (as the reference's) rather than a division by zero here
        return 1, 0
    per_sm = REDUCTION_PROGRAMS_PER_SM if per_sm is None else per_sm
    target = per_sm * sm_count(device.index or 0) if device.type == "cuda" else 4
    per_program = triton.cdiv(rows, max(1, min(rows, target)))
    return triton.cdiv(rows, per_program), per_program  # no program left without rows


@triton.jit
def _row_tile(
    start, end, cols_ok, ROWS: tl.constexpr, EVEN_COLS: tl.constexpr, INT64: tl.constexpr
):
    """(rows, mask) of the tile of ROWS rows from `start`, rows at or past `end` masked off.

    For the norms' backward loops, which compute each tile's offsets a tile ahead, and the
    forward tile of the norms that write an FP8 copy (`kernels/norm_fp8.py`). The mask
    is (ROWS, 1) when the hidden size fills the block (EVEN_COLS), else (ROWS, BLOCK).
    """
    rows = start + tl.arange(0, ROWS)
    if INT64:
        rows = rows.to(tl.int64)
    if EVEN_COLS:
        mask = (rows < end)[:, None]
    else:
        mask = (rows < end)[:, None] & cols_ok[None, :]
    return rows, mask


@triton.jit
def _row_tile_interleaved(
    k, n_rows, cols_ok, ROWS: tl.constexpr, EVEN_COLS: tl.constexpr, INT64: tl.constexpr
):
    """(rows, mask) of this program's tile of ROWS rows from its k-th, rows past `n_rows` masked
    off.

    Program p of P takes rows p, p + P, p + 2P, ...: the programs in flight read neighbouring
    rows, in address order, instead of each its own contiguous run (`_row_tile`). For RMSNorm's
    backward, which it made faster (measured: BENCHMARKS.md, 'Kernel design choices'). The
    mask is (ROWS, 1) when the hidden size fills the block (EVEN_COLS), else
    (ROWS, BLOCK).
    """
    index = k + tl.arange(0, ROWS)
    if INT64:
        index = index.to(tl.int64)
    rows = index * tl.num_programs(0) + tl.program_id(0)
    if EVEN_COLS:
        mask = (rows < n_rows)[:, None]
    else:
        mask = (rows < n_rows)[:, None] & cols_ok[None, :]
    return rows, mask


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a (rows, last_dim) matrix with unit stride along the last dim (copies only if
    needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether element offsets into any of `tensors` may pass int32's range."""
    return any(t.numel() > 0 and max(t.stride(0) * t.shape[0], t.numel()) >= 2**31 for t in tensors)
