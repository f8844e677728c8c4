"""Multi-writer saves: boxes from several writers tile global arrays; any box reads back."""

import math
import threading

import pytest
import torch
from zarr.storage import MemoryStore

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.boxes import (
    ArrayMeta,
    ShardSpec,
    check_tiling,
    encode_box,
    inner_chunks,
)
from meshtrain.services.checkpoint.committer import commit
from meshtrain.services.checkpoint.multiwriter import ShardWriter, abort_save, begin_save
from meshtrain.services.checkpoint.reader import (
    list_checkpoints,
    load_checkpoint,
    read_box,
    read_manifest,
)
from meshtrain.services.checkpoint.store import open_root
from meshtrain.services.common.errors import CheckpointError

LAYERS, ROWS, COLS = 3, 12, 5


def qkv_global(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, ROWS, COLS, generator=g).to(torch.bfloat16)


def tp_boxes(full, tp):
    """What tensor-parallel rank r of `tp` owns of a stacked array: rows split, per layer."""
    rows = ROWS // tp
    return {
        r: [
            (
                ShardSpec(
                    "layers.attention.qkv.weight",
                    full.shape,
                    "bfloat16",
                    (layer, r * rows, 0),
                    (1, rows, COLS),
                ),
                full[layer : layer + 1, r * rows : (r + 1) * rows],
            )
            for layer in range(LAYERS)
        ]
        for r in range(tp)
    }


def save_tp(root, step, full, tp, extra=None):
    save_id = begin_save(root, step)
    threads = []
    for rank, boxes in tp_boxes(full, tp).items():

        def run(rank=rank, boxes=boxes):
            writer = ShardWriter(root, step, save_id, rank, tp)
            for spec, data in boxes:
                writer.write(spec, data)
            if rank == 0 and extra is not None:
                writer.write(*extra)
            writer.finish()

        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()
    result = commit(root, step, save_id, tp, {"tp": tp}, timeout=30)
    for t in threads:
        t.join()
    return result


def test_two_writers_save_and_any_layout_reads_back(root):
    full = qkv_global()
    scalar = torch.tensor(7, dtype=torch.int64)
    save_tp(root, 5, full, tp=2, extra=(ShardSpec("optim.step", (), "int64", (), ()), scalar))
    manifest = read_manifest(root, 5)
    entry = manifest["arrays"]["layers.attention.qkv.weight"]
    assert entry["shards"] == [1, ROWS // 2, COLS] and entry["layer_count"] == LAYERS
    assert len(entry["objects"]) == LAYERS * 2 + 1  # one object per box + zarr.json
    assert manifest["metadata"] == {"tp": 2}
    # a tp=3 reader: boxes that cross the tp=2 shard boundary (rows 4:8 spans shards 0 and 1)
    for r in range(3):
        got = read_box(root, 5, "layers.attention.qkv.weight", (0, r * 4, 0), (LAYERS, 4, COLS))
        assert torch.equal(got.view(torch.int16), full[:, r * 4 : (r + 1) * 4].view(torch.int16))
    # the single-process API sees per-layer tensors of the same checkpoint
    tensors, _ = load_checkpoint(root, 5)
    assert torch.equal(
        tensors["layers.1.attention.qkv.weight"].view(torch.int16), full[1].view(torch.int16)
    )
    assert torch.equal(tensors["optim.step"], scalar)
    # no fragments or other leftovers after the commit
    r = open_root(root)
    assert not r.fs.exists(r.step_path(5) + "/_fragments")


def test_edge_boxes_shorter_than_the_grid(root):
    """A 10-row array in 4-row boxes: the last box holds 2 rows and says its grid is 4."""
    full = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    save_id = begin_save(root, 1)
    for w, start in enumerate((0, 4, 8)):
        rows = min(4, 10 - start)
        writer = ShardWriter(root, 1, save_id, w, 3)
        writer.write(
            ShardSpec("w", (10, 3), "float32", (start, 0), (rows, 3), grid=(4, 3)),
            full[start : start + rows],
        )
        writer.finish()
    commit(root, 1, save_id, 3, timeout=5)
    assert torch.equal(read_box(root, 1, "w", (3, 1), (6, 2)), full[3:9, 1:3])


@pytest.mark.parametrize(
    "boxes, match",
    [
        ([((0, 0), (4, 3)), ((0, 0), (4, 3))], "boxes overlap"),
        ([((0, 0), (4, 3))], "has holes: 1 of 2 boxes"),
        ([((0, 0), (4, 3)), ((4, 0), (2, 3))], "disagree on its shape/dtype/shard grid"),
    ],
)
def test_overlap_holes_and_mixed_grids_abort_the_commit(root, boxes, match):
    full = torch.zeros(8, 3)
    save_id = begin_save(root, 2)
    for w, (offsets, shape) in enumerate(boxes):
        writer = ShardWriter(root, 2, save_id, w, len(boxes))
        writer.write(
            ShardSpec("grid.w", (8, 3), "float32", offsets, shape),
            full[offsets[0] : offsets[0] + shape[0]],
        )
        writer.finish()
    with pytest.raises(CheckpointError, match=rf"array 'grid.w'.*{match}|{match}.*'grid.w'"):
        commit(root, 2, save_id, len(boxes), timeout=5)
    assert list_checkpoints(root) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"offsets": (1, 0), "shape": (4, 3)}, "not a multiple of the shard size"),
        ({"offsets": (4, 0), "shape": (5, 3)}, "outside global shape"),
        ({"offsets": (4, 0), "shape": (2, 3), "grid": (4, 3)}, "should be 4"),
        (
            {"offsets": (8, 0), "shape": (0, 3), "grid": (4, 3)},
            "offset 8 of dim 0 is at the end of the array",
        ),
        ({"offsets": (0,), "shape": (4,)}, "must have 2 dims"),
        ({"array": "../evil", "offsets": (0, 0), "shape": (4, 3)}, "not allowed"),
        ({"array": "a/b", "offsets": (0, 0), "shape": (4, 3)}, "not allowed"),
        ({"dtype": "float64", "offsets": (0, 0), "shape": (4, 3)}, "float64"),
        ({"offsets": (0, 0), "shape": (8, 3), "stacked": True}, "stacked=True needs a `layers`"),
    ],
)
def test_bad_boxes_are_rejected_naming_the_array(kwargs, match):
    args = {"array": "w", "global_shape": (8, 3), "dtype": "float32"}
    args.update(kwargs)
    with pytest.raises(CheckpointError, match=match):
        ShardSpec(**args)


def test_an_empty_box_at_the_end_cannot_stand_in_for_a_missing_one(tmp_path):
    # Rows 0:4 of 8 written, plus an empty box at offset 8, which lies in no cell of the grid:
    # it was counted as one, so the missing rows 4:8 went unnoticed and the commit wrote a
    # manifest for a checkpoint that could not load. Such a box is refused when it is made,
    # when a fragment lists it anyway, and by `check_tiling` itself.
    root = str(tmp_path / "ckpt")
    save_id = begin_save(root, 1)
    writer = ShardWriter(root, 1, save_id, 0, 1)
    writer.write(ShardSpec("w", (8,), "float32", (0,), (4,)), torch.ones(4))
    record = writer.boxes[("w", "c/0")]
    writer.boxes[("w", "c/2")] = {
        **record,
        "offsets": [8],
        "shape": [0],
        "key": "c/2",
        "size": 0,
        "crc32": None,
    }  # a fragment that lists it anyway
    writer.finish()
    with pytest.raises(CheckpointError, match="at the end of the array"):
        commit(root, 1, save_id, 1, timeout=1)
    assert list_checkpoints(root) == []

    whole = ShardSpec("w", (8,), "float32", (0,), (4,))
    outside = ShardSpec("w", (8,), "float32", (4,), (4,), grid=(4,))
    object.__setattr__(outside, "offsets", (8,))  # past `validate`, as a future bug might be
    object.__setattr__(outside, "shape", (0,))
    with pytest.raises(CheckpointError, match=r"box \(8,\)\+\(0,\) lies outside its shard grid"):
        check_tiling(ArrayMeta.of(whole), [whole, outside])


def _step_1_committed_and_step_2_missing_writer_1(root) -> str:
    """Commits step 1 (tp=2), then stores writer 0's part of step 2; returns step 2's save id."""
    save_tp(root, 1, qkv_global(1), tp=2)
    save_id = begin_save(root, 2)
    writer = ShardWriter(root, 2, save_id, 0, 2)
    for spec, data in tp_boxes(qkv_global(2), 2)[0]:
        writer.write(spec, data)
    writer.finish()  # writer 1 never reports
    return save_id


def test_writer_that_never_reports_aborts_and_keeps_previous(root):
    save_id = _step_1_committed_and_step_2_missing_writer_1(root)
    with pytest.raises(CheckpointError, match=r"writers \[1\] did not report within 0.3 s"):
        commit(root, 2, save_id, 2, timeout=0.3)
    assert list_checkpoints(root) == [1]
    assert abort_save(root, 2) and not abort_save(root, 1)
    assert list_checkpoints(root) == [1]
    assert read_manifest(root, 1)["metadata"] == {"tp": 2}


def test_cancelled_commit_stops_waiting_for_a_missing_writer_but_commits_a_complete_save(root):
    """A failing run cancels its commit (`AsyncSaver.abandon`): a writer that has not reported
    (a dead rank) is not waited for, while a save whose fragments are all in still commits."""
    save_id = _step_1_committed_and_step_2_missing_writer_1(root)
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    with pytest.raises(
        CheckpointError, match=r"abandoned: writers \[1\] had not reported when the run failed"
    ):
        commit(
            root,
            2,
            save_id,
            2,
            timeout=60,
            cancelled=lambda: "the run failed" if cancel.is_set() else None,
        )
    assert list_checkpoints(root) == [1]
    save_id = begin_save(root, 3)
    for w, boxes in tp_boxes(qkv_global(3), 2).items():
        writer = ShardWriter(root, 3, save_id, w, 2)
        for spec, data in boxes:
            writer.write(spec, data)
        writer.finish()
    commit(
        root, 3, save_id, 2, timeout=60, cancelled=lambda: "the run failed"
    )  # every writer is in
    assert list_checkpoints(root) == [1, 3]


def test_writer_error_aborts_at_once(root):
    save_id = begin_save(root, 3)
    ShardWriter(root, 3, save_id, 0, 2).finish(error="disk full")
    with pytest.raises(CheckpointError, match="disk full"):
        commit(root, 3, save_id, 2, timeout=30)


def test_missing_or_truncated_object_aborts_the_commit(root):
    full = torch.ones(4, 3)
    save_id = begin_save(root, 4)
    writer = ShardWriter(root, 4, save_id, 0, 1)
    spec = ShardSpec("w", (4, 3), "float32", (0, 0), (4, 3))
    writer.write(spec, full)
    writer.finish()
    r = open_root(root)
    path = r.step_path(4) + "/w/c/0/0"
    r.fs.pipe_file(path, r.fs.cat_file(path)[:-3])
    with pytest.raises(CheckpointError, match="array 'w' object 'c/0/0' is .* bytes, its writer"):
        commit(root, 4, save_id, 1, timeout=1)


def test_writers_refuse_a_committed_step_and_bad_ids(root):
    save_tp(root, 6, qkv_global(), tp=1)
    with pytest.raises(CheckpointError, match="already committed"):
        ShardWriter(root, 6, "x", 0, 1).write(
            ShardSpec("w", (1,), "float32", (0,), (1,)), torch.ones(1)
        )
    for bad in ("../x", "a/b", "", "x" * 65):
        with pytest.raises(CheckpointError, match="save id"):
            ShardWriter(root, 7, bad, 0, 1)
    with pytest.raises(CheckpointError, match="writer_id 2 of num_writers 2"):
        ShardWriter(root, 7, "ok", 2, 2)


def test_stale_fragments_of_another_save_are_ignored(root):
    save_id = begin_save(root, 8)
    old = ShardWriter(root, 8, "crashed-attempt", 0, 1)
    old.write(ShardSpec("old", (2,), "float32", (0,), (2,)), torch.ones(2))
    old.finish()
    with pytest.raises(CheckpointError, match="did not report"):
        commit(root, 8, save_id, 1, timeout=0.1)
    writer = ShardWriter(root, 8, save_id, 0, 1)
    writer.write(ShardSpec("new", (2,), "float32", (0,), (2,)), torch.zeros(2))
    writer.finish()
    commit(root, 8, save_id, 1, timeout=1)
    assert list(read_manifest(root, 8)["arrays"]) == ["new"]
    r = open_root(root)
    assert not r.fs.exists(r.step_path(8) + "/old/c/0")  # leftovers removed after the commit


def test_read_box_errors(root):
    save_tp(root, 9, qkv_global(), tp=1)
    with pytest.raises(CheckpointError, match="no array 'nope'"):
        read_box(root, 9, "nope", (0,), (1,))
    with pytest.raises(CheckpointError, match="outside array"):
        read_box(root, 9, "layers.attention.qkv.weight", (0, 10, 0), (1, 4, COLS))
    with pytest.raises(CheckpointError, match="step 10 .*not a committed"):
        read_box(root, 10, "layers.attention.qkv.weight", (0, 0, 0), (1, 1, 1))


def test_inner_chunks_divide_the_shard(monkeypatch):
    monkeypatch.setattr(layout, "MAX_CHUNK_BYTES", 1000)
    for grid in [(1001, 7), (3, 500, 9), (1, 768, 1024), (97,)]:
        chunks = inner_chunks(grid, 4)
        assert all(g % c == 0 for g, c in zip(grid, chunks)), grid
        assert math.prod(chunks) * 4 <= 1000, (grid, chunks)
    assert inner_chunks((6, 5), 4) == (6, 5)  # small shards are one chunk
    assert inner_chunks((2, 0), 4) == (2, 1)  # zero-size dims still get positive chunks


@pytest.mark.parametrize(
    "dtype", ["bfloat16", "float32", "float16", "int64", "int32", "uint8", "bool"]
)
def test_single_chunk_fast_path_matches_zarr(dtype):
    """The hand-built shard must be byte-identical to what zarr writes for the same box."""
    torch_dtype = layout._DTYPES[dtype][0]
    data = (torch.randn(1, 6, 5) * 50).to(torch_dtype)
    spec = ShardSpec("layers.w", (3, 12, 5), dtype, (2, 6, 0), (1, 6, 5))
    stored = layout.to_stored(data)
    store = MemoryStore()
    ArrayMeta.of(spec).empty_array(store)[spec.slices()] = stored
    assert (
        b"".join(encode_box(spec, stored).parts)
        == store._store_dict[f"layers.w/{spec.key}"].to_bytes()
    )
