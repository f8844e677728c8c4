"""DataParallel's parameter all-gather with overlap (ZeRO-1): the order it is issued in, and what
each forward unit waits for. Loss and gradient equivalence is in test_equivalence.py."""

import pytest
import torch
import torch.distributed as dist

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel.data_parallel import DataParallel, forward_units
from meshtrain.services.trainer.parallel.mesh import Mesh
from tests.dist_utils import run_ranks

CFG = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=97,
    make_vocab_size_divisible_by=8,
    untie_embeddings_and_output_weights=True,
)


def _gathers(rank, world):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG))
    ddp = DataParallel(
        model,
        Mesh.build(),
        OptimConfig(lr=1e-3),
        distributed_optimizer=True,
        overlap_param_gather=True,
        bucket_size=6000,
        gather_units=forward_units(model),
    )
    issued = []
    real = dist.all_gather_single

    def recording(output, src, **kw):  # the real collective, with the order noted
        i = next(i for i, b in enumerate(ddp.buckets) if b.param_flat is output)
        n = output.numel() // world
        assert (
            src.data_ptr() == output[rank * n :].data_ptr() and src.numel() == n
        )  # in place: no copy
        issued.append(i)
        return real(output, src, **kw)

    dist.all_gather_single = recording
    try:
        tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(rank))
        model(tokens, tokens).backward()
        ddp.finish_grad_sync()
        ddp.optimizer.step()
        ddp.gather_params()
    finally:
        dist.all_gather_single = real
    embedding_buckets = {
        i
        for i, b in enumerate(ddp.buckets)
        if any(p is q for p in b.params for q in model.embedding.parameters())
    }
    model.embedding(tokens)  # its pre-hook waits for its own buckets only
    pending_after_embedding = {i for i, b in enumerate(ddp.buckets) if b.gather_handle is not None}
    model(tokens, tokens)  # every unit has waited by the end of a forward
    pending_after_forward = {i for i, b in enumerate(ddp.buckets) if b.gather_handle is not None}
    return (
        len(ddp.buckets),
        issued,
        embedding_buckets,
        pending_after_embedding,
        pending_after_forward,
    )


@pytest.mark.dist
def test_param_gathers_go_in_forward_order_and_the_embedding_waits_only_for_its_own():
    for n, issued, embedding_buckets, pending, pending_after_forward in run_ranks(_gathers, 2):
        assert n >= 4
        assert issued == list(reversed(range(n)))  # buckets are in backward order
        assert embedding_buckets == {n - 1}
        assert pending == set(range(n - 1))  # the blocks' and the head's gathers still in flight
        assert pending_after_forward == set()


def test_forward_units_cover_every_parameter_once_in_forward_order():
    model = GPT(ModelConfig(**CFG))
    units = forward_units(model)
    assert [m for m, _ in units] == [model.embedding, *model.layers, model.final_norm]
    covered = [p for _, params in units for p in params]
    assert len(covered) == len({id(p) for p in covered}) == len(list(model.parameters()))
    assert any(p is model.output_layer.weight for p in units[-1][1])


def test_a_parameter_that_is_not_fp32_is_refused_by_name():
    from meshtrain.services.common.errors import ConfigError

    model = GPT(ModelConfig(**CFG))
    model.final_norm.weight.data = model.final_norm.weight.data.bfloat16()
    with pytest.raises(ConfigError, match=r"final_norm.weight is torch.bfloat16"):
        DataParallel(model, Mesh(), OptimConfig(lr=1e-3), distributed_optimizer=True)


def _global_norm(rank, world, dist_opt, max_norm):
    from meshtrain.services.trainer.parallel.tensor import parallelize

    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG, normalization="rmsnorm", num_query_groups=2))
    mesh = Mesh.build(tp=2)
    parallelize(model, mesh, sequence_parallel=True)
    ddp = DataParallel(
        model, mesh, OptimConfig(lr=1e-3), distributed_optimizer=dist_opt, bucket_size=6000
    )
    tokens = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(1))
    mine = tokens[2 * mesh.dp_rank : 2 * mesh.dp_rank + 2]  # this dp rank's half of the batch
    model(mine, mine).backward()
    ddp.finish_grad_sync()
    norm = ddp.grad_norm_and_clip(max_norm)
    grads = (
        [piece.grad for piece, *_ in ddp.pieces]
        if dist_opt
        else [p.grad for p in model.parameters()]
    )
    return norm.item(), [g.clone() for g in grads]


@pytest.mark.dist
@pytest.mark.parametrize("dist_opt", [False, True], ids=["dp", "zero1"])
def test_gradient_norm_over_tp_and_dp_is_the_unsharded_norm_and_clipping_scales_by_it(dist_opt):
    """tp=2 (with sequence parallelism: replicated norm weights count once) x dp=2."""
    torch.manual_seed(0)
    ref = GPT(ModelConfig(**CFG, normalization="rmsnorm", num_query_groups=2))
    tokens = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(1))
    ref(tokens, tokens).backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])).item()
    unclipped = run_ranks(_global_norm, 4, dist_opt, 0.0)
    clipped = run_ranks(_global_norm, 4, dist_opt, want / 4)
    for (norm, grads), (norm_c, grads_c) in zip(unclipped, clipped):
        assert norm == pytest.approx(want, rel=1e-5) and norm_c == pytest.approx(want, rel=1e-5)
        for g, g_c in zip(grads, grads_c):
            torch.testing.assert_close(g_c, g / 4, rtol=1e-4, atol=1e-9)


def _reduced(rank, world, dist_opt, dtype, overlap=False):
    """(dtypes the collectives sent, this rank's own gradients, the reduced mean) in full-buffer
    coordinates; under ZeRO-1 only this rank's slice of each bucket is reduced (NaN elsewhere)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG))
    ddp = DataParallel(
        model,
        Mesh.build(),
        OptimConfig(lr=1e-3),
        distributed_optimizer=dist_opt,
        overlap_grad_reduce=overlap,
        bucket_size=6000,
        reduce_dtype=dtype,
    )
    sent = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}

    def recording(name):
        def call(*args, **kw):
            sent.append((args[1] if name == "reduce_scatter_single" else args[0]).dtype)
            return real[name](*args, **kw)

        return call

    for name in real:
        setattr(dist, name, recording(name))
    try:
        tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(rank))
        model(tokens, tokens).backward()
        own = [b.grad.clone() for b in ddp.buckets]  # before any reduction (when not overlapped)
        ddp.finish_grad_sync()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    reduced = []
    for b in ddp.buckets:
        if dist_opt:
            full = torch.full((b.numel,), float("nan"))
            k = b.numel // world
            full[rank * k : (rank + 1) * k] = b.local_grad
            reduced.append(full)
        else:
            reduced.append(b.grad.clone())
    return set(sent), torch.cat(own), torch.cat(reduced), [b.wire for b in ddp.buckets]


@pytest.mark.dist
@pytest.mark.parametrize("overlap", [False, True], ids=["after-backward", "overlapped"])
@pytest.mark.parametrize("dist_opt", [False, True], ids=["dp", "zero1"])
def test_bf16_gradient_reduction_sends_bf16_and_stays_within_its_rounding(dist_opt, overlap):
    """grad_reduce_dtype='bf16': the collectives move bf16 (half the bytes), and the fp32 result
    differs from the fp32 reduction by no more than bf16's rounding of the addends and the sum
    (launched after backward, or from the gradient hooks during it)."""
    fp32 = run_ranks(_reduced, 2, dist_opt, torch.float32)  # its own gradients are pre-reduction
    bf16 = run_ranks(_reduced, 2, dist_opt, torch.bfloat16, overlap)
    magnitude = (
        fp32[0][1].abs() + fp32[1][1].abs()
    ) / 2  # the two ranks' contributions to the mean
    for (sent32, own, exact, _), (sent16, _, rounded, wires) in zip(fp32, bf16):
        assert sent32 == {torch.float32} and sent16 == {torch.bfloat16}
        assert all(w is None for w in wires)  # no wire buffer left behind
        mine = ~exact.isnan()
        assert mine.sum() == (exact.numel() // 2 if dist_opt else exact.numel())
        exact, rounded, bound = exact[mine], rounded[mine], magnitude[mine]
        torch.testing.assert_close(exact, (fp32[0][1] + fp32[1][1])[mine] / 2, rtol=1e-6, atol=1e-9)
        assert not torch.equal(rounded, exact)  # rounded: a bf16 path, not the fp32 one
        # each addend and the sum rounded once to bf16 (8 significant bits: at most 2^-8 relative
        # each), so within about 2^-7 of the addends' mean magnitude; the worst case is near it
        assert ((rounded - exact).abs() <= 2**-7 * (1 + 2**-7) * bound + 1e-12).all()
