"""TensorBoard and W&B beside metrics.jsonl: a short real run's events (read back with
TensorBoard's EventAccumulator) and offline W&B run file hold the rows' scalars at their steps;
a tracker whose package is missing is refused naming the extra."""

import glob
import json
import struct
import sys

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer import tracking
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.config.sections import LogConfig
from meshtrain.services.trainer.metrics import read_metrics
from meshtrain.services.trainer.train import train
from tests.services.trainer.conftest import small_job_args

SCALARS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "consumed_samples",
    "max_rss_gib",
)


def short_run(corpus_cache, tmp_path, **extra):
    args = small_job_args(
        corpus_cache,
        tmp_path / "run",
        **{"train.train_iters": 3, "train.eval_interval": 3, "train.eval_iters": 2, **extra},
    )
    train(load_config(args))
    return read_metrics(tmp_path / "run" / "metrics.jsonl")


def expected(rows):
    """{name: {step: value}} of the rows' scalars."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in tracking.scalars(row).items():
            out.setdefault(key, {})[row["step"]] = value
    return out


def test_tensorboard_events_hold_the_rows_scalars(corpus_cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = short_run(corpus_cache, tmp_path, **{"log.tensorboard_dir": str(tmp_path / "tb")})
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    want = expected(rows)
    assert set(SCALARS) | {"eval_loss"} <= set(want)
    assert set(events.Tags()["scalars"]) == set(want)
    for tag, by_step in want.items():
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert got == pytest.approx(by_step, rel=1e-6), tag  # TensorBoard stores float32
    assert sorted(want["loss"]) == [1, 2, 3] and list(want["eval_loss"]) == [3]


def read_wandb_records(path):
    """The protobuf records of a W&B run file (a LevelDB-style log: 32 KiB blocks of records with
    a 7-byte header each, checksum, length and type; full=1, first=2, middle=3, last=4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = open(path, "rb").read()
    block, pos, records, part = 32768, 7, [], b""  # 7: the file header (":W&B", magic, version)
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0:
            break
        part += raw[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def test_wandb_offline_run_holds_the_rows_scalars(corpus_cache, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in (
        "WANDB_CONFIG_DIR",
        "WANDB_CACHE_DIR",
        "WANDB_DATA_DIR",
    ):  # nothing written to the home folder
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    rows = short_run(corpus_cache, tmp_path, **{"log.wandb_project": "meshtrain-test"})
    (path,) = glob.glob(str(tmp_path / "run" / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = read_wandb_records(path)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "run" and run.project == "meshtrain-test"
    assert run.run_id == (tmp_path / "run" / "wandb_run_id").read_text().strip()
    got: dict[str, dict[int, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            for key, value in items.items():
                if not key.startswith("_"):
                    got.setdefault(key, {})[items["_step"]] = value
    flat = {
        (key, step): value
        for key, by_step in expected(rows).items()
        for step, value in by_step.items()
    }
    assert {
        (key, step): value for key, by_step in got.items() for step, value in by_step.items()
    } == pytest.approx(flat, rel=1e-12)


def test_a_tracker_without_its_package_is_refused_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if absent
    with pytest.raises(
        ConfigError,
        match=r"--tensorboard-dir\) needs the tensorboard package: pip install "
        r"'meshtrain\[tensorboard\]'",
    ):
        tracking.TensorBoardTracker(str(tmp_path / "tb"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        ConfigError, match=r"needs the wandb package: pip install 'meshtrain\[wandb\]'"
    ):
        tracking.WandbTracker(LogConfig(wandb_project="p"), tmp_path, {})
    missing = {"wandb"}
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util, "find_spec", lambda name: None if name in missing else real(name)
    )
    tracking.require_packages(LogConfig(tensorboard_dir=str(tmp_path)))
    with pytest.raises(
        ConfigError, match=r"log.wandb_project='p' \(--wandb-project\) needs the wandb package"
    ):
        tracking.require_packages(LogConfig(wandb_project="p"))


def test_scalars_are_the_finite_numbers_of_a_row():
    row = {
        "step": 4,
        "time": 1.5,
        "loss": 2.0,
        "consumed_samples": 64,
        "checkpoint_error": "disk full",
        "mfu": float("nan"),
        "flag": True,
    }
    assert tracking.scalars(row) == {"loss": 2.0, "consumed_samples": 64.0}
