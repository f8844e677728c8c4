"""The single-device GPT: shapes, causality, GQA, init, parameter names and counts."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model import GPT

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


def build(**kw):
    torch.manual_seed(0)
    return GPT(ModelConfig(**kw)).eval()


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_logits_shape_and_padding_hidden(kw):
    model = build(**kw)
    assert model.embedding.word_embeddings.weight.shape[0] == 384  # padded to a multiple of 128
    logits = model(torch.randint(0, 301, (3, 17)))
    assert logits.shape == (3, 17, 301)  # padded rows never reach the output


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_causal_future_tokens_never_change_earlier_logits(kw):
    model = build(**kw)
    tokens = torch.randint(0, 301, (2, 32))
    base = model(tokens)
    for pos in (5, 20, 31):
        changed = tokens.clone()
        changed[:, pos:] = (changed[:, pos:] + 7) % 301
        out = model(changed)
        torch.testing.assert_close(out[:, :pos], base[:, :pos], rtol=0, atol=1e-5)
        assert not torch.allclose(out[:, pos], base[:, pos])


def test_loss_equals_cross_entropy_of_logits_and_mask_weights():
    model = build(**LLAMA)
    tokens = torch.randint(0, 301, (2, 16))
    labels = torch.randint(0, 301, (2, 16))
    logits = model(tokens)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    torch.testing.assert_close(model(tokens, labels), ref, rtol=1e-5, atol=1e-5)
    mask = torch.zeros(2, 16)
    mask[0, :5] = 1
    ref_masked = F.cross_entropy(logits[0, :5], labels[0, :5])
    torch.testing.assert_close(model(tokens, labels, mask), ref_masked, rtol=1e-5, atol=1e-5)


def naive_attention_block(model, x):
    """Attention of layer 0 recomputed with explicit per-head loops and repeated KV heads."""
    att = model.layers[0].attention
    b, s, _ = x.shape
    h, g, d = att.heads, att.groups, att.head_dim
    w = att.qkv.weight.view(g, h // g + 2, d, -1)  # per group: q heads, k, v
    outs = []
    for head in range(h):
        grp, j = divmod(head, h // g)
        q = x @ w[grp, j].t()
        k = x @ w[grp, h // g].t()
        v = x @ w[grp, h // g + 1].t()
        if model.rope_cos is not None:
            cos, sin = model.rope_cos[:s], model.rope_sin[:s]
            rot = lambda t: torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1)  # noqa: E731
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(
            torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf")
        )
        outs.append(scores.softmax(-1) @ v)
    return att.proj(torch.cat(outs, -1))


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["mha-learned", "gqa-rope"])
def test_attention_matches_naive_per_head_reference(kw):
    model = build(**kw)
    x = torch.randn(2, 12, 64)
    rope = (model.rope_cos, model.rope_sin) if model.rope_cos is not None else None
    torch.testing.assert_close(
        model.layers[0].attention(x, rope), naive_attention_block(model, x), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    "backend,expand",
    [("math", None), ("auto", True), ("math", True)],
    ids=["pinned-math", "auto-expanded-kv", "math-expanded-kv"],
)
def test_pinned_attention_backend_and_expanded_kv_match_naive_reference(backend, expand):
    """A pinned SDPA backend (and expanding KV heads instead of enable_gqa) computes the same."""
    from meshtrain.services.trainer.model import attention

    model = build(**LLAMA, attention_backend=backend)
    assert model.layers[0].attention.core.backend == backend
    x = torch.randn(2, 12, 64)
    rope = (model.rope_cos, model.rope_sin)
    if expand:
        core = model.layers[0].attention.core
        core.forward = lambda q, k, v: attention.sdpa(q, k, v, 0.0, backend, expand_kv=True)
    torch.testing.assert_close(
        model.layers[0].attention(x, rope), naive_attention_block(model, x), rtol=1e-4, atol=1e-5
    )


def test_unknown_attention_backend_is_refused():
    from meshtrain.services.common.errors import ConfigError
    from meshtrain.services.trainer.config.load import load_config

    with pytest.raises(ConfigError, match="model.attention_backend: got 'flash3'"):
        load_config(["--model.attention_backend=flash3"])


def test_canonical_parameter_names():
    names = set(dict(build(**LLAMA).named_parameters()))
    per_layer = [
        "input_norm.weight",
        "attention.qkv.weight",
        "attention.proj.weight",
        "pre_mlp_norm.weight",
        "mlp.fc1.weight",
        "mlp.fc2.weight",
    ]
    expected = {"embedding.word_embeddings.weight", "output_layer.weight", "final_norm.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert names == expected
    gpt2 = set(dict(build(**GPT2).named_parameters()))
    assert "embedding.position_embeddings.weight" in gpt2 and "output_layer.weight" not in gpt2
    assert "layers.0.attention.qkv.bias" in gpt2


def test_fused_shapes_gqa_and_swiglu():
    model = build(**LLAMA)
    d = 16
    assert model.layers[0].attention.qkv.weight.shape == ((4 + 2 * 2) * d, 64)
    ffn = ModelConfig(**LLAMA).ffn_size
    assert ffn == 128  # 8/3 * 64 rounded down to 64, Megatron-LM's --swiglu width
    assert model.layers[0].mlp.fc1.weight.shape == (2 * ffn, 64)
    # Megatron-LM: int((4 * hidden * 2 / 3) / 64) * 64
    assert [ModelConfig(**dict(LLAMA, hidden_size=h)).ffn_size for h in (1024, 2048, 4096)] == [
        2688,
        5440,
        10880,
    ]


def test_init_scaled_residual_projections():
    cfg = dict(GPT2, num_layers=8, hidden_size=256, num_attention_heads=4)
    model = build(**cfg)
    std = model.layers[0].mlp.fc1.weight.std().item()
    scaled = model.layers[0].attention.proj.weight.std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(scaled - 0.02 / math.sqrt(16)) < 0.0005
    assert torch.all(model.layers[0].input_norm.weight == 1)
    assert torch.all(model.layers[0].attention.qkv.bias == 0)


def test_tied_embeddings_share_storage():
    model = build(**GPT2)
    assert model.output_weight is model.embedding.word_embeddings.weight


def test_parameter_count_and_flops():
    model = build(**GPT2)
    raw = sum(p.numel() for p in model.parameters())
    assert model.num_parameters() == raw - (384 - 301) * 64
    non_emb = model.num_parameters(exclude_embeddings=True)
    assert non_emb == raw - 384 * 64 - 32 * 64
    assert model.flops_per_token() == 6 * (non_emb + 301 * 64) + 12 * 2 * 32 * 64


def test_flops_count_the_head_once_tied_or_untied():
    # The same computation either way: tying only shares the head's weight with the embedding.
    tied, untied = build(**GPT2), build(**dict(GPT2, untie_embeddings_and_output_weights=True))
    assert untied.num_parameters() == tied.num_parameters() + 301 * 64
    assert untied.flops_per_token() == tied.flops_per_token()
    body = sum(
        p.numel() for n, p in untied.named_parameters() if n.startswith(("layers.", "final_norm."))
    )
    assert untied.flops_per_token() == 6 * (body + 301 * 64) + 12 * 2 * 32 * 64


def test_too_long_sequence_is_an_error():
    with pytest.raises(ValueError, match="seq_length"):
        build(**GPT2)(torch.zeros(1, 33, dtype=torch.long))


def _loss_grads_and_stream(kw, autocast):
    """Loss, gradients and the dtype of every block's (and the final norm's) input."""
    model = build(**kw)
    stream = []
    for module in [*model.layers, model.final_norm]:
        module.register_forward_pre_hook(lambda _m, args: stream.append(args[0].dtype))
    tokens = torch.randint(0, 301, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 301, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(tokens, labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, stream


@pytest.mark.parametrize("kw", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_bf16_residual_stream_under_autocast(kw):
    """Under autocast the stream between blocks is bf16 by default (fp32 parameters and gradients
    still) and fp32 with fp32_residual_connection; the loss and gradients of the two agree to
    bf16 rounding. Without autocast the setting changes nothing."""
    loss16, grads16, stream16 = _loss_grads_and_stream(
        kw, autocast=True
    )  # the default: a bf16 stream
    loss32, grads32, stream32 = _loss_grads_and_stream(
        dict(kw, fp32_residual_connection=True), autocast=True
    )
    assert stream32 == [torch.float32] * 3 and stream16 == [torch.bfloat16] * 3
    assert loss16 == pytest.approx(loss32, rel=1e-3)
    for name, g in grads32.items():
        assert grads16[name].dtype == torch.float32, name
        torch.testing.assert_close(
            grads16[name], g, rtol=0.1, atol=0.05 * g.abs().max().item(), msg=name
        )
    plain = _loss_grads_and_stream(dict(kw, fp32_residual_connection=True), autocast=False)
    off = _loss_grads_and_stream(kw, autocast=False)
    assert plain[2] == off[2] == [torch.float32] * 3 and plain[0] == off[0]
    for name, g in plain[1].items():
        assert torch.equal(off[1][name], g), name
