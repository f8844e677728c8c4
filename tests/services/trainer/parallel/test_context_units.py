"""Context-parallel attention pieces: the block kernels with log-sum-exp against the reference
and SDPA, and `ContextAttention` on gloo ranks against one causal SDPA over the whole sequence
(output and every input gradient), for each communication scheme, cp 2 and 4, with GQA; with
packed documents against attention within documents over the whole sequence."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtrain.kernels import attention_blocks as blocks
from meshtrain.kernels import reference
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


def _doc_ids(s: int) -> torch.Tensor:
    """(2, s) packed-document ids for a sequence of s = 8·cp tokens, chunks of 4: row 0 opens
    with a one-token document, then one spanning three chunks, then short ones crossing chunk
    boundaries; in row 1 the first chunk is exactly one document."""
    rows = []
    for lengths in ([1, 10, 2, 3, 5, 1, 7, 6, 9], [4, 3, 6, 3, 9, 2, 5, 8, 4]):
        ids = np.repeat(np.arange(len(lengths)), lengths)
        assert len(ids) >= s
        rows.append(ids[:s])
    return torch.from_numpy(np.stack(rows)).to(torch.int32)


def _rank_attention(rank, world, comm_type, a2a, groups, tp_like_heads, packed=False):
    from meshtrain.services.trainer.model.attention import CoreAttention, Documents
    from meshtrain.services.trainer.parallel.context import ContextAttention, ContextParallel
    from meshtrain.services.trainer.parallel.mesh import Mesh

    mesh = Mesh.build(cp=world, cp_a2a=a2a)
    cp = ContextParallel(mesh, comm_type)
    q, k, v = _qkv(h=tp_like_heads, g=groups, s=8 * world, seed=3)
    pos = torch.from_numpy(context_positions(q.shape[2], mesh.cp_rank, world))
    docs = Documents(_doc_ids(q.shape[2])[:, pos]) if packed else None
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))[:, :, pos]
    # with documents under a ring: both ways of running its blocks (the mask, the pieces)
    ways = ("mask", "segments") if packed and cp.ring > 1 else ("auto",)
    runs = {}
    for way in ways:
        local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        core = ContextAttention(CoreAttention(0.0), cp)
        core.document_blocks = way
        out = core(*local) if docs is None else core(*local, docs)
        out.backward(dout)
        runs[way] = {"out": out.detach(), "grads": [t.grad for t in local]}
    return {"pos": pos, "runs": runs}


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
    _check_ranks(results, cp, out, ref)


def _check_ranks(results, cp, out, ref):
    covered = torch.cat([r["pos"] for r in results]).sort().values
    assert torch.equal(covered, torch.arange(8 * cp))  # the ranks' chunks tile the sequence
    for r in results:
        pos = r["pos"]
        for way, run in r["runs"].items():
            torch.testing.assert_close(
                run["out"], out.detach()[:, :, pos], rtol=1e-5, atol=1e-6, msg=way
            )
            for got, want in zip(run["grads"], (t.grad for t in ref)):
                torch.testing.assert_close(got, want[:, :, pos], rtol=1e-5, atol=1e-6, msg=way)


PACKED_CASES = {name: CASES[name] for name in ("p2p-cp2", "p2p-cp4-gqa1", "a2a-cp2", "a2a+p2p-cp4")}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_context_attention_within_packed_documents_equals_one_process(case):
    """Documents crossing chunk boundaries, one spanning three chunks, a one-token one, one
    filling the first chunk; the ring ranks hold blocks some of whose queries (and whole steps)
    see no key: output and gradients equal attention within documents on one process."""
    from meshtrain.services.trainer.model.attention import Documents, document_attention

    cp, comm, a2a, groups, heads = PACKED_CASES[case]
    results = run_ranks(_rank_attention, cp, comm, a2a, groups, heads, True)
    q, k, v = _qkv(h=heads, g=groups, s=8 * cp, seed=3)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = document_attention(*ref, Documents(_doc_ids(8 * cp)))
    out.backward(torch.randn(q.shape, generator=torch.Generator().manual_seed(9)))
    _check_ranks(results, cp, out, ref)
    if comm != "a2a":
        assert all(set(r["runs"]) == {"mask", "segments"} for r in results)


@pytest.mark.parametrize("ring_rank", range(4))
def test_ring_document_pieces_cover_exactly_the_masked_block(ring_rank):
    """The dense pieces of each ring step (`_segments`) cover exactly the keys the boolean mask
    lets each query see (causal in the own block), and a step no query of which shares a
    document with a key has none."""
    from meshtrain.services.trainer.parallel.context import _block, _segments

    ring, half = 4, 5
    s = 2 * ring * half
    rng = np.random.default_rng(ring_rank)
    ids = np.stack([np.cumsum(rng.random(s) < p) for p in (0.3, 0.05, 0.6)])  # (3, s)
    pos = [context_positions(s, r, ring) for r in range(ring)]
    every = np.stack([ids[:, p] for p in pos])  # (ring, b, 2·half)
    cp = SimpleNamespace(ring=ring, ring_rank=ring_rank, comm_type="p2p")
    steps = _segments(cp, every)
    for step, pieces in enumerate(steps):
        qs, ks, causal = _block(cp, step, half)
        src = (ring_rank - step) % ring
        want = np.zeros((3, 2 * half, 2 * half), dtype=bool)
        q_pos, k_pos = pos[ring_rank][qs], pos[src][ks]
        rows = np.arange(2 * half)[qs][:, None]
        cols = np.arange(2 * half)[ks][None, :]
        for b in range(3):
            same = ids[b, q_pos][:, None] == ids[b, k_pos][None, :]
            want[b, rows, cols] = same & (q_pos[:, None] >= k_pos[None, :])
        got = np.zeros_like(want)
        for r, q, k in pieces:
            block = np.ones((q.stop - q.start, k.stop - k.start), dtype=bool)
            got[r, q, k] |= np.tril(block) if causal else block
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
    # one token per document: only the own block's diagonal, every other step skipped
    alone = np.stack([np.arange(s)[None, p] for p in pos])
    steps = _segments(cp, alone)
    assert [len(p) for p in steps] == [2 * half] + [0] * (ring - 1)
    with pytest.raises(ValueError, match="never decrease"):
        _segments(cp, every[:, :, ::-1].copy())


def test_a_block_row_that_sees_no_key_merges_as_nothing():
    """The masked reference gives a row with no visible key out 0 and lse -inf (no NaN), its
    backward gives it no gradient, and merging it leaves the running output unchanged."""
    q, k, v = _qkv(s=6)
    mask = torch.ones(2, 6, 6, dtype=torch.bool)
    mask[:, :2] = False  # the first two queries see nothing
    o, lse = blocks.attention_forward(q, k, v, False, mask=mask)
    assert torch.isinf(lse[:, :, :2]).all() and (o[:, :, :2] == 0).all()
    assert torch.isfinite(lse[:, :, 2:]).all()
    grads = blocks.attention_backward(torch.randn_like(o), q, k, v, o, lse, False, mask=mask)
    assert all(not g.isnan().any() for g in grads)
    assert (grads[0][:, :, :2] == 0).all()
    # merged into nothing yet: stays 0 and -inf; into a running output: leaves it unchanged
    out, run = torch.zeros(q.shape), torch.full(q.shape[:3], float("-inf"))
    blocks.merge(out, run, o, lse)
    assert not out.isnan().any() and torch.isinf(run[:, :, :2]).all()
    none = torch.zeros(2, 6, 6, dtype=torch.bool)
    o0, lse0 = blocks.attention_forward(q, k, v, False, mask=none)
    full_o, full_lse = blocks.attention_forward(q, k, v, False)
    out, run = full_o.float().clone(), full_lse.clone()
    blocks.merge(out, run, o0, lse0)
    torch.testing.assert_close(out, full_o.float(), rtol=0, atol=0)
    torch.testing.assert_close(run, full_lse, rtol=0, atol=0)
