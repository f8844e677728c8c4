"""benchmarks/rollout_decode.py: the plain static-cache decoder it measures the rollout engine
against gives the uncached model's tokens, and the script runs end to end on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.baseline_gpt import BaselineGPT, StaticDecoder
from meshtrain.services.common.model_config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


def _config(position: str) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=32,
        vocab_size=97,
        normalization="rmsnorm",
        activation="swiglu",
        position_embedding_type=position,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )


def _full_logits(model: BaselineGPT, idx: torch.Tensor) -> torch.Tensor:
    """The uncached forward's logits of the last position."""
    s = idx.shape[1]
    x = model.wte(idx)
    if model.wpe is not None:
        x = x + model.wpe(torch.arange(s))
    cos = model.cos[:s] if model.cos is not None else None
    sin = model.sin[:s] if model.sin is not None else None
    for blk in model.blocks:
        x = blk(x, cos, sin)
    return model.head(model.ln_f(x))[:, -1, : model.c.vocab_size]


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_static_decoder_greedy_tokens_are_the_uncached_models(position):
    torch.manual_seed(0)
    model = BaselineGPT(_config(position)).eval()
    prompts = torch.randint(0, 97, (3, 5))
    decoder = StaticDecoder(model, batch=3, context=12)
    tokens, logps = decoder.generate(prompts, 7, temperature=0.0)
    seq = prompts
    with torch.no_grad():
        for step in range(7):
            logits = _full_logits(model, seq).float()
            want = logits.argmax(-1)
            assert [row[step] for row in tokens] == want.tolist()
            want_lp = logits.log_softmax(-1).gather(-1, want[:, None]).squeeze(-1)
            got_lp = torch.tensor([row[step] for row in logps])
            torch.testing.assert_close(got_lp, want_lp, atol=1e-4, rtol=1e-4)
            seq = torch.cat([seq, want[:, None]], 1)


@pytest.mark.e2e
def test_runs_on_cpu_and_writes_every_field(tmp_path):
    out = tmp_path / "rollout.json"
    subprocess.run(
        [sys.executable, "benchmarks/rollout_decode.py", "--tiny", "--device", "cpu"]
        + ["--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["config"]["batch"] == 4 and result["config"]["model"]["num_layers"] == 2
    for side in ("meshtrain", "baseline"):
        r = result[side]
        assert r["generated_tokens_per_s"] > 0 and r["prefill_s"] > 0
        assert r["generated_tokens_per_s"] == pytest.approx(4 * 8 / r["total_s"])
        assert "decode_tokens_per_s" in r and r["mfu"] is None  # no peak known on CPU
    assert result["ratio"]["generated_tokens_per_s"] == pytest.approx(
        result["meshtrain"]["generated_tokens_per_s"] / result["baseline"]["generated_tokens_per_s"]
    )
    g = result["grpo"]
    assert len(g["steps"]) == 2 and g["completions_per_step"] == 8
    for step in g["steps"]:
        assert 0 < step["generate_s"] < step["wall_s"]
    assert g["generate_share"] + g["train_share"] == pytest.approx(1.0)
    assert 0 < g["generate_share"] < 1
    assert g["steps_per_hour"] == pytest.approx(3600 / g["step_s"])
    # on CPU nothing is captured, and the JSON says why
    assert result["config"]["cuda_graphs"] is True and g["cuda_graphs"] is False
    m = result["meshtrain"]
    assert m["cuda_graphs"] is False and m["cuda_graphs_captured"] == 0
    assert "CUDA" in m["cuda_graphs_skipped"]
    assert result["skipped"] == [] and result["elapsed_s"] > 0
