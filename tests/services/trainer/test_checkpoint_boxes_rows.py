"""A fully sharded rank's rows of a tensor-parallel shard, as boxes of the global array.

`checkpoint_boxes._cut_rows` is what `local_pieces` does with a DTensor's local rows: every
rank's boxes must lie on one shard grid, cover the global array exactly once, and hold the
values at their global offsets, also when the rows do not split evenly (torch.chunk's last
ranks short or empty), per SwiGLU half, and with the padded vocabulary cut off.
"""

import pytest
import torch

from meshtrain.services.trainer.checkpoint_boxes import Place, _cut_rows, pieces
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor_layers import TPSplit


def _boxes(name, full, split, tp, dp, vocab, place):
    """(spec, values) of every box every (tp, dp) rank writes, as local_pieces cuts them."""
    out = []
    for r in range(tp):
        tp_local = split.shard(full, r, tp) if split else full
        param = torch.nn.Parameter(tp_local.clone())
        param.tp_split = split  # type: ignore[attr-defined]
        n = tp_local.shape[0]
        rows = -(-n // dp)
        halves = split is not None and split.halves
        for k in range(dp):
            lo, hi = min(k * rows, n), min(k * rows + rows, n)
            whole = pieces(name, tuple(tp_local.shape), param, Mesh(tp=tp, rank=r), vocab, place)
            shard = tp_local[lo:hi]
            for pc in _cut_rows(whole, lo, hi, n, rows, halves):
                out.append((pc.spec, shard[pc.local]))
    return out


@pytest.mark.parametrize(
    "name, rows, split, tp, dp, vocab",
    [
        ("layers.0.mlp.fc2.weight", 10, None, 1, 4, 0),  # 3, 3, 3, 1 rows
        ("layers.0.mlp.fc2.weight", 3, None, 1, 4, 0),  # the last rank holds nothing
        ("layers.0.mlp.fc1.weight", 24, TPSplit(0, halves=True), 2, 4, 0),  # 12 a rank: 3, 3, ..
        ("layers.0.mlp.fc1.weight", 20, TPSplit(0, halves=True), 2, 3, 0),  # 10: 4, 4, 2
        ("output_layer.weight", 12, TPSplit(0, vocab=True), 2, 4, 11),  # padded to 12
        ("embedding.word_embeddings.weight", 16, None, 1, 3, 13),
    ],
)
def test_rows_cut_to_boxes_tile_the_global_array(name, rows, split, tp, dp, vocab):
    full = torch.arange(rows * 5, dtype=torch.float32).view(rows, 5)
    stacked = name.startswith("layers.")
    place = Place("layers.mlp.x", 0, 1) if stacked else Place(name)
    boxes = _boxes(name, full, split, tp, dp, vocab or rows, place)
    covered = torch.zeros(full.shape[0] if not vocab else vocab, 5)
    grids = set()
    for spec, values in boxes:
        grids.add(spec.grid_shape)
        offsets, shape = spec.offsets[-2:], spec.shape[-2:]
        box = (slice(offsets[0], offsets[0] + shape[0]), slice(offsets[1], offsets[1] + shape[1]))
        torch.testing.assert_close(values.reshape(shape), full[box])
        covered[box] += 1
    assert len(grids) == 1, grids
    assert bool((covered == 1).all()), covered[:, 0]
