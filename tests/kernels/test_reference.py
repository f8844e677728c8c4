"""The reference ops (the spec) against independent formulas, and dispatch's modes."""

import pytest
import torch

from meshtrain.kernels import dispatch, reference


def test_rms_norm_formula():
    x, w = torch.randn(5, 123, dtype=torch.float64), torch.randn(123, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6), expected)


def test_rope_equals_complex_rotation_of_half_pairs():
    b, h, s, d = 2, 3, 7, 10
    x = torch.randn(b, h, s, d, dtype=torch.float64)
    cos, sin = reference.rope_cos_sin(s, d, 10000.0)
    out = reference.rope(x, cos.double(), sin.double())
    # rotate-half pairs element i with i + d/2; each pair is rotated by angle pos * base^(-2i/d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freqs
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    # the tables are fp32 (as the model uses them), so agreement is to fp32 rounding, not fp64's
    torch.testing.assert_close(
        out, torch.cat([rotated.real, rotated.imag], -1), rtol=1e-6, atol=1e-6
    )


def test_rope_preserves_norm_and_relative_positions():
    cos, sin = reference.rope_cos_sin(16, 8, 10000.0)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    rq = reference.rope(q.expand(1, 1, 16, 8), cos.double(), sin.double())[0, 0]
    rk = reference.rope(k.expand(1, 1, 16, 8), cos.double(), sin.double())[0, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(16))
    # the score depends only on the distance between positions
    torch.testing.assert_close(rq[5] @ rk[2], rq[9] @ rk[6])


def test_swiglu_and_gelu():
    x = torch.randn(4, 10, dtype=torch.float64)
    gate, up = x[:, :5], x[:, 5:]
    torch.testing.assert_close(reference.swiglu(x), gate * torch.sigmoid(gate) * up)
    y = torch.randn(100, dtype=torch.float64)
    tanh_gelu = 0.5 * y * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (y + 0.044715 * y**3)))
    torch.testing.assert_close(reference.gelu(y), tanh_gelu)


def test_linear_cross_entropy_ignores_padded_rows():
    h = torch.randn(3, 5, 8, dtype=torch.float64)
    w = torch.randn(12, 8, dtype=torch.float64)
    labels = torch.randint(0, 10, (3, 5))
    w_padded = w.clone()
    w_padded[10:] = 100.0  # huge logits in padding rows must not matter
    expected = torch.nn.functional.cross_entropy((h @ w[:10].t()).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(
        reference.linear_cross_entropy(h, w_padded, labels, vocab_size=10), expected
    )


def test_dispatch_modes(monkeypatch):
    assert dispatch.resolve("rms_norm", on_cuda=False) is reference.rms_norm
    monkeypatch.setenv("MESHTRAIN_KERNELS", "triton")
    with pytest.raises(
        RuntimeError, match="cannot run on Triton: its tensors are not on a CUDA device"
    ):
        dispatch.resolve("rms_norm", on_cuda=False)  # Triton kernels serve CUDA tensors only
    monkeypatch.setenv("MESHTRAIN_KERNELS", "reference")
    assert dispatch.resolve("rms_norm", on_cuda=True) is reference.rms_norm
    monkeypatch.setenv("MESHTRAIN_KERNELS", "bogus")
    with pytest.raises(ValueError, match="MESHTRAIN_KERNELS"):
        dispatch.mode()
