"""benchmarks/post_training.py end to end on CPU at a tiny size (the GPU rows are measured on
an H100/H200), and the plain baseline's packed-document path it compares against."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.baseline_gpt import BaselineGPT
from meshtrain.services.common.model_config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


def llama(seq: int = 64) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=seq,
        vocab_size=300,
        normalization="rmsnorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )


def _packed_against_alone(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the second document's loss packed after the first with document ids and positions, the
    same packed without them, the second document run alone)."""
    torch.manual_seed(0)
    model = BaselineGPT(llama()).to(device)
    tokens = torch.randint(0, 300, (1, 64), device=device)
    labels = torch.randint(0, 300, (1, 64), device=device)
    first = 24
    docs = (torch.arange(64, device=device) >= first).int()[None]
    positions = torch.cat([torch.arange(first), torch.arange(64 - first)]).int()[None].to(device)
    mask = docs.float()  # the loss on the second document only
    with torch.no_grad():
        packed = model(tokens, labels, mask, docs, positions)
        unmasked = model(tokens, labels, mask)
        alone = model(tokens[:, first:], labels[:, first:])
    return packed, unmasked, alone


def test_baseline_keeps_attention_and_positions_inside_each_packed_document():
    packed, unmasked, alone = _packed_against_alone("cpu")
    assert packed.item() == pytest.approx(alone.item(), rel=1e-5)
    assert abs(unmasked.item() - alone.item()) > 1e-3  # without the ids it attends across


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's path is CUDA's")
def test_baseline_flex_attention_document_mask_matches_the_document_alone():
    packed, unmasked, alone = _packed_against_alone("cuda")
    assert packed.item() == pytest.approx(alone.item(), rel=1e-3)
    assert abs(unmasked.item() - alone.item()) > 1e-3


@pytest.mark.e2e
def test_post_training_runs_every_side_and_writes_the_ratios(tmp_path):
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/post_training.py",
        *("--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2", "--ffn", "128"),
        *("--seq", "128", "--vocab", "512", "--mbs", "2", "--gbs", "4"),
        *("--steps", "1", "--warmup", "1", "--conversations", "40", "--doc-median", "20"),
        *("--device", "cpu", "--work-dir", str(tmp_path / "work"), "--out", str(out)),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["results"]
    assert set(rows) == {"sft_masked", "sft_unmasked", "baseline_masked", "dpo"}
    assert result["skipped"] == [] and result["failed"] == {}
    for row in rows.values():
        assert row["step_time_s"] > 0 and len(row["step_times_s"]) == 1
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_time_s"])
        assert row["mfu"] is None  # no known peak on CPU
        assert math.isfinite(row["loss_last"])
    assert rows["dpo"]["tokens_per_step"] == 2 * rows["sft_masked"]["tokens_per_step"] == 1024
    # the precomputed reference column is the policy's own start: the first DPO loss is log 2
    assert rows["dpo"]["loss_first"] == pytest.approx(math.log(2), abs=1e-4)
    assert result["sft_masked_vs_unmasked"] == pytest.approx(
        rows["sft_masked"]["tokens_per_s"] / rows["sft_unmasked"]["tokens_per_s"]
    )
    assert result["sft_masked_vs_baseline"] == pytest.approx(
        rows["sft_masked"]["tokens_per_s"] / rows["baseline_masked"]["tokens_per_s"]
    )
    assert result["dpo_vs_twice_sft"] == pytest.approx(
        rows["dpo"]["step_time_s"] / (2 * rows["sft_unmasked"]["step_time_s"])
    )
    for key in ("sft_masked_vs_unmasked", "sft_masked_vs_baseline", "dpo_vs_twice_sft"):
        assert isinstance(result[key + "_meets_goal"], bool) and key in result["goals"]
    docs = result["documents"]
    assert docs["conversations"] == 40 and "lognormal" in docs["asked"]
    assert docs["tokens_min_max"][1] <= 129
    packing = result["packing"]
    assert packing["documents_per_sequence"] > 1  # packed: several conversations a sequence
    assert 0 < packing["attention_share"] < 1
    assert result["config"]["seq"] == 128 and result["device"]
    assert result["flops_per_token"] > 0 and result["parameters"] > 0
    assert "wrote" in done.stdout
