"""Packed documents: attention within documents and positions restarting at each one.

A sequence packing several documents (data.reset_attention_mask + data.reset_position_ids)
must compute, for each document, exactly what that document computes alone: the same logits
and, summed over the documents, the same parameter gradients. fp32 on CPU: the packed run
differs from the separate ones only in the masked-out (zero-weight) keys and in summation
order, so they agree to ~1e-6 relative.
"""

import pytest
import torch
import torch.nn.functional as F

from meshtrain.kernels import reference
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.dataloader.loader import BatchOptions, batch_from_samples
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.model.attention import Documents, document_attention

EOD = 0
GPT2 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=301)
LLAMA = dict(
    GPT2,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_query_groups=2,
)
LENGTHS = (7, 11, 6)  # three documents; the first two end with EOD, the last is cut off


def _documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    docs = []
    for i, n in enumerate(LENGTHS):
        doc = torch.randint(1, 301, (n,), generator=g)
        if i < len(LENGTHS) - 1:
            doc[-1] = EOD  # the EOD belongs to the document it ends
        docs.append(doc)
    return docs


def _packed(docs):
    """(1, s) tokens, next-token labels, document ids and positions, from the loader's own
    options (a sample is the tokens plus one more)."""
    sample = torch.cat([*docs, torch.tensor([5])])[None]
    opts = BatchOptions(eod_id=EOD, document_ids=True, position_ids=True)
    b = batch_from_samples(sample.numpy(), 0, 0, opts)
    return b.tokens, b.labels, b.document_ids, b.position_ids


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2-learned-positions", "llama-rope-gqa"])
def test_packed_sequence_equals_each_document_alone(kw):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**kw))
    docs = _documents()
    tokens, labels, ids, positions = _packed(docs)
    assert positions[0].tolist() == [*range(7), *range(11), *range(6)]

    logits = model(tokens, document_ids=ids, position_ids=positions)  # (1, s, vocab)
    F.cross_entropy(logits[0], labels[0], reduction="sum").backward()
    packed_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    start = 0
    for n in LENGTHS:
        alone = model(tokens[:, start : start + n])  # positions 0.. and whole-sequence attention
        torch.testing.assert_close(
            logits[:, start : start + n], alone, rtol=1e-6, atol=2e-6, msg=f"doc at {start}"
        )
        F.cross_entropy(alone[0], labels[0, start : start + n], reduction="sum").backward()
        start += n
    separate_grads = _grads(model)
    assert set(packed_grads) == set(separate_grads)
    for name, g in packed_grads.items():
        # summed in another order: ~1e-6 of the tensor's scale (biases sum every token)
        scale = float(g.abs().max())
        torch.testing.assert_close(g, separate_grads[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_without_document_masking_later_documents_see_earlier_ones():
    """The property above is not automatic: plain causal attention over the packed sequence
    changes every document after the first."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**LLAMA))
    tokens, _, ids, positions = _packed(_documents())
    alone = model(tokens[:, 7:18])
    crossed = model(tokens, position_ids=positions)[:, 7:18]
    assert not torch.allclose(crossed, alone, rtol=1e-3, atol=1e-4)
    masked = model(tokens, document_ids=ids, position_ids=positions)[:, 7:18]
    torch.testing.assert_close(masked, alone, rtol=1e-6, atol=2e-6)


def test_reset_positions_alone_keep_whole_sequence_attention():
    """reset_position_ids without reset_attention_mask (Megatron allows either): positions
    restart, attention still crosses documents; the first document is unaffected."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**GPT2))
    tokens, _, _, positions = _packed(_documents())
    plain, reset = model(tokens), model(tokens, position_ids=positions)
    torch.testing.assert_close(plain[:, :7], reset[:, :7])
    assert not torch.allclose(plain[:, 7:], reset[:, 7:], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_reference_document_attention_is_per_document_sdpa(groups):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 13, 8, generator=g)
    k, v = (torch.randn(2, groups, 13, 8, generator=g) for _ in range(2))
    ids = torch.tensor([[0] * 5 + [1] * 8, [0] * 1 + [1] * 3 + [2] * 9])
    out = document_attention(q, k, v, Documents(ids))
    rep = 4 // groups
    for b in range(2):
        for d in ids[b].unique():
            cols = (ids[b] == d).nonzero().flatten()
            a, e = int(cols[0]), int(cols[-1]) + 1
            want = F.scaled_dot_product_attention(
                q[b : b + 1, :, a:e],
                k[b : b + 1, :, a:e].repeat_interleave(rep, 1),
                v[b : b + 1, :, a:e].repeat_interleave(rep, 1),
                is_causal=True,
            )
            torch.testing.assert_close(out[b : b + 1, :, a:e], want)


def test_rope_takes_per_sequence_tables():
    """dispatch.rope's reference with (batch, seq, d) tables equals one sequence at a time."""
    cos, sin = reference.rope_cos_sin(16, 8, 10000.0)
    x = torch.randn(2, 3, 5, 8)
    pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])
    got = reference.rope(x, cos[pos], sin[pos])
    for b in range(2):
        torch.testing.assert_close(
            got[b : b + 1], reference.rope(x[b : b + 1], cos[pos[b]], sin[pos[b]])
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_flex_attention_matches_the_reference(groups):
    """The CUDA path (FlexAttention with a block mask) against the dense CPU reference,
    forward and backward, on odd document lengths over a sequence that is no block multiple."""
    g = torch.Generator().manual_seed(0)
    s = 300
    q = torch.randn(2, 4, s, 64, generator=g)
    k, v = (torch.randn(2, groups, s, 64, generator=g) for _ in range(2))
    cuts = [torch.tensor([0] * 37 + [1] * 150 + [2] * 113), torch.tensor([0] * 1 + [1] * 299)]
    ids = torch.stack(cuts)
    dout = torch.randn(2, 4, s, 64, generator=g)

    def run(device):
        qd, kd, vd = (t.to(device).requires_grad_() for t in (q, k, v))
        out = document_attention(qd, kd, vd, Documents(ids.to(device)))
        out.backward(dout.to(device))
        return [t.detach().cpu() for t in (out, qd.grad, kd.grad, vd.grad)]

    for got, want in zip(run("cuda"), run("cpu")):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rope_takes_per_sequence_tables():
    from meshtrain.kernels import dispatch

    cos, sin = reference.rope_cos_sin(64, 32, 10000.0, device="cuda")
    x = torch.randn(3, 4, 50, 32, device="cuda", requires_grad=True)
    pos = torch.randint(0, 64, (3, 50), device="cuda")
    got = dispatch.rope(x, cos[pos], sin[pos])
    want = reference.rope(x, cos[pos], sin[pos])
    torch.testing.assert_close(got, want)
    dy = torch.randn_like(got)
    (gx,) = torch.autograd.grad(got, x, dy)
    (wx,) = torch.autograd.grad(want, x, dy)
    torch.testing.assert_close(gx, wx)
