"""Tensor-name -> array mapping, stacking decisions, dtypes and chunk/shard shapes."""

import numpy as np
import pytest
import torch

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.layout import ArraySpec, array_key, group_tensors
from meshtrain.services.common.errors import CheckpointError


@pytest.mark.parametrize(
    "name, expected",
    [
        ("layers.3.attention.qkv.weight", ("layers.attention.qkv.weight", 3)),
        (
            "optim.exp_avg.layers.3.attention.qkv.weight",
            ("optim.exp_avg.layers.attention.qkv.weight", 3),
        ),
        ("decoder.layers.12.mlp.fc1.bias", ("decoder.layers.mlp.fc1.bias", 12)),
        # only the first layers.<int> component is the layer (experts keep their number)
        ("layers.1.mlp.experts.layers.2.w", ("layers.mlp.experts.layers.2.w", 1)),
        ("embedding.weight", ("embedding.weight", None)),
        ("layers.3", ("layers.3", None)),  # nothing after the number: not a layer tensor
        ("layers.x.w", ("layers.x.w", None)),
        ("mylayers.3.w", ("mylayers.3.w", None)),
    ],
)
def test_array_key(name, expected):
    assert array_key(name) == expected


def test_group_tensors_stacks_same_shaped_layers():
    names = [(f"layers.{i}.w", (3, 2), "bfloat16") for i in (2, 0, 3, 1)]
    names.append(("embedding.weight", (5, 2), "float32"))
    specs = group_tensors(names)
    assert list(specs) == ["embedding.weight", "layers.w"]
    stacked = specs["layers.w"]
    assert stacked == ArraySpec(
        "layers.w", (4, 3, 2), "bfloat16", 4, tuple(f"layers.{i}.w" for i in range(4))
    )
    assert stacked.tensor_shape == (3, 2)
    assert stacked.stored_dtype == np.uint16
    assert specs["embedding.weight"].layer_count is None


@pytest.mark.parametrize(
    "members",
    [
        [("layers.0.w", (3,), "float32"), ("layers.1.w", (4,), "float32")],  # shapes differ
        [("layers.0.w", (3,), "float32"), ("layers.1.w", (3,), "float16")],  # dtypes differ
        [("layers.0.w", (3,), "float32"), ("layers.2.w", (3,), "float32")],  # a layer missing
        [("layers.w", (3,), "float32"), ("layers.0.w", (3,), "float32")],  # plain name shares key
    ],
)
def test_group_tensors_falls_back_to_one_array_per_tensor(members):
    specs = group_tensors(members)
    assert sorted(specs) == sorted(m[0] for m in members)
    assert all(s.layer_count is None and s.tensors == (s.name,) for s in specs.values())


def test_group_tensors_rejects_bad_input():
    with pytest.raises(CheckpointError, match="'a/b'"):
        group_tensors([("a/b", (1,), "float32")])
    with pytest.raises(CheckpointError, match="'__x'"):
        group_tensors([("__x", (1,), "float32")])
    # a step's "_fragments" folder is the writers' scratch, removed by the commit
    with pytest.raises(CheckpointError, match="'_fragments'"):
        group_tensors([("_fragments", (1,), "float32")])
    from meshtrain.services.checkpoint.boxes import ShardSpec

    with pytest.raises(CheckpointError, match="'_fragments'"):
        ShardSpec("_fragments", (4,), "float32", (0,), (4,))
    with pytest.raises(CheckpointError, match="float64"):
        group_tensors([("w", (1,), "float64")])
    with pytest.raises(CheckpointError, match="listed twice"):
        group_tensors([("w", (1,), "float32"), ("w", (1,), "float32")])


def test_group_tensors_rejects_name_collision():
    # A plain name sharing a stacked key makes the group fall back, so no collision there.
    tensors = [(f"layers.{i}.x", (2,), "float32") for i in range(2)]
    tensors.append(("layers.x", (2,), "float32"))
    assert sorted(group_tensors(tensors)) == ["layers.0.x", "layers.1.x", "layers.x"]
    # A real one: the stacked array's name equals a lone tensor's name (its own layer 5
    # cannot stack, so it keeps its full name). Silently merging them would lose data.
    stacked = [(f"a.layers.{i}.b.layers.5.c", (2,), "float32") for i in range(2)]
    lone = [("a.layers.b.layers.5.c", (3,), "float32")]
    with pytest.raises(CheckpointError, match="a.layers.b.layers.5.c"):
        group_tensors(stacked + lone)


def test_dtype_conversion_is_bit_exact():
    bits = torch.tensor([0, 1, 0x7F80, 0x7FC1, 0x8000, 0xFF80, 0x3F80], dtype=torch.int32)
    bf16 = bits.to(torch.int16).view(torch.bfloat16)  # includes inf, a NaN payload, -0
    stored = layout.to_stored(bf16)
    assert stored.dtype == np.uint16
    back = layout.from_stored(stored, "bfloat16")
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), bf16.view(torch.int16))
    scalar = layout.from_stored(np.asarray(np.int64(5)), "int64")
    assert scalar.shape == () and scalar.item() == 5
    with pytest.raises(CheckpointError, match="complex64"):
        layout.dtype_name(torch.complex64)
