"""The autotune space of the norm kernels: what pruning keeps for a row width."""

import pytest

from tests.kernels.conftest import needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("block", [128, 1024, 2048, 8192, 16384])
def test_pruned_space_fits_registers_and_keeps_the_heuristic(monkeypatch, block, backward):
    """On a GPU (autotuning on): every kept tile fits the per-lane budget, the untuned launch
    is always a candidate, and the space stays small enough to tune in seconds."""
    from kernels import _launch

    monkeypatch.setattr(_launch, "autotuning", lambda: True)
    kept = _launch.prune_row_configs(backward)(_launch.row_configs(backward), {"n_rows": 16384}, BLOCK=block)
    default = _launch.heuristic_config(block, backward)
    key = lambda c: (c.kwargs["ROWS"], c.num_warps, c.num_stages)
    assert key(kept[0]) == key(default)
    assert 1 <= len(kept) <= 30
    for c in kept[1:]:
        assert (8 if backward else 4) <= c.kwargs["ROWS"] * block // (32 * c.num_warps) <= (32 if backward else 64)
    assert len({key(c) for c in kept}) == len(kept)


def test_prune_returns_the_heuristic_alone_without_autotuning(monkeypatch):
    """Under the interpreter (these tests) or MESHTRAIN_KERNEL_AUTOTUNE=0 nothing is timed."""
    from kernels import _launch

    monkeypatch.setattr(_launch, "autotuning", lambda: False)
    kept = _launch.prune_row_configs(False)(_launch.row_configs(False), {"n_rows": 5}, BLOCK=128)
    assert len(kept) == 1


@pytest.mark.parametrize("rows", [1, 5, 70, 4096, 16385])
def test_reduction_programs_cover_every_row_once(rows):
    import torch

    from kernels._launch import reduction_programs

    programs, per_program = reduction_programs(rows, torch.device("cpu"))
    assert (programs - 1) * per_program < rows <= programs * per_program
