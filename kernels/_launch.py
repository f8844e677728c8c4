"""Launch arithmetic shared by the Triton kernels: block sizes, warps and program counts.

Kept out of the kernel files because every row-wise kernel makes the same choices; the
kernels themselves stay one per file.
"""

from __future__ import annotations

import functools

import torch
import triton

# A row-wise kernel holds a whole row in registers; past this many elements it would spill,
# so wider rows are refused rather than silently slow (hidden sizes up to 16k fit).
MAX_ROW_BLOCK = 16384


def row_block(n: int) -> int:
    """Power-of-two block covering a row of `n` elements."""
    block = triton.next_power_of_2(n)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"row of {n} elements exceeds the kernel's limit of {MAX_ROW_BLOCK}")
    return block


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


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def reduction_programs(tiles: int, device: torch.device, per_sm: int = 8) -> int:
    """Programs for a kernel that also reduces a per-column sum (norm weight grads).

    Each program walks a contiguous run of row tiles and writes one fp32 partial row; a few
    programs per SM keep the GPU busy while the partials (programs x hidden) stay a few
    percent of the traffic (8 per SM measured best of 2/4/8/16 on an H200, hidden 1k-4k). Under the CPU interpreter a handful suffices and keeps tests fast.
    """
    if device.type == "cuda":
        return max(1, min(tiles, per_sm * _sm_count(device.index or 0)))
    return max(1, min(tiles, 4))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a (rows, last_dim) matrix with unit stride along the last dim (copies only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2
