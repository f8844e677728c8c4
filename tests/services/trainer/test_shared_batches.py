"""A tensor-parallel group pulls its batches once: the first rank reads, the peers receive the
same Batch objects bit for bit; a failed read is an error on every peer, not a hang; and a
tp=2 training run through the data service equals the in-process one with one stream per group."""

import pytest

from meshtrain.services.dataloader.spec import DatasetSpec
from tests.dist_utils import run_ranks
from tests.services.dataloader.conftest import served_limits, write_dataset
from tests.services.trainer.conftest import corpus_cache, small_job_args  # noqa: F401 (fixture)

pytestmark = pytest.mark.dist


class _FailsAt:
    """A batch source whose `step` raises, as a data client that gave up does."""

    def __init__(self, source, step):
        self.source, self.step = source, step
        self.num_micro_batches, self.num_steps = source.num_micro_batches, source.num_steps

    def micro_batches(self, step):
        if step == self.step:
            from meshtrain.services.common.errors import DataError

            raise DataError("no data worker served anything")
        return self.source.micro_batches(step)


def _share(rank, world, spec, fail_at):
    import torch
    import torch.distributed as dist

    from meshtrain.services.common.errors import DataError
    from meshtrain.services.dataloader.loader import BatchOptions, LocalBatchSource
    from meshtrain.services.dataloader.spec import open_dataset
    from meshtrain.services.trainer.shared_batches import GroupSharedSource

    group = dist.new_group([0, 1], backend="gloo")
    options = BatchOptions(eod_id=0, mask_eod_loss=True, document_ids=True, position_ids=True)
    local = LocalBatchSource(open_dataset(spec), 2, 8, 0, 1, options=options)
    source = _FailsAt(local, fail_at) if rank == 0 else None
    shared = GroupSharedSource(source, group, src=0, shape_of=local)
    out = []
    for step in range(3):
        try:
            batches = shared.micro_batches(step)
        except DataError as e:
            out.append(str(e))
            continue
        for got, want in zip(batches, local.micro_batches(step), strict=True):
            assert (got.step, got.microbatch) == (want.step, want.microbatch)
            for name in ("tokens", "labels", "loss_mask", "document_ids", "position_ids"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype and torch.equal(a, b), name
        out.append("ok")
    return out, shared.pulls


def test_peers_get_the_readers_batches_and_its_failure(tmp_path):
    spec = DatasetSpec(
        (write_dataset(tmp_path / "a", 1),),
        (1.0,),
        seq_length=32,
        num_samples=64,
        seed=7,
        split="100,0,0",
    )
    results = run_ranks(_share, 2, spec, 1, timeout=120)
    (reader, pulls), (peer, peer_pulls) = results
    assert reader == ["ok", "no data worker served anything", "ok"]
    assert peer[0] == peer[2] == "ok"
    assert (
        "rank 0, which reads the data for its tensor-parallel group, failed to read step 1"
        in peer[1]
    )
    assert (pulls, peer_pulls) == (2, 0)


def _train(rank, world, args):
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer

    trainer = Trainer(load_config(args))
    result = trainer.run()
    source = trainer.data.train
    return result.losses, getattr(source, "reads", None), getattr(source, "pulls", None)


@pytest.mark.e2e
def test_a_tensor_parallel_group_pulls_once_and_trains_as_in_process(corpus_cache, tmp_path):  # noqa: F811
    from meshtrain.services.dataloader.rpc.server import start_server

    extra = {"train.train_iters": 4, "train.eval_interval": 0, "parallel.tp": 2}
    local = run_ranks(
        _train, 2, small_job_args(corpus_cache, tmp_path / "local", **extra), timeout=240
    )
    server, port, _ = start_server(0, limits=served_limits())
    try:
        args = small_job_args(
            corpus_cache,
            tmp_path / "service",
            **extra,
            **{"data.service_addresses": f'["127.0.0.1:{port}"]'},
        )
        remote = run_ranks(_train, 2, args, timeout=240)
    finally:
        server.stop(0)
    assert [r[0] for r in remote] == [r[0] for r in local]
    assert [(r[1], r[2]) for r in remote] == [(True, 4), (False, 0)]
