"""The attention settings Qwen2, Qwen3 and Llama 3 need: q/k/v bias, per-head q/k norms, a head
width of its own (kv_channels) and Llama 3 RoPE scaling.

Each is checked where it can go wrong: the scaled frequencies against transformers' own, the
q/k norm against a hand-written attention, the cached decode (which runs its own attention step)
against the training forward, and recompute and torch.compile against the plain forward.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.generate import KVCache, forward_cached
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.model.rotary import inverse_frequencies
from meshtrain.services.trainer.parallel import recompute

QWEN3 = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=24,
    seq_length=32,
    vocab_size=301,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    qk_norm=True,
    qkv_bias=True,
    rope_scaling_factor=8.0,
    rope_scaling_original_max_positions=16,
)


def random_model(**kw) -> GPT:
    """Every parameter random, so zero biases and unit norm weights cannot hide a mistake."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def test_parameters_and_shapes():
    model = random_model(**QWEN3)
    att = model.layers[0].attention
    # (heads + 2 groups) * kv_channels rows; the output projection reads heads * kv_channels
    assert att.qkv.weight.shape == ((4 + 2 * 2) * 24, 64) and att.qkv.bias.shape == (8 * 24,)
    assert att.proj.weight.shape == (64, 4 * 24) and att.proj.bias is None
    assert att.q_norm.weight.shape == att.k_norm.weight.shape == (24,)
    assert model.layers[0].mlp.fc1.bias is None
    names = {n for n, _ in model.named_parameters()}
    assert {
        "layers.0.attention.q_norm.weight",
        "layers.0.attention.k_norm.weight",
        "layers.0.attention.qkv.bias",
    } <= names
    fresh = GPT(ModelConfig(**QWEN3))
    assert torch.equal(fresh.layers[0].attention.q_norm.weight, torch.ones(24))
    assert torch.equal(fresh.layers[0].attention.qkv.bias, torch.zeros(8 * 24))


def test_qk_norm_and_qkv_bias_match_a_hand_written_attention():
    """fp32, one block's attention against per-head arithmetic written out here (1e-5)."""
    cfg = {**QWEN3, "rope_scaling_factor": None}
    model = random_model(**cfg)
    att = model.layers[0].attention
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    d, eps = 24, model.config.norm_epsilon
    qkv = F.linear(x, att.qkv.weight, att.qkv.bias).view(
        2, 32, 2, 4, d
    )  # (b, s, groups, 2 q + k + v, d)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    q = rms(qkv[:, :, :, :2].reshape(2, 32, 4, d), att.q_norm.weight).transpose(
        1, 2
    )  # (b, heads, s, d)
    k = rms(qkv[:, :, :, 2], att.k_norm.weight).transpose(1, 2)  # (b, groups, s, d)
    v = qkv[:, :, :, 3].transpose(1, 2)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(32).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(t):
        return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

    q, k = rot(q), rot(k).repeat_interleave(2, 1)
    v = v.repeat_interleave(2, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 32, 4 * d)
    with torch.no_grad():
        ours = att(x, (model.rope_cos, model.rope_sin))
        torch.testing.assert_close(ours, F.linear(out, att.proj.weight), atol=1e-5, rtol=1e-5)


def test_llama3_frequencies_equal_transformers():
    """The scaled inverse frequencies against transformers' `llama3` rope init (fp32: exact
    up to one rounding), for Llama 3.1's and Llama 3.2's settings."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for factor, theta in ((8.0, 500000.0), (32.0, 500000.0)):
        ours = ModelConfig(
            num_layers=1,
            hidden_size=512,
            num_attention_heads=4,
            seq_length=64,
            normalization="rmsnorm",
            activation="swiglu",
            position_embedding_type="rope",
            rotary_base=theta,
            rope_scaling_factor=factor,
        )
        theirs = transformers.LlamaConfig(
            hidden_size=512,
            num_attention_heads=4,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": theta,
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
        inv, scale = ROPE_INIT_FUNCTIONS["llama3"](theirs, "cpu")
        assert scale == 1.0
        got = inverse_frequencies(ours)
        torch.testing.assert_close(got, inv.float(), atol=0, rtol=1e-6)
        plain = inverse_frequencies(ModelConfig(**{**ours.__dict__, "rope_scaling_factor": None}))
        assert (got < plain).any() and (
            got == plain
        ).any()  # long wavelengths stretched, short ones kept


def test_cached_decode_matches_the_training_forward():
    """generate's KV-cache step runs its own attention:
    it must normalize q/k and add the bias too."""
    model = random_model(**QWEN3)
    tokens = torch.randint(0, 301, (2, 20), generator=torch.Generator().manual_seed(3))
    cache = KVCache(len(model.layers))
    steps = [forward_cached(model, tokens[:, :5], cache)]
    for i in range(5, 20):
        steps.append(forward_cached(model, tokens[:, i : i + 1], cache))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(steps, 1), model(tokens), atol=1e-5, rtol=1e-5)


def _loss_and_grads(model: GPT):
    tokens = torch.randint(0, 301, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, tokens.roll(-1, 1))
    loss.backward()
    return loss.detach(), {
        n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
    }


def test_recompute_and_compile_give_the_plain_results():
    """Full recompute replays the same kernels (bit-identical); torch.compile (aot_eager: the
    traced graph, no codegen) may reorder nothing here either, so 1e-6 covers it."""
    ref_loss, ref_grads = _loss_and_grads(random_model(**QWEN3).train())
    plan = ParallelConfig(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    loss, grads = _loss_and_grads(recompute.apply(random_model(**QWEN3).train(), plan))
    assert loss == ref_loss
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    torch._dynamo.reset()
    model = random_model(**QWEN3).train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss, grads = _loss_and_grads(compiled)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"kv_channels": 0}, "model.kv_channels must be positive"),
        ({"kv_channels": None, "hidden_size": 66}, "or set model.kv_channels"),
        ({"rope_scaling_factor": 0.5}, "model.rope_scaling_factor must be >= 1"),
        ({"rope_scaling_low_freq_factor": 4.0}, "must satisfy 0 < low < high"),
        (
            {"rope_scaling_original_max_positions": 0},
            "rope_scaling_original_max_positions must be positive",
        ),
        ({"position_embedding_type": "learned"}, "needs model.position_embedding_type='rope'"),
    ],
)
def test_bad_settings_are_refused_by_name(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**QWEN3, **change})


def test_a_head_width_other_than_hidden_over_heads_counts_its_attention_flops():
    model = GPT(ModelConfig(**QWEN3))
    plain = GPT(ModelConfig(**{**QWEN3, "kv_channels": None}))
    # The attention-score term is 12 * layers * seq * heads * head_dim: 96 wide instead of 64.
    score_terms = 12.0 * 2 * 32 * 96 - 12.0 * 2 * 32 * 64
    weights = model.num_parameters(exclude_embeddings=True) - plain.num_parameters(
        exclude_embeddings=True
    )
    assert model.flops_per_token() - plain.flops_per_token() == pytest.approx(
        6.0 * weights + score_terms
    )
