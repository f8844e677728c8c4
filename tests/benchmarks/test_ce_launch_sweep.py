"""The cross-entropy launch sweep's grid (the timing itself needs a GPU)."""

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("vocab", [50304, 128256, 3000])
def test_grid_fits_the_row_and_the_lanes(vocab):
    from benchmarks.ce_launch_sweep import settings

    grid = settings(vocab)
    assert grid, "an empty grid would time nothing but the default"
    for launch in grid:
        assert launch["BLOCK"] <= max(2048, 1 << (vocab - 1).bit_length())
        assert 4 <= launch["BLOCK"] // (32 * launch["num_warps"]) <= 64
    assert len({tuple(sorted(s.items())) for s in grid}) == len(grid)
    if vocab == 3000:  # a 4096-wide block covers the row: nothing wider is tried
        assert max(s["BLOCK"] for s in grid) == 4096
