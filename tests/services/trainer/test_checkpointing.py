"""The trainer's Checkpointer against a real checkpoint service: what it leaves open."""

import pytest

from meshtrain.services.checkpoint.rpc.server import start_server
from meshtrain.services.trainer.checkpoint_saver import Checkpointer
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.parallel.mesh import Mesh


def test_close_closes_the_channel_to_the_service(tmp_path):
    # close() used to stop only the upload thread; the gRPC channel stayed open until the
    # garbage collector found it (a long-lived process creating trainers leaked one per run).
    server, port, _ = start_server(str(tmp_path / "ckpt"))
    try:
        checkpointer = Checkpointer(
            str(tmp_path / "ckpt"), Parallel(Mesh.single()), service_address=f"127.0.0.1:{port}"
        )
        assert checkpointer.sink.list() == []  # connected
        checkpointer.close()
        with pytest.raises(ValueError, match="closed channel"):
            checkpointer.sink.list()
        checkpointer.close()  # twice is harmless
    finally:
        server.stop(0)


def test_a_save_started_while_the_service_restarts_is_retried(corpus_cache, tmp_path):
    # BeginSave was the one call of a save not retried: a checkpoint service restarting as a
    # save began (a stop's last save, say) cost that save, though its writes and commit are
    # retried through the same outage.
    import threading

    from meshtrain.services.checkpoint.reader import list_checkpoints
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer
    from tests.services.trainer.conftest import small_job_args

    root = str(tmp_path / "ckpt")
    server, port, _ = start_server(root)
    trainer = Trainer(
        load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "run",
                **{
                    "checkpoint.save": root,
                    "checkpoint.service_address": f"127.0.0.1:{port}",
                    "checkpoint.async_save": False,
                    "checkpoint.save_attempts": 5,
                    "checkpoint.save_retry_backoff_s": 0.5,
                },
            )
        )
    )
    restarted = []
    try:
        trainer.train_step(0)
        trainer.state.iteration = 1
        server.stop(0).wait()
        restart = threading.Timer(0.6, lambda: restarted.append(start_server(root, port=port)[0]))
        restart.start()
        url = trainer.save()  # the first BeginSave finds nothing listening
        restart.join()
        assert url.endswith("step_00000001")
        assert list_checkpoints(root) == [1]
    finally:
        trainer.checkpointer.close()
        for s in [server, *restarted]:
            s.stop(0)


def test_save_attempts_and_backoff_are_checked():
    from meshtrain.services.common.errors import ConfigError
    from meshtrain.services.trainer.config.load import load_config

    with pytest.raises(ConfigError, match="save_attempts must be >= 1, got 0"):
        load_config(["--checkpoint.save_attempts=0"])
    with pytest.raises(ConfigError, match=r"save_retry_backoff_s must be in \[0, 3600\], got -1.0"):
        load_config(["--checkpoint.save_retry_backoff_s=-1"])
    with pytest.raises(
        ConfigError, match=r"save_retry_timeout_s must be in \[0, 86400\], got -1.0"
    ):
        load_config(["--checkpoint.save_retry_timeout_s=-1"])
    # long enough for `meshtrain up` to restart a checkpoint service mid-save
    assert load_config([]).checkpoint.save_retry_timeout_s >= 30


def _save_into_a_taken_step(rank, world, args, root):
    """The CheckpointError each rank's save of step 3 gives (another run committed step 3 after
    this one started), or None."""
    import torch
    import torch.distributed as dist

    from meshtrain.services.checkpoint.writer import save_checkpoint
    from meshtrain.services.common.errors import CheckpointError
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer

    trainer = Trainer(load_config(args))
    if rank == 0:
        save_checkpoint(root, 3, {"w": torch.zeros(2)}, {"run": "another"})
    dist.barrier()
    trainer.state.iteration = 3
    try:
        trainer.save()
    except CheckpointError as e:
        return str(e)
    finally:
        trainer.checkpointer.close()
    return None


@pytest.mark.dist
def test_a_save_rank_0_cannot_start_fails_on_every_rank(corpus_cache, tmp_path):
    # Rank 0 raised and the other ranks waited for the save id in a broadcast that never came,
    # until the process group's timeout.
    from tests.dist_utils import run_ranks
    from tests.services.trainer.conftest import small_job_args

    root = str(tmp_path / "ckpt")
    args = small_job_args(
        corpus_cache, tmp_path / "run", **{"checkpoint.save": root, "train.eval_interval": 0}
    )
    errors = run_ranks(_save_into_a_taken_step, 2, args, root, timeout=120)
    assert all(e is not None and "step 3 already exists" in e for e in errors), errors


def _fail_with_a_save_in_flight(rank, world, args):
    """Rank 1's fragment of the save of step 4 never comes (its upload is a no-op: a dead
    writer); rank 0 then fails and closes as the trainer does. Returns rank 0's seconds in
    `close_after_failure`."""
    import time

    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer

    trainer = Trainer(load_config(args))
    saver = trainer.checkpointer.saver
    saver.commit_timeout = 30  # the old code waited this long for rank 1 (600 s by default)
    if rank == 1:
        saver._upload = lambda *a, **k: None
    trainer.state.iteration = 4
    trainer.save()
    if rank == 1:
        trainer.checkpointer.close()
        return None
    time.sleep(1.0)  # rank 0's own fragment is stored; its commit waits for rank 1's
    start = time.monotonic()
    trainer.checkpointer.close_after_failure()
    return time.monotonic() - start


@pytest.mark.dist
def test_a_failing_run_gives_up_its_service_mode_save_at_once(corpus_cache, tmp_path):
    # Without the service, close_after_failure makes rank 0 stop waiting for a writer that never
    # reports; in service mode the service's Commit kept waiting for it until its timeout (600 s),
    # so a failing run's rank 0 could not exit. Now the saver tells the service (AbortSave).
    from meshtrain.services.checkpoint.rpc.client import CheckpointClient
    from tests.dist_utils import run_ranks
    from tests.services.trainer.conftest import small_job_args

    root = str(tmp_path / "ckpt")
    server, port, _ = start_server(root)
    try:
        args = small_job_args(
            corpus_cache,
            tmp_path / "run",
            **{
                "checkpoint.save": root,
                "checkpoint.service_address": f"127.0.0.1:{port}",
                "train.eval_interval": 0,
            },
        )
        seconds, _ = run_ranks(_fail_with_a_save_in_flight, 2, args, timeout=120)
        assert seconds < 10, seconds
        with CheckpointClient(f"127.0.0.1:{port}") as client:
            assert client.list() == []  # never committed
            client.begin_save(4, num_writers=1)  # the step is free for a later save
    finally:
        server.stop(0)


@pytest.mark.parametrize("zero1", [False, True])
def test_the_first_save_fills_the_buffers_prepared_when_the_trainer_was_built(
    corpus_cache, tmp_path, zero1
):
    # A run that saves lays out its boxes once the model is built (before AdamW has moments)
    # and allocates their host buffers in the background: the first save must find every
    # parameter and moment box among them, so its stall is a copy, not an allocation.
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer
    from tests.services.trainer.conftest import small_job_args

    extra = {"parallel.use_distributed_optimizer": True} if zero1 else {}
    trainer = Trainer(
        load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "run",
                **{"checkpoint.save": str(tmp_path / "ckpt"), **extra},
            )
        )
    )
    saver = trainer.checkpointer.saver
    try:
        saver._preparing.join()
        prepared = dict(saver._buffers)
        names = {key[0] for key in prepared}
        assert (
            any(n.startswith("optim.exp_avg_sq.") for n in names)
            and "embedding.word_embeddings.weight" in names
        )
        trainer.train_step(0)
        trainer.state.iteration = 1
        trainer.save()
        trainer.checkpointer.wait()
        fresh = {key for key in saver._buffers if key not in prepared}
        assert {name for name, _ in fresh} <= {
            "rng.torch_cpu"
        }  # only the generator state was not known ahead
        assert all(saver._buffers[k] is buf for k, buf in prepared.items())
    finally:
        trainer.checkpointer.close()
