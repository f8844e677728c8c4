"""Each pair of communication regions is checked by its adjoint property, on real gloo ranks.

For a linear map A with adjoint A*, <A x, y> = <x, A* y> for all x, y. Each region's backward
must be the adjoint of its forward *as the surrounding code uses it*: inner products of
sharded tensors are summed over ranks, of replicated tensors counted once. Tolerance: fp64, so
only summation order differs (1e-12).
"""

import pytest
import torch
import torch.distributed as dist

from meshtrain.services.trainer.parallel import mappings as M
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.dist


def _sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def _adjoint_checks(rank, world):
    g = dist.group.WORLD
    torch.manual_seed(100 + rank)  # rank-local random data
    results = {}
    # Forward maps from a "local" input space to an output space; inner products over the
    # distributed spaces: sharded -> sum over ranks; replicated -> one copy.
    cases = {
        # (function, input is replicated?, output is replicated?, input shape)
        "copy_to_region": (M.copy_to_region, True, False, (2, 4, 8)),
        "reduce_from_region": (M.reduce_from_region, False, True, (2, 4, 8)),
        "scatter_to_region": (M.scatter_to_region, True, False, (2, 4, 8)),
        "gather_from_region": (M.gather_from_region, False, True, (2, 4, 3)),
        "scatter_to_sequence": (M.scatter_to_sequence, True, False, (2, 4, 8)),
        "gather_from_sequence": (M.gather_from_sequence, False, False, (2, 2, 6)),
        "reduce_scatter_to_sequence": (M.reduce_scatter_to_sequence, False, False, (2, 4, 8)),
        "all_to_all": (M.all_to_all, False, False, (4, 3)),  # even: a block of rows per rank
    }
    # uneven, as experts send: rank r and rank j swap (r + j) % 3 + 1 rows each way
    splits = [(rank + j) % 3 + 1 for j in range(world)]
    cases["all_to_all_uneven"] = (
        lambda x, g: M.all_to_all(x, g, splits, splits),
        False,
        False,
        (sum(splits), 3),
    )
    for name, (fn, in_rep, out_rep, shape) in cases.items():
        x = torch.randn(shape, dtype=torch.float64)
        if in_rep:
            dist.broadcast(x, 0)
        x.requires_grad_(True)
        y = fn(x, g)
        w = torch.randn(y.shape, dtype=torch.float64)
        if out_rep:
            dist.broadcast(w, 0)
        # <A x, w>: replicated output counted once, sharded output summed over ranks
        lhs = (y * w).sum()
        lhs = lhs.detach() if out_rep else _sum_over_ranks(lhs.detach())
        # <x, A* w>: the gradient of <A x, w> as the code computes it
        (y * w).sum().backward()
        rhs = (x.detach() * x.grad).sum()
        rhs = rhs if in_rep else _sum_over_ranks(rhs)
        results[name] = (lhs.item(), rhs.item())
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_regions_are_adjoint_pairs(world):
    results = run_ranks(_adjoint_checks, world)
    for name, (lhs, rhs) in results[0].items():
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12), name
    # forward semantics on top of adjointness
    for r in results[1:]:
        assert r.keys() == results[0].keys()


def _forward_semantics(rank, world):
    g = dist.group.WORLD
    x = torch.arange(2 * 4 * 6, dtype=torch.float64).view(2, 4, 6) + 1000 * rank
    out = {
        "reduce": M.reduce_from_region(x, g),
        "gather_last": M.gather_from_region(x, g),
        "gather_seq": M.gather_from_sequence(x, g),
        "scatter_seq": M.scatter_to_sequence(x, g),
        "rs_seq": M.reduce_scatter_to_sequence(x, g),
    }
    return {k: v.detach() for k, v in out.items()}


def test_forward_semantics():
    world = 2
    res = run_ranks(_forward_semantics, world)
    xs = [torch.arange(48, dtype=torch.float64).view(2, 4, 6) + 1000 * r for r in range(world)]
    total = sum(xs)
    for r in range(world):
        torch.testing.assert_close(res[r]["reduce"], total)
        torch.testing.assert_close(res[r]["gather_last"], torch.cat(xs, -1))
        torch.testing.assert_close(res[r]["gather_seq"], torch.cat(xs, 1))
        torch.testing.assert_close(res[r]["scatter_seq"], xs[r].chunk(world, 1)[r])
        torch.testing.assert_close(res[r]["rs_seq"], total.chunk(world, 1)[r])


def _collective_warnings(rank, world):
    import warnings

    x = torch.ones(world * 2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        M.all_gather(x, 0, dist.group.WORLD)
        M.reduce_scatter(x, 0, dist.group.WORLD)
    return [str(w.message) for w in caught]


def test_gather_and_reduce_scatter_use_collectives_torch_does_not_deprecate():
    # Reproduced: all_gather_into_tensor and reduce_scatter_tensor warned FutureWarning on
    # every rank of every tensor-parallel run (torch 2.13 names their _single successors).
    assert run_ranks(_collective_warnings, 2) == [[], []]
