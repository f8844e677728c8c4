"""The Mesh on torch's DeviceMesh: its dims hold the same ranks as the Mesh's own groups."""

import pytest

from meshtrain.services.trainer.parallel.mesh import DEVICE_MESH_DIMS, Mesh
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.dist


def _rank_mesh(rank, world, layout):
    mesh = Mesh.build(**layout)
    dm = mesh.device_mesh
    out = {
        "dims": dm.mesh_dim_names,
        "shape": tuple(dm.shape),
        "groups": {d: _dim_ranks(dm, d) for d in DEVICE_MESH_DIMS},
        "mine": {d: mesh.ranks[d] for d in ("tp", "cp", "pp", "dp_shard", "dp_replicate")},
        "coords": (mesh.dp_shard_rank, mesh.dp_replicate_rank, mesh.dp_rank),
        "same_tp_group": dm.get_group("tp") is mesh.group("tp"),
    }
    if mesh.expert_device_mesh is not None:
        em = mesh.expert_device_mesh
        out["ep"] = (
            _dim_ranks(em, "ep"),
            mesh.ranks["ep"],
            _dim_ranks(em, "edp"),
            mesh.ranks["edp"],
        )
    return out


def _dim_ranks(dm, dim):
    """The ranks of this rank's group along `dim` (from the DeviceMesh's own rank layout)."""
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(dm.get_group(dim)))


def test_device_mesh_dims_are_the_mesh_groups_with_hybrid_dp():
    results = run_ranks(_rank_mesh, 8, {"tp": 2, "dp_replicate": 2})
    for rank, r in enumerate(results):
        assert r["dims"] == DEVICE_MESH_DIMS
        assert r["shape"] == (1, 2, 2, 1, 2)
        assert r["same_tp_group"]
        for d in ("tp", "cp", "pp", "dp_shard", "dp_replicate"):
            assert r["groups"][d] == r["mine"][d], (rank, d)
        dp_rank = rank // 2  # tp fastest
        assert r["coords"] == (dp_rank % 2, dp_rank // 2, dp_rank)
    assert results[0]["mine"]["dp_shard"] == [0, 2]  # consecutive dp ranks share a replica
    assert results[0]["mine"]["dp_replicate"] == [0, 4]


def test_expert_device_mesh_folds_ep_out_of_dp():
    results = run_ranks(_rank_mesh, 4, {"dp": 4, "ep": 2})
    for r in results:
        ep_dm, ep_mesh, edp_dm, edp_mesh = r["ep"]
        assert ep_dm == ep_mesh and edp_dm == edp_mesh
    assert results[0]["ep"][1] == [0, 1] and results[0]["ep"][3] == [0, 2]


def _rank_bad(rank, world):
    Mesh.build(dp_replicate=3)


def test_dp_replicate_must_divide_dp():
    with pytest.raises(Exception, match="dp_replicate=3 must divide"):
        run_ranks(_rank_bad, 2)
