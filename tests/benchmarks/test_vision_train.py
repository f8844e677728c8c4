"""benchmarks/vision_train.py on CPU: the script end to end at a tiny size (the GPU row is measured
on an H100/H200), and its vision FLOPs against torch's FLOP counter on the plain baseline."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.baseline_vlm import BaselineVLM
from benchmarks.vision_train import vision_flops_per_image
from meshtrain.services.common.model_config import ModelConfig, VisionConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_tiny_run_writes_every_field(tmp_path):
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/vision_train.py",
        "--tiny",
        "--images-per-sample=2",
        f"--run-dir={tmp_path / 'run'}",
        f"--out={out}",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--train.peak_tflops=1.0",  # an MFU on CPU too, to check its arithmetic
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["failed"] == {}
    assert r["model"]["image_tokens"] == 4 and r["model"]["vit_layers_run"] == 1
    assert r["device"] and r["torch"] and r["config"].endswith("llava-1.5-7b.toml")
    flops = r["flops"]
    tokens, images = 4 * 64, 4 * 2  # global batch 4 x seq 64; 2 images a sample
    assert flops["per_step"] == pytest.approx(
        flops["lm_per_token"] * tokens + flops["vision_per_image"] * images
    )
    rows = r["results"]
    assert set(rows) == {"meshtrain", "baseline (plain torch)"}
    for row in rows.values():
        assert len(row["step_times_s"]) == 2 and all(t > 0 for t in row["step_times_s"])
        assert row["tokens_per_s"] == pytest.approx(tokens / row["step_time_s"])
        assert row["images_per_s"] == pytest.approx(images / row["step_time_s"])
        assert row["mfu"] == pytest.approx(flops["per_step"] / row["step_time_s"] / 1e12)
        assert 5.0 < row["loss_first"] < 7.5  # about ln(512): random tokens, a fresh model
    # independent models of the same shapes: the same number of weights train
    assert (
        rows["meshtrain"]["trainable_params"] == rows["baseline (plain torch)"]["trainable_params"]
    )
    assert r["ratio_tokens_per_s"] == pytest.approx(
        rows["meshtrain"]["tokens_per_s"] / rows["baseline (plain torch)"]["tokens_per_s"]
    )
    assert "ratio meshtrain / baseline:" in done.stdout


def tiny_config(**vision) -> ModelConfig:
    v = VisionConfig(
        image_size=28,
        patch_size=7,
        hidden_size=32,
        num_layers=3,
        num_attention_heads=4,
        ffn_hidden_size=48,
        image_token_id=5,
        **vision,
    )
    return ModelConfig(
        num_layers=1, hidden_size=24, num_attention_heads=2, seq_length=32, vocab_size=64, vision=v
    )


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize(
    "vision",
    [
        {},
        {"variant": "siglip", "select_layer": -1, "projector": "linear"},
        {"select_feature": "cls_patch"},
    ],
)
def test_vision_flops_match_torch_flop_counter(frozen, vision):
    """The encoder's and projector's FLOPs of one training step on 3 images, as torch's counter
    sees them (every matmul, convolution and their gradients that autograd computes), equal
    3 x vision_flops_per_image. Attention through the math backend: its matmuls are counted
    whatever fused kernels the CPU build has."""
    c = tiny_config(**vision)
    model = BaselineVLM(c, freeze_vision=frozen)
    images = torch.randn(3, 3, 28, 28)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        with torch.set_grad_enabled(not frozen):
            feats = model.vit(images)
        model.projector(feats).square().sum().backward()
    assert counter.get_total_flops() == 3 * vision_flops_per_image(c, frozen)
