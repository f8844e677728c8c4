"""Context-parallel attention pieces: the block kernels with log-sum-exp against the reference
and SDPA, and `ContextAttention` on gloo ranks against one causal SDPA over the whole sequence
(output and every input gradient), for each communication scheme, cp 2 and 4, with GQA."""

import pytest
import torch
import torch.nn.functional as F

from meshtrain.kernels import attention_blocks as blocks
from meshtrain.kernels import reference
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.dataloader.loader import context_positions
from tests.dist_utils import run_ranks


def _qkv(b=2, h=4, g=2, s=32, d=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=gen, dtype=dtype) for n in (h, g, g)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_block_forward_and_backward_match_sdpa(causal, groups):
    q, k, v = _qkv(g=groups)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    for impl in ("auto", "math"):
        o, lse = blocks.attention_forward(q, k, v, causal, impl)
        torch.testing.assert_close(o, out.detach(), rtol=1e-5, atol=1e-5)
        r_o, r_lse = reference.attention_lse(q, k, v, causal)
        torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5)
        grads = blocks.attention_backward(dout, q, k, v, o, lse, causal, impl)
        for got, want in zip(grads, (t.grad for t in ref)):
            torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)


def test_blocks_merged_by_lse_equal_one_call_and_their_grads_add_up():
    """Keys split in two blocks: merged partial outputs equal one attention over all keys, and each
    block's backward with the final (out, lse) gives its exact share of dq and its keys' dk/dv."""
    q, k, v = _qkv(s=16)
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    for sl in (slice(0, 8), slice(8, 16)):
        blocks.merge(out, lse, *blocks.attention_forward(q, k[:, :, sl], v[:, :, sl], False))
    want_o, want_lse = reference.attention_lse(q, k, v, False)
    torch.testing.assert_close(out, want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    dout = torch.randn_like(out)
    parts = [
        blocks.attention_backward(dout, q, k[:, :, sl], v[:, :, sl], out, lse, False)
        for sl in (slice(0, 8), slice(8, 16))
    ]
    full = reference.attention_lse_backward(dout, q, k, v, want_o, want_lse, False)
    torch.testing.assert_close(parts[0][0] + parts[1][0], full[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch.cat([parts[0][1], parts[1][1]], 2), full[1], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        torch.cat([parts[0][2], parts[1][2]], 2), full[2], rtol=1e-5, atol=1e-5
    )


def _rank_attention(rank, world, comm_type, a2a, groups, tp_like_heads):
    from meshtrain.services.trainer.model.attention import CoreAttention
    from meshtrain.services.trainer.parallel.context import ContextAttention, ContextParallel
    from meshtrain.services.trainer.parallel.mesh import Mesh

    mesh = Mesh.build(cp=world, cp_a2a=a2a)
    cp = ContextParallel(mesh, comm_type)
    q, k, v = _qkv(h=tp_like_heads, g=groups, s=8 * world, seed=3)
    pos = torch.from_numpy(context_positions(q.shape[2], mesh.cp_rank, world))
    local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = ContextAttention(CoreAttention(0.0), cp)(*local)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))[:, :, pos]
    out.backward(dout)
    return {"pos": pos, "out": out.detach(), "grads": [t.grad for t in local]}


CASES = {  # name: (cp, comm type, all-to-all size, kv groups, heads)
    "p2p-cp2": (2, "p2p", 1, 2, 4),
    "p2p-cp4-gqa1": (4, "p2p", 1, 1, 4),
    "a2a-cp2": (2, "a2a", 2, 2, 4),
    "a2a-cp4-fewer-kv-heads": (4, "a2a", 4, 2, 4),
    "a2a-cp4-mha": (4, "a2a", 4, 4, 8),
    "a2a+p2p-cp4": (4, "a2a+p2p", 2, 2, 4),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_context_attention_equals_full_causal_attention(case):
    cp, comm, a2a, groups, heads = CASES[case]
    results = run_ranks(_rank_attention, cp, comm, a2a, groups, heads)
    q, k, v = _qkv(h=heads, g=groups, s=8 * cp, seed=3)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    out.backward(torch.randn(q.shape, generator=torch.Generator().manual_seed(9)))
    covered = torch.cat([r["pos"] for r in results]).sort().values
    assert torch.equal(covered, torch.arange(8 * cp))  # the ranks' chunks tile the sequence
    for r in results:
        pos = r["pos"]
        torch.testing.assert_close(r["out"], out.detach()[:, :, pos], rtol=1e-5, atol=1e-6)
        for got, want in zip(r["grads"], (t.grad for t in ref)):
            torch.testing.assert_close(got, want[:, :, pos], rtol=1e-5, atol=1e-6)


def test_context_core_refuses_attention_dropout():
    from meshtrain.services.trainer.model.attention import CoreAttention
    from meshtrain.services.trainer.parallel.context import ContextAttention

    with pytest.raises(ConfigError, match="attention_dropout"):
        ContextAttention(CoreAttention(0.1), cp=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_flash_blocks_on_cuda_match_the_fp32_reference(causal):
    """bf16 on CUDA runs PyTorch's flash ops (forward and the backward fed the final out/lse);
    within bf16 rounding of the fp32 reference, with GQA and unequal query/key lengths."""
    q, k, v = (t.cuda() for t in _qkv(b=2, h=8, g=2, s=256, d=64))
    if not causal:  # the ring passes strided slices: the second half of the queries, their lse
        q = q[:, :, 128:]
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    qb = torch.cat([qb, qb], dim=2)[:, :, qb.shape[2] :] if not causal else qb
    o, lse = blocks.attention_forward(qb, kb, vb, causal)
    r_o, r_lse = reference.attention_lse(q, k, v, causal)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(o.float(), r_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, r_lse, rtol=1e-2, atol=1e-2)
    dout = torch.randn_like(r_o)
    if not causal:
        lse = torch.cat([lse, lse], dim=2)[:, :, lse.shape[2] :]
        o = torch.cat([o, o], dim=2)[:, :, o.shape[2] :]
        assert not (lse.is_contiguous() or o.is_contiguous())
    got = blocks.attention_backward(dout.bfloat16(), qb, kb, vb, o, lse, causal)
    want = reference.attention_lse_backward(dout, q, k, v, r_o, r_lse, causal)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2, msg=name)


def _rank_mismatched_mesh(rank, world):
    from meshtrain.services.trainer.parallel.context import ContextParallel
    from meshtrain.services.trainer.parallel.mesh import Mesh

    mesh = Mesh.build(cp=world)  # laid out for the ring: no all-to-all group
    ContextParallel(mesh, "p2p")
    try:
        ContextParallel(mesh, "a2a")
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_a_comm_type_the_mesh_was_not_laid_out_for_is_refused():
    """A ring mesh asked for all-to-all would silently run the ring: refused, naming the fix."""
    messages = run_ranks(_rank_mismatched_mesh, 2)
    assert all(m and "cp_comm_type='a2a'" in m and "cp_a2a" in m for m in messages), messages


def test_initialize_model_parallel_refuses_a_hierarchy_that_does_not_multiply_to_cp():
    from meshtrain.services.trainer.parallel.mesh import initialize_model_parallel

    with pytest.raises(ConfigError, match="hierarchical_context_parallel_sizes"):
        initialize_model_parallel(
            context_parallel_size=4,
            cp_comm_type="a2a+p2p",
            hierarchical_context_parallel_sizes=[2, 3],
        )
