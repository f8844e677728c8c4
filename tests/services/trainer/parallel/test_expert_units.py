"""Expert parallelism's parts: the mesh's ep/edp layout, the all-to-all dispatcher, slicing the
experts (in either order with tensor parallelism), and what parallelize_experts refuses.

Training equivalence with one process is in test_expert.py.
"""

import pytest
import torch
import torch.distributed as dist

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.model.moe import LocalDispatcher, moe_layers
from meshtrain.services.trainer.parallel.expert import (
    AllToAllDispatcher,
    expert_major_order,
    parallelize_experts,
)
from meshtrain.services.trainer.parallel.mesh import Mesh, initialize_model_parallel
from meshtrain.services.trainer.parallel.tensor import parallelize
from meshtrain.services.trainer.parallel.tensor_layers import TPSplit, tp_split_of
from tests.dist_utils import run_ranks

CFG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=97,
    make_vocab_size_divisible_by=8,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    num_experts=4,
    moe_ffn_hidden_size=16,
    moe_layer_freq=[1, 0],
    moe_shared_expert_intermediate_size=32,
)


def _layout(monkeypatch, world: int, **degrees) -> list[Mesh]:
    """Every rank's Mesh.build of a `world`-rank job, without processes:
    new_group returns the ranks."""
    meshes = []
    for rank in range(world):
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: tuple(ranks))
        meshes.append(Mesh.build(**degrees))
    return meshes


def test_ep_groups_are_consecutive_ranks_of_a_dp_cp_group_and_edp_the_ranks_with_the_same_experts(
    monkeypatch,
):
    meshes = _layout(monkeypatch, 8, tp=2, ep=2)  # dp = 4
    assert [m.ranks["ep"] for m in meshes] == [
        [0, 2],
        [1, 3],
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [4, 6],
        [5, 7],
    ]
    assert [m.ranks["edp"] for m in meshes] == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert [m.ep_rank for m in meshes] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [m.edp_rank for m in meshes] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(m.group("ep") == tuple(m.ranks["ep"]) for m in meshes)
    # cp is the fastest axis inside a dp x cp group: an ep pair is the two cp ranks of one dp rank
    meshes = _layout(monkeypatch, 8, cp=2, ep=4)  # dp = 4, cp = 2: the ep groups span cp and dp
    assert [m.ranks["ep"] for m in meshes] == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    assert [m.ranks["edp"] for m in meshes] == [[0, 4], [1, 5], [2, 6], [3, 7]] * 2
    meshes = _layout(monkeypatch, 4, ep=1)  # ep 1: edp is the whole dp group
    assert all(m.ranks["edp"] == [0, 1, 2, 3] and m.ranks["ep"] == [m.rank] for m in meshes)


def test_an_expert_degree_that_does_not_divide_dp_cp_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"parallel.ep=2 must divide dp\*cp = 1"):
        initialize_model_parallel(expert_model_parallel_size=2)
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide dp\*cp = 2"):
        _layout(monkeypatch, 4, tp=2, ep=4)


def _expert_major_loop(recv_counts: torch.Tensor) -> list[int]:
    """The reference: received row indices visited expert by expert, source by source."""
    ep, n = recv_counts.shape
    starts, off = {}, 0
    for s in range(ep):
        for e in range(n):
            starts[s, e] = off
            off += int(recv_counts[s, e])
    return [
        starts[s, e] + i for e in range(n) for s in range(ep) for i in range(int(recv_counts[s, e]))
    ]


@pytest.mark.parametrize("shape,seed", [((2, 2), 0), ((4, 2), 1), ((3, 5), 2), ((1, 3), 3)])
def test_expert_major_order_is_the_per_expert_loop(shape, seed):
    counts = torch.randint(0, 4, shape, generator=torch.Generator().manual_seed(seed))
    counts[0, 0] = 0  # empty blocks are the usual case at small batches
    order = expert_major_order(counts, int(counts.sum()))
    assert order.tolist() == _expert_major_loop(counts)


def _dispatch_round_trip(rank, world):
    group = dist.group.WORLD
    experts = 6
    g = torch.Generator().manual_seed(rank)
    counts = torch.randint(0, 3, (experts,), generator=g)
    counts[rank] = 0  # some expert gets nothing from this rank
    # row r of this rank carries (source rank, global expert, index within the expert)
    expert_of = torch.repeat_interleave(torch.arange(experts), counts)
    index = (
        torch.cat([torch.arange(int(c)) for c in counts])
        if counts.sum()
        else torch.zeros(0, dtype=torch.long)
    )
    rows = (
        torch.stack([torch.full_like(expert_of, rank), expert_of, index], 1)
        .double()
        .requires_grad_()
    )
    d = AllToAllDispatcher(group, world, experts)
    got, local_counts = d.dispatch(rows, counts)
    everyone = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(everyone, counts)
    back = d.combine(got * 2.0)
    weights = torch.randn(back.shape, generator=g, dtype=torch.float64)
    (back * weights).sum().backward()
    return (
        got.detach(),
        local_counts,
        torch.stack(everyone),
        back.detach(),
        rows.detach(),
        rows.grad,
        weights,
    )


@pytest.mark.dist
def test_dispatch_sends_rows_to_their_experts_in_expert_major_order_and_combine_brings_them_back():
    world, experts = 2, 6
    local = experts // world
    for rank, (got, local_counts, everyone, back, rows, grad, weights) in enumerate(
        run_ranks(_dispatch_round_trip, world)
    ):
        mine = range(rank * local, (rank + 1) * local)
        assert local_counts.tolist() == [int(everyone[:, e].sum()) for e in mine]
        expected = [
            (s, e, i) for e in mine for s in range(world) for i in range(int(everyone[s, e]))
        ]
        assert [tuple(int(v) for v in r) for r in got] == expected
        torch.testing.assert_close(back, rows * 2.0)  # every row home, in its place
        torch.testing.assert_close(grad, weights * 2.0)  # the backward is the reverse exchange


def _sliced(mesh: Mesh, experts_first: bool) -> dict:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG))
    if experts_first:
        parallelize(parallelize_experts(model, mesh), mesh)
    else:
        parallelize_experts(parallelize(model, mesh), mesh)
    return {
        n: (
            p.detach().clone(),
            tp_split_of(p),
            getattr(p, "expert_shard", None),
            getattr(p, "sequence_parallel", False),
        )
        for n, p in model.named_parameters()
        if ".mlp." in n
    }


@pytest.mark.parametrize("tp_rank,ep_rank", [(0, 0), (1, 1), (0, 1)])
def test_experts_are_sliced_from_the_full_weights_in_either_order_with_tensor_parallelism(
    tp_rank, ep_rank
):
    """tp=2 x dp=2 x ep=2 on 4 ranks, without processes (slicing communicates nothing)."""
    rank = tp_rank + 2 * ep_rank
    mesh = Mesh(
        tp=2,
        dp=2,
        ep=2,
        rank=rank,
        ranks={
            "tp": [rank - tp_rank, rank - tp_rank + 1],
            "ep": [tp_rank, tp_rank + 2],
            "dp_cp": [tp_rank, tp_rank + 2],
        },
    )
    a, b = _sliced(mesh, True), _sliced(mesh, False)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name][0], b[name][0]) and a[name][1:] == b[name][1:], name
    torch.manual_seed(0)
    full = GPT(ModelConfig(**CFG)).layers[0].mlp
    fc1, shard, _, _ = a["layers.0.mlp.experts.fc1.weight"]
    assert shard == TPSplit(1, halves=True) and a["layers.0.mlp.experts.fc1.weight"][2] == (
        2 * ep_rank,
        4,
    )
    assert torch.equal(
        fc1,
        TPSplit(1, halves=True).shard(
            full.experts.fc1.weight[2 * ep_rank : 2 * ep_rank + 2], tp_rank, 2
        ),
    )
    fc2 = a["layers.0.mlp.experts.fc2.weight"]
    assert fc2[1] == TPSplit(2) and fc2[2] == (2 * ep_rank, 4)
    assert torch.equal(
        fc2[0], full.experts.fc2.weight[2 * ep_rank : 2 * ep_rank + 2].chunk(2, 2)[tp_rank]
    )
    router = a["layers.0.mlp.router.weight"]
    assert (
        torch.equal(router[0], full.router.weight) and router[3]
    )  # replicated; gradient summed over tp
    assert a["layers.0.mlp.shared_expert.fc1.weight"][1] == TPSplit(0, halves=True)


def test_at_ep_1_the_experts_stay_whole_and_local():
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG))
    parallelize_experts(model, Mesh.single())
    ((_, moe),) = moe_layers(model)
    assert moe.experts.num_local == 4 and isinstance(moe.dispatcher, LocalDispatcher)
    assert moe.stats_group is None and moe.aux_share_scale == 1.0
    assert all(getattr(p, "expert_shard", None) is None for p in model.parameters())


def test_parallelize_experts_refuses_what_it_cannot_split():
    def mesh(ep, cp=1):
        return Mesh(
            dp=ep,
            cp=cp,
            ep=ep,
            rank=0,
            ranks={"ep": list(range(ep)), "dp_cp": list(range(ep * cp))},
        )

    with pytest.raises(ConfigError, match=r"parallel.ep=3 must divide model.num_experts=4"):
        parallelize_experts(GPT(ModelConfig(**CFG)), mesh(3))
    with pytest.raises(
        ConfigError, match="parallel.ep=2 splits experts, but the model has no MoE blocks"
    ):
        parallelize_experts(GPT(ModelConfig(**dict(CFG, num_experts=None))), mesh(2))
    with pytest.raises(
        ConfigError, match="moe_expert_capacity_factor counts capacity per sequence"
    ):
        parallelize_experts(
            GPT(ModelConfig(**dict(CFG, moe_expert_capacity_factor=1.0))), mesh(1, cp=2)
        )
    model = parallelize_experts(GPT(ModelConfig(**CFG)), mesh(2))
    with pytest.raises(ConfigError, match="split over ep already"):
        parallelize_experts(model, mesh(2))
