"""The trainer reads through one interface: training via the data service equals in-process."""

import pytest

from meshtrain.services.dataloader.rpc.client import ServiceBatchSource
from meshtrain.services.dataloader.rpc.server import start_server
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.services.dataloader.conftest import served_limits
from tests.services.trainer.conftest import corpus_cache, small_job_args  # noqa: F401 (fixture)


@pytest.mark.e2e
def test_training_through_the_service_equals_in_process(corpus_cache, tmp_path):  # noqa: F811
    """fp32 on CPU with the same batches is deterministic, so losses must match exactly."""
    extra = {"train.train_iters": 6, "train.eval_interval": 3, "log.log_interval": 1}
    local = train(load_config(small_job_args(corpus_cache, tmp_path / "local", **extra)))
    server, port, _ = start_server(0, limits=served_limits())
    try:
        job = load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "service",
                **extra,
                **{"data.service_addresses": f'["127.0.0.1:{port}"]'},
            )
        )
        assert job.data.service_addresses == [f"127.0.0.1:{port}"]
        remote = train(job)
    finally:
        server.stop(0)
    assert remote.losses == local.losses
    assert remote.eval_losses == local.eval_losses


def test_build_data_picks_the_service_when_given_addresses(corpus_cache, tmp_path):  # noqa: F811
    from meshtrain.services.trainer.data import build_data

    job = load_config(
        small_job_args(
            corpus_cache, tmp_path / "r", **{"data.service_addresses": '["127.0.0.1:1"]'}
        )
    )
    data = build_data(job)
    assert isinstance(data.train, ServiceBatchSource) and isinstance(data.valid, ServiceBatchSource)
    assert data.train.num_micro_batches == 2


def test_build_data_gives_each_context_parallel_rank_its_chunks_in_process_and_from_the_service(
    corpus_cache, tmp_path
):  # noqa: F811
    import torch

    from meshtrain.services.dataloader.loader import context_positions
    from meshtrain.services.trainer.data import build_data

    job = load_config(small_job_args(corpus_cache, tmp_path / "r", **{"data.eod_mask_loss": True}))
    full = build_data(job, dp_rank=1, dp_size=2)
    server, port, _ = start_server(0, limits=served_limits())
    try:
        service_job = load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "s",
                **{"data.eod_mask_loss": True, "data.service_addresses": f'["127.0.0.1:{port}"]'},
            )
        )
        for rank in range(2):
            pos = torch.from_numpy(context_positions(64, rank, 2))
            local = build_data(job, dp_rank=1, dp_size=2, cp_rank=rank, cp_size=2)
            remote = build_data(service_job, dp_rank=1, dp_size=2, cp_rank=rank, cp_size=2)
            try:
                for split, step in (("train", 1), ("valid", 0)):
                    want = getattr(full, split).micro_batches(step)
                    for source in (getattr(local, split), getattr(remote, split)):
                        assert (source.cp_rank, source.cp_size) == (rank, 2)
                        for got, w in zip(source.micro_batches(step), want, strict=True):
                            assert got.tokens.shape == (8, 32)
                            assert torch.equal(got.tokens, w.tokens[:, pos])
                            assert torch.equal(got.labels, w.labels[:, pos])
                            assert torch.equal(got.loss_mask, w.loss_mask[:, pos])
            finally:
                remote.train.close()
                remote.valid.close()
    finally:
        server.stop(0)
