"""Checkpoints of the Qwen-style attention parameters across tensor-parallel layouts.

The q/k/v bias is split over tp with the fused QKV rows (by query groups) and the per-head q/k
norm weights are replicated; both must land in global coordinates whatever layout saved them.
A tp=1 checkpoint is loaded by two gloo ranks at tp=2 and their logits compared with the whole
model's; the ranks save again at tp=2, and that checkpoint, loaded into one process, holds the
very same tensors and exports as a Qwen3 model transformers computes the same logits with.
"""

import pytest
import torch

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.checkpointing import load_checkpoint, save_checkpoint
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor import parallelize
from tests.dist_utils import run_ranks

BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=24,
    ffn_hidden_size=96,
    seq_length=16,
    vocab_size=203,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    rope_scaling_factor=4.0,
    rope_scaling_original_max_positions=8,
)
QWEN2 = dict(BASE, qkv_bias=True)
QWEN3 = dict(BASE, qk_norm=True)
TOKENS = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))


def random_model(settings: dict, seed: int = 0) -> GPT:
    """Every parameter random (the bias and norm weights too: zeros and ones would hide a swap)."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**settings))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


def _load_and_save_at_tp2(rank, world, settings, src, dst):
    model = parallelize(
        random_model(settings, seed=1), Mesh.build(tp=world)
    )  # other weights: all must be loaded
    load_checkpoint(src, model, mesh=Mesh.build(tp=world))
    with torch.no_grad():
        logits = model(TOKENS)
    save_checkpoint(dst, 2, model, None, mesh=Mesh.build(tp=world))
    return logits


@pytest.mark.dist
@pytest.mark.parametrize(
    "settings, cls",
    [(QWEN2, "Qwen2ForCausalLM"), (QWEN3, "Qwen3ForCausalLM")],
    ids=["qkv-bias", "qk-norm"],
)
def test_qkv_bias_and_qk_norms_survive_any_tensor_parallel_layout(tmp_path, settings, cls):
    """fp32; the tp=2 logits differ from one process's only in reduction order (1e-5)."""
    whole = random_model(settings)
    src, dst = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    save_checkpoint(src, 1, whole, None)
    with torch.no_grad():
        expected = whole(TOKENS)
    for logits in run_ranks(_load_and_save_at_tp2, 2, settings, src, dst):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)

    again = random_model(settings, seed=2)
    load_checkpoint(dst, again)
    ours = dict(again.named_parameters())
    for name, p in whole.named_parameters():
        assert torch.equal(ours[name][:203], p[:203]), name

    transformers = pytest.importorskip("transformers")
    from meshtrain.services.checkpoint.hf.convert import export_hf

    export_hf(dst, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32
    ).eval()
    assert type(hf).__name__ == cls
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, expected, atol=1e-4, rtol=1e-4)
