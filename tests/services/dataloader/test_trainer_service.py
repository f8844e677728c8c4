"""The trainer reads through one interface: training via the data service equals in-process."""

import pytest

from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.rpc.server import start_server
from meshtrain.services.trainer.config import load_config
from meshtrain.services.trainer.train import train
from tests.services.trainer.conftest import corpus_cache, small_job_args  # noqa: F401 (fixture)


@pytest.mark.e2e
def test_training_through_the_service_equals_in_process(corpus_cache, tmp_path):  # noqa: F811
    """fp32 on CPU with the same batches is deterministic, so losses must match exactly."""
    extra = {"train.train_iters": 6, "train.eval_interval": 3, "log.log_interval": 1}
    local = train(load_config(small_job_args(corpus_cache, tmp_path / "local", **extra)))
    server, port, _ = start_server(0)
    try:
        job = load_config(small_job_args(corpus_cache, tmp_path / "service", **extra,
                                         **{"data.service_addresses": f"[\"127.0.0.1:{port}\"]"}))
        assert job.data.service_addresses == [f"127.0.0.1:{port}"]
        remote = train(job)
    finally:
        server.stop(0)
    assert remote.losses == local.losses
    assert remote.eval_losses == local.eval_losses


def test_build_data_picks_the_service_when_given_addresses(corpus_cache, tmp_path):  # noqa: F811
    from meshtrain.services.trainer.data import build_data

    job = load_config(small_job_args(corpus_cache, tmp_path / "r", **{"data.service_addresses": "[\"127.0.0.1:1\"]"}))
    data = build_data(job)
    assert isinstance(data.train, ServiceBatchSource) and isinstance(data.valid, ServiceBatchSource)
    assert data.train.num_micro_batches == 2
