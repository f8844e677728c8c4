"""loss.png: written from metrics.jsonl; without matplotlib (the `plot` extra) a run still ends
well, with a warning naming the extra instead of a loss.png."""

import json
import logging
import sys

from meshtrain.services.trainer.metrics import plot_losses


def _metrics(run_dir):
    rows = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 6)] + [{"step": 5, "eval_loss": 4.7}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_loss_png_is_written(tmp_path):
    _metrics(tmp_path)
    out = plot_losses(tmp_path)
    assert out == tmp_path / "loss.png" and out.read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_there_is_no_plot_and_a_warning_names_the_extra(tmp_path, monkeypatch, caplog):
    _metrics(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.WARNING, logger="meshtrain.train"):
        assert plot_losses(tmp_path) is None
    assert not (tmp_path / "loss.png").exists()
    assert "meshtrain[plot]" in caplog.text
