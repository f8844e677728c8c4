"""loss.png: written from metrics.jsonl; without matplotlib (the `plot` extra) a run still ends
well, with a warning naming the extra instead of a loss.png."""

import json
import logging
import sys

from meshtrain.services.trainer.metrics import plot_losses


def _metrics(run_dir):
    rows = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 6)] + [
        {"step": 5, "eval_loss": 4.7}
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_loss_png_is_written(tmp_path):
    _metrics(tmp_path)
    out = plot_losses(tmp_path)
    assert out == tmp_path / "loss.png" and out.read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_there_is_no_plot_and_a_warning_names_the_extra(
    tmp_path, monkeypatch, caplog
):
    _metrics(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.WARNING, logger="meshtrain.train"):
        assert plot_losses(tmp_path) is None
    assert not (tmp_path / "loss.png").exists()
    assert "meshtrain[plot]" in caplog.text


def test_every_row_carries_a_unix_timestamp(tmp_path):
    import time

    from meshtrain.services.trainer.metrics import MetricsLog, read_metrics

    before = time.time()
    m = MetricsLog(tmp_path, total_steps=2, start_step=0, progress="lines")
    m.step(
        {
            "step": 1,
            "loss": 5.0,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 10.0,
            "step_time_s": 0.1,
        }
    )
    m.eval(1, 4.9)
    m.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(
        isinstance(r["time"], float) and before <= r["time"] <= time.time() for r in rows
    )
