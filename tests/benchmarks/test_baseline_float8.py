"""benchmarks/baseline_gpt.py's torchao float8 conversion on CPU
(Float8Linear runs here through torch._scaled_mm).

The layer choice (every block's linear, never the head, nothing torch._scaled_mm cannot take) and a
finite, close forward and backward at a tiny shape; the speed is measured on the GPU
(train_throughput.py --baseline-float8).
"""

import copy
import sys

import pytest
import torch
from torch import nn

from benchmarks.baseline_gpt import BaselineGPT, convert_to_float8
from meshtrain.services.common.model_config import ModelConfig

float8 = pytest.importorskip(
    "torchao.float8.float8_linear", reason="torchao is not installed (`test` extra)"
)

BLOCK_LINEARS = ("q", "kv", "o", "mlp.up", "mlp.down")


def llama(**kw) -> ModelConfig:
    """Llama-style at a shape every float8 GEMM takes (each dimension a multiple of 16);
    vocab 100 pads to 128."""
    return ModelConfig(
        **{
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 96,
            "seq_length": 32,
            "vocab_size": 100,
            "normalization": "rmsnorm",
            "activation": "swiglu",
            "position_embedding_type": "rope",
            "add_bias_linear": False,
            "untie_embeddings_and_output_weights": True,
            **kw,
        }
    )


def loss_and_grads(
    model: nn.Module, tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_blocks_linears_become_float8_and_train_close_to_bf16(recipe):
    """Tolerances: e4m3 keeps 3 mantissa bits, e5m2 (tensorwise's gradients) 2, so each GEMM operand
    is rounded by up to 1/16 or 1/8 of its magnitude. The loss at init (~ln 100) moved by at most
    2e-4 relative over three seeds (1e-2 allowed); a weight gradient, whose error grows through the
    layers above it, by at most 10.3% of its norm for tensorwise and 8.3% for rowwise (20% allowed).
    A broken conversion (a lost scale, a transposed operand) is off by the whole norm."""
    torch.manual_seed(0)
    plain = BaselineGPT(llama())
    model = copy.deepcopy(plain)
    converted = convert_to_float8(model, recipe)

    assert converted == [f"blocks.{i}.{layer}" for i in range(2) for layer in BLOCK_LINEARS]
    for name, module in model.named_modules():
        if name in converted:
            assert isinstance(module, float8.Float8Linear), name
        elif isinstance(module, nn.Linear) and name != "head":
            raise AssertionError(
                f"{name} should have been converted or be the head, is {type(module)}"
            )
    assert type(model.head) is nn.Linear  # untouched: the output layer stays in bf16
    assert model.head.weight is not None and model.head.out_features == 128

    tokens = torch.randint(0, 100, (2, 33), generator=torch.Generator().manual_seed(1))
    loss8, grads8 = loss_and_grads(model, tokens)
    loss16, grads16 = loss_and_grads(plain, tokens)
    assert torch.isfinite(loss8) and loss8.item() == pytest.approx(loss16.item(), rel=1e-2)
    for name, g in grads8.items():
        assert g is not None and torch.isfinite(g).all(), name
        if name.startswith("blocks.") and name.endswith("weight") and g.ndim == 2:
            assert (g - grads16[name]).norm() <= 0.2 * grads16[name].norm(), name


def test_a_router_too_narrow_for_the_float8_gemm_stays_a_plain_linear():
    """A MoE router of 4 experts has 4 output features: torch._scaled_mm needs multiples of 16."""
    torch.manual_seed(0)
    model = BaselineGPT(llama(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32))
    converted = convert_to_float8(model, "tensorwise")
    assert "blocks.0.mlp.gate" not in converted and type(model.blocks[0].mlp.gate) is nn.Linear
    assert "blocks.0.mlp.up.3" in converted and "blocks.1.q" in converted
    assert isinstance(model.blocks[0].mlp.up[3], float8.Float8Linear)


def test_bad_recipe_and_missing_torchao_are_named(monkeypatch):
    model = BaselineGPT(llama())
    with pytest.raises(
        ValueError, match="float8 recipe must be one of tensorwise, rowwise, got 'delayed'"
    ):
        convert_to_float8(model, "delayed")
    monkeypatch.setitem(
        sys.modules, "torchao.float8", None
    )  # what Python does for a package not installed
    with pytest.raises(ImportError, match="the float8 baseline needs torchao"):
        convert_to_float8(model, "tensorwise")
    assert all(
        type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear)
    )  # nothing half-converted
