"""Learning-rate schedule and AdamW parameter groups."""

import math

import pytest
import torch

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.optim.optimizer import build_optimizer, clip_grad_norm, is_decayed
from meshtrain.services.trainer.optim.schedule import lr_at


def test_warmup_then_cosine_to_min():
    c = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10)
    assert lr_at(0, c, 110) == pytest.approx(0.1)
    assert lr_at(9, c, 110) == pytest.approx(1.0)
    assert lr_at(10, c, 110) == pytest.approx(1.0)
    assert lr_at(60, c, 110) == pytest.approx(0.55)  # half way: midpoint of cosine
    assert lr_at(110, c, 110) == pytest.approx(0.1)
    assert lr_at(500, c, 110) == pytest.approx(0.1)
    values = [lr_at(s, c, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_linear_and_constant_styles():
    lin = OptimConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_decay_iters=100)
    assert lr_at(25, lin, 1000) == pytest.approx(0.75)
    const = OptimConfig(lr=0.5, min_lr=0.0, lr_decay_style="constant", lr_warmup_iters=2)
    assert lr_at(0, const, 10) == pytest.approx(0.25) and lr_at(7, const, 10) == 0.5


def test_weight_decay_groups():
    model = GPT(ModelConfig(vocab_size=100, num_layers=1, hidden_size=32, num_attention_heads=2))
    c = OptimConfig(weight_decay=0.1)
    opt = build_optimizer(model, c)
    decayed = {n for n, p in model.named_parameters() if is_decayed(n, p, c)}
    assert "layers.0.attention.qkv.weight" in decayed and "layers.0.mlp.fc2.weight" in decayed
    assert not any(
        n.endswith(".bias") or "norm" in n or n.startswith("embedding.") for n in decayed
    )
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    assert len(opt.param_groups[0]["params"]) == len(decayed)
    c2 = OptimConfig(decay_embeddings=True)
    assert is_decayed(
        "embedding.word_embeddings.weight", model.embedding.word_embeddings.weight, c2
    )


def test_clip_reports_true_norm_and_clips():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    m = torch.nn.Module()
    m.p = p
    norm = clip_grad_norm(m, 1.0)
    assert norm.item() == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-4)
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert clip_grad_norm(m, 0.0).item() == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(5.0)
    assert math.isfinite(norm.item())
