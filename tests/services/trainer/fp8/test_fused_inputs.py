"""Norms and activations that hand the FP8 linears their input already cast (fp8/fused_inputs.py).

A small GPT trained a few steps with train.fp8_fused_casts on (the norm / activation kernels
write the FP8 copy or the amax, the linears take it) against off (each linear casts its input):
the same losses, gradients and amax histories, bit for bit, for Llama's RMSNorm + SwiGLU and
GPT-2's LayerNorm + GELU, under delayed scaling (the first step scales by the current amax, the
second casts in the producing kernel) and tensorwise (the producer's amax). On the CPU the
fused ops run their Triton kernels through the interpreter (patched into the dispatch, which
picks the plain-torch reference off CUDA), the plain norms and activations too in both runs, so
the comparison is kernel against kernel. The GPU test runs the same on CUDA, where the dispatch
picks the kernels itself.
"""

import pytest
import torch

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.fp8 import Fp8Gemm, Recipe, apply_fp8
from meshtrain.services.trainer.fp8.fused_inputs import Fp8MLP, Fp8Norm
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=96)
ARCHS = {
    "llama": {"normalization": "rmsnorm", "activation": "swiglu", "add_bias_linear": False},
    "gpt2": {"normalization": "layernorm", "activation": "gelu"},
}


def _use_triton_kernels(monkeypatch) -> None:
    """The dispatch's ops the FP8 model calls, on their Triton kernels even off CUDA."""
    from meshtrain.kernels import (
        activation_fp8,
        dispatch,
        fp8_cast,
        gelu,
        layer_norm,
        norm_fp8,
        rms_norm,
        swiglu,
    )

    for module, names in (
        (rms_norm, ["rms_norm"]),
        (layer_norm, ["layer_norm"]),
        (swiglu, ["swiglu"]),
        (gelu, ["gelu"]),
        (fp8_cast, ["fp8_amax", "fp8_cast_transpose"]),
        (norm_fp8, ["rms_norm_fp8", "layer_norm_fp8"]),
        (activation_fp8, ["swiglu_fp8", "gelu_fp8"]),
    ):
        for name in names:
            monkeypatch.setattr(dispatch, name, getattr(module, name))


def _train(arch, recipe, fused, device, dtype=torch.float32, steps=2):
    """(per step: loss, every gradient, the amax history), and how many inputs came pre-cast."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**MODEL, **ARCHS[arch])).to(device, dtype)
    handle = apply_fp8(
        model, Recipe("hybrid", recipe, fused_casts=fused), Mesh.single(), device=device
    )
    assert handle is not None
    taken = []
    take = Fp8Gemm._take_offer

    def counted(self, x):
        made = take(self, x)
        taken.append(made is not None)
        return made

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MODEL["vocab_size"], (2, 17), generator=g).to(device)
    out = []
    Fp8Gemm._take_offer = counted
    try:
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            out += [loss.detach(), *(p.grad for p in model.parameters())]
            if handle.delayed is not None:
                out.append(handle.delayed.history.clone())
                handle.step_end()
    finally:
        Fp8Gemm._take_offer = take
    return out, handle, sum(taken)


def _assert_equal(fused, unfused):
    assert len(fused) == len(unfused)
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_pre_cast_inputs_train_as_the_linears_own_casts(arch, recipe, monkeypatch):
    _use_triton_kernels(monkeypatch)
    unfused, _, none = _train(arch, recipe, False, "cpu")
    fused, handle, taken = _train(arch, recipe, True, "cpu")
    assert none == 0
    # three inputs a block (QKV, fc1, fc2), each forward: the fused path is the one compared
    assert taken == 3 * MODEL["num_layers"] * 2
    assert len(handle.fused_inputs) == 3 * MODEL["num_layers"]
    _assert_equal(fused, unfused)


def test_the_producers_are_swapped_only_where_the_casts_are_fused():
    for recipe, fused, swapped in (
        (Recipe("hybrid", "delayed"), True, True),
        (Recipe("hybrid", "tensorwise", fused_casts=False), False, False),
        (Recipe("e4m3", "rowwise"), True, False),
    ):
        model = GPT(ModelConfig(**MODEL, **ARCHS["llama"]))
        apply_fp8(model, recipe, Mesh.single())
        block = model.layers[0]
        assert isinstance(block.input_norm, Fp8Norm) == swapped
        assert isinstance(block.pre_mlp_norm, Fp8Norm) == swapped
        assert isinstance(block.mlp, Fp8MLP) == swapped
        assert type(model.final_norm).__name__ == "Norm"  # feeds the bf16 output layer


def test_an_input_other_than_the_offered_one_is_cast_by_the_linear():
    """A tensor written in place after the offer (or any other tensor) is not the one q was made
    from: the linear casts it, and the offer is dropped."""
    r = Recipe("hybrid", "tensorwise")
    gemm = Fp8Gemm(r)
    y = torch.randn(4, 16)
    gemm.offer_input(y, None, y.abs().amax())
    y.add_(1.0)
    assert gemm._take_offer(y) is None
    gemm.offer_input(y, None, y.abs().amax())
    assert gemm._take_offer(y.clone()) is None and gemm._offered is None
    gemm.offer_input(y, None, y.abs().amax())
    assert gemm._take_offer(y.view(4, 16)) is not None  # an alias of the same bytes


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_pre_cast_inputs_train_as_the_linears_own_casts_on_cuda(arch, recipe):
    """bf16 weights and activations on CUDA: the Triton kernels, cuBLAS's FP8 GEMMs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    unfused, _, _ = _train(arch, recipe, False, "cuda", torch.bfloat16)
    fused, _, taken = _train(arch, recipe, True, "cuda", torch.bfloat16)
    assert taken == 3 * MODEL["num_layers"] * 2
    _assert_equal(fused, unfused)
