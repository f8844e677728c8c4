"""benchmarks/fp8_loss_curve.py on CPU: real `meshtrain train` runs of a tiny model, read,
compared and plotted.

The GPU run (gpt2-350m, 1,000 steps) is in gpu_suite.sh's fp8 suite; here the runs are a few steps
long, so the tests check the plumbing (flags reach each run, every step is read, the numbers are the
logged ones, the plot is written), not FP8's accuracy.
"""

import json
import math
import statistics

import pytest

from benchmarks import fp8_loss_curve as curve
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.load import load_config

pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the `test` extra has it)")

TINY = [
    "--config",
    "deploy/configs/tiny.toml",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--seq-length",
    "32",
    "--data.tokenizer=byte",
    "--data.default_corpus_bytes=400000",
    "--model.num_layers=2",
    "--model.hidden_size=64",
]


def fp8_is_built() -> bool:
    try:
        load_config(["--bf16", "--train.fp8=hybrid"])
    except ConfigError:
        return False
    return True


def logged(run_dir) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.e2e
@pytest.mark.skipif(not fp8_is_built(), reason="train.fp8 is not a key of this tree's trainer yet")
def test_bf16_and_fp8_runs_are_read_compared_and_plotted(tmp_path):
    out, png = tmp_path / "curve.json", tmp_path / "curve.png"
    result = curve.main(
        [
            *TINY,
            "--steps",
            "5",
            "--tail",
            "3",
            "--skip",
            "1",
            "--smooth",
            "2",
            "--fp8-recipe",
            "tensorwise",
            "--fp8-extra=--train.fp8_margin=1",
            "--run-dir",
            str(tmp_path / "runs"),
            "--out",
            str(out),
            "--plot",
            str(png),
            f"--data.cache_dir={tmp_path / 'cache'}",
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    bf16, fp8 = result["runs"]["bf16"], result["runs"]["fp8"]
    # the flags reached each run: its resolved config.toml says so
    assert (
        fp8["fp8"]["fp8"] == "hybrid"
        and fp8["fp8"]["fp8_recipe"] == "tensorwise"
        and "fp8" not in bf16["fp8"]
    )
    assert (
        fp8["fp8"]["fp8_margin"] == 1 and bf16["fp8"]["fp8_margin"] == 0
    )  # --fp8-extra: the FP8 run's alone
    assert (bf16["micro_batch_size"], bf16["global_batch_size"], bf16["seq_length"]) == (2, 4, 32)
    assert (
        result["fp8_flags"]
        == "--train.fp8=hybrid --train.fp8_recipe=tensorwise --train.fp8_margin=1"
    )
    for name, run in result["runs"].items():
        records = logged(tmp_path / "runs" / name)
        assert run["losses"] == [r["loss"] for r in records] and len(records) == 5
        assert run["tail_mean_loss"] == pytest.approx(
            statistics.fmean(r["loss"] for r in records[-3:])
        )
        assert run["finite"]
    # same init and batches: FP8 rounding moves the first step's loss by far less than 1%
    assert fp8["losses"][0] == pytest.approx(bf16["losses"][0], rel=1e-2)
    rel = (fp8["tail_mean_loss"] - bf16["tail_mean_loss"]) / bf16["tail_mean_loss"]
    assert result["tail_mean_loss_rel_diff"] == pytest.approx(rel)
    assert result["within_tolerance"] == (abs(rel) <= 0.01)
    assert result["fp8_speedup"] == pytest.approx(fp8["tokens_per_s"] / bf16["tokens_per_s"])
    gaps = [(b - a) / a for a, b in zip(bf16["losses"], fp8["losses"])]
    worst = max(range(5), key=lambda i: abs(gaps[i]))
    assert (result["worst_step"], result["worst_step_rel_diff"]) == (
        worst + 1,
        pytest.approx(gaps[worst]),
    )
    assert png_size(png) == (880, 660)
    assert (tmp_path / "runs" / "fp8.log").read_text().count("step 5/5") == 1


@pytest.mark.e2e
def test_two_real_runs_read_and_plot_through_the_same_path(tmp_path):
    """The bf16 run against a second bf16 run at another learning rate, through
    train/read_run/summarize/compare/plot as main() does: what is read is what each run logged,
    whichever FP8 the tree has."""
    args, overrides = curve.parse_args(
        [
            *TINY,
            "--steps",
            "4",
            "--tail",
            "2",
            "--skip",
            "1",
            f"--data.cache_dir={tmp_path / 'cache'}",
        ]
    )
    runs = {}
    for name, extra in (("bf16", []), ("fp8", ["--optim.lr=2e-2"])):
        run_dir = curve.train(
            name, curve.run_flags(args, overrides, False) + extra, tmp_path / "runs", 240
        )
        runs[name] = curve.summarize(curve.read_run(run_dir, 4), tail=2, skip=1)
        records = logged(run_dir)
        assert runs[name]["losses"] == [r["loss"] for r in records]
        timed = records[1:]
        assert runs[name]["tokens_per_s"] == pytest.approx(
            32 * 4 * 3 / sum(r["step_time_s"] for r in timed)
        )
    bf16, other = runs["bf16"], runs["fp8"]
    assert (
        bf16["losses"][0] == other["losses"][0]
    )  # same init and first batch; the rate acts from step 1's update
    assert bf16["losses"][-1] != other["losses"][-1]
    result = {
        "config": "deploy/configs/tiny.toml",
        "steps": 4,
        "tokens_per_step": 128,
        **curve.compare(bf16, other, tail=2, tolerance=0.01),
        "runs": runs,
    }
    assert result["tail_mean_loss_rel_diff"] == pytest.approx(
        statistics.fmean(other["losses"][-2:]) / statistics.fmean(bf16["losses"][-2:]) - 1
    )
    curve.plot(result, tmp_path / "plot.png", window=2)
    assert png_size(tmp_path / "plot.png") == (880, 660)


def test_a_run_that_fails_is_named_with_its_log(tmp_path):
    args, overrides = curve.parse_args(
        [*TINY, "--steps", "2", "--tail", "1", "--skip", "1", "--model.no_such_key=1"]
    )
    with pytest.raises(RuntimeError, match=r"the bf16 run failed \(exit [1-9]") as failed:
        curve.train("bf16", curve.run_flags(args, overrides, False), tmp_path, 120)
    assert "no_such_key" in str(failed.value)  # the log's tail: the trainer's own error


def test_metrics_with_a_missing_or_repeated_step_are_refused(tmp_path):
    (tmp_path / "config.toml").write_text("[train]\nmicro_batch_size = 2\n")
    rows = [
        {"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 100.0, "step_time_s": 1.0}
        for s in (1, 2, 3)
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
        + json.dumps({"step": 3, "eval_loss": 4.0})
        + "\n"
    )
    assert [r["step"] for r in curve.read_run(tmp_path, 3)["records"]] == [
        1,
        2,
        3,
    ]  # the eval record is not a step
    with pytest.raises(ValueError, match="1 of steps 1..4 not logged \\(first: 4\\)"):
        curve.read_run(tmp_path, 4)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[-1:]))
    with pytest.raises(ValueError, match="step 3 logged twice"):
        curve.read_run(tmp_path, 3)
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "metrics.jsonl").write_text("")
    with pytest.raises(FileExistsError, match="holds an earlier run's metrics.jsonl"):
        curve.train("bf16", [], tmp_path, None)


def test_a_diverged_run_is_written_as_nulls_and_never_within_tolerance():
    records = [
        {"loss": x, "tokens_per_s": 10.0, "step_time_s": 2.0}
        for x in (5.0, 4.0, math.nan, math.inf)
    ]
    run = curve.summarize(
        {"records": records, "train": {"fp8": "hybrid"}, "model": {}}, tail=2, skip=1
    )
    assert (
        run["losses"] == [5.0, 4.0, None, None]
        and not run["finite"]
        and run["tail_mean_loss"] is None
    )
    assert json.loads(json.dumps(run, allow_nan=False))["tail_mean_loss"] is None
    ok = curve.summarize({"records": records[:2] * 2, "train": {}, "model": {}}, tail=2, skip=1)
    assert ok["tail_mean_loss"] == 4.5 and ok["tokens_per_s"] == 10.0
    result = curve.compare(ok, run, tail=2, tolerance=0.01)
    assert result["tail_mean_loss_rel_diff"] is None and not result["within_tolerance"]
    assert (result["worst_step"], result["worst_step_rel_diff"]) == (
        1,
        0.0,
    )  # the non-finite steps left out


def test_smooth_is_a_trailing_mean():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0]
    assert curve.smooth(values, 3) == pytest.approx(
        [statistics.fmean(values[max(0, i - 2) : i + 1]) for i in range(6)]
    )
    assert curve.smooth(values, 1) == values


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tail", "20", "--steps", "10"], "--tail (20) must be at most --steps (10)"),
        (
            ["--micro-batch-size", "3", "--global-batch-size", "8"],
            "must be a multiple of --micro-batch-size (3)",
        ),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--fp8-recipe", "blockwise"], "invalid choice: 'blockwise'"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        curve.parse_args(argv)
    assert message in capsys.readouterr().err
