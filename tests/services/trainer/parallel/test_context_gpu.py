"""The ring's attention within packed documents on CUDA: each ring step's dense pieces (one
flash-attention call per document rectangle, `_pieces` with segments) against the same step
under a dense boolean mask (the reference), forward and backward in bf16, for every step of
every rank of a 4-rank ring. The ring's messages are not involved (NCCL refuses two ranks on
one GPU): each step is given the block its ring rank would hold then, which is what the gloo
tests check the exchange delivers."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshtrain.kernels import attention_blocks as blocks
from meshtrain.services.dataloader.loader import context_positions
from meshtrain.services.trainer.parallel.context import _pieces, _RingDocuments, _segments

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _step_outputs(q, kv, dout, cp, docs, half):
    """Forward (merged over the steps) and the per-step backward of one ring rank."""
    b, h, s, d = q.shape
    out = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(cp.ring):
        k, v = kv[(cp.ring_rank - step) % cp.ring]
        for rows, qs, ks, causal, mask in _pieces(cp, step, half, docs):
            o, l_ = blocks.attention_forward(
                q[rows, :, qs], k[rows, :, ks], v[rows, :, ks], causal, "auto", mask
            )
            blocks.merge(out[rows, :, qs], lse[rows, :, qs], o, l_)
    o16 = out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = [torch.zeros((2, *kv[0][0].shape), dtype=torch.float32, device=q.device) for _ in kv]
    for step in range(cp.ring):
        src = (cp.ring_rank - step) % cp.ring
        k, v = kv[src]
        for rows, qs, ks, causal, mask in _pieces(cp, step, half, docs):
            gq, gk, gv = blocks.attention_backward(
                dout[rows, :, qs], q[rows, :, qs], k[rows, :, ks], v[rows, :, ks],
                o16[rows, :, qs], lse[rows, :, qs], causal, "auto", mask,
            )  # fmt: skip
            dq[rows, :, qs] += gq
            dkv[src][0][rows, :, ks] += gk
            dkv[src][1][rows, :, ks] += gv
    return out, lse, dq, dkv


@pytest.mark.parametrize("ring_rank", range(4))
def test_ring_document_pieces_on_cuda_equal_the_masked_reference(ring_rank):
    ring, half, b, h, g, d = 4, 48, 2, 4, 2, 64
    s = 2 * half
    rng = np.random.default_rng(ring_rank)
    total = 2 * ring * half
    ids = np.stack([np.cumsum(rng.random(total) < p) for p in (0.01, 0.05)])  # (b, total)
    pos = [context_positions(total, r, ring) for r in range(ring)]
    every = np.stack([ids[:, p] for p in pos])  # (ring, b, s)
    gen = torch.Generator(device="cuda").manual_seed(ring_rank)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, dout = rand(b, h, s, d), rand(b, h, s, d)
    kv = [(rand(b, g, s, d), rand(b, g, s, d)) for _ in range(ring)]
    cp = SimpleNamespace(ring=ring, ring_rank=ring_rank, comm_type="p2p")
    every_t = torch.from_numpy(every).cuda()
    local = every_t[ring_rank]
    by_mask = _RingDocuments(local, every_t, None)
    by_pieces = _RingDocuments(local, every_t, _segments(cp, every))
    want = _step_outputs(q, kv, dout, cp, by_mask, half)
    got = _step_outputs(q, kv, dout, cp, by_pieces, half)
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    seen = torch.isfinite(want[1])
    assert torch.equal(seen, torch.isfinite(got[1]))
    torch.testing.assert_close(got[1][seen], want[1][seen], **tol)
    torch.testing.assert_close(got[2], want[2], **tol)
    for a, e in zip(got[3], want[3], strict=True):
        torch.testing.assert_close(a, e, **tol)
