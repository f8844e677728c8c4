"""A training run whose checkpoint disk fills up, on a real small filesystem (a tmpfs; skipped
where it cannot be mounted): it trains on to its last step, says at every logged step that the
last save failed with the disk full (naming the root and the step) until a save commits, leaves
no partial step folder, and keeps the previous commit loadable. Its final save failing ends it."""

import json
import logging
import os

import pytest
import torch

from meshtrain.services.checkpoint.reader import latest_step, list_checkpoints
from meshtrain.services.common.errors import DiskFullError
from meshtrain.services.trainer.checkpointing import load_checkpoint
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.train import Trainer
from tests.services.trainer.conftest import small_job_args
from tests.small_disk import fill, small_disk

ROOM = (
    1 << 20
)  # bytes left free once filled: a checkpoint of the small model takes about 2.8 MB on disk


def _fill_after_the_first_save(trainer, disk, saved):
    """A train_step that, before step 3, waits for step 2's save to commit, keeps the parameters
    it saved in `saved` and fills the disk, so that the following saves find it full."""
    step_fn = trainer.train_step

    def step(i):
        if i == 2:
            trainer.checkpointer.settle()
            assert list_checkpoints(str(disk / "ckpt")) == [2]
            saved.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
            fill(disk, ROOM)
        return step_fn(i)

    trainer.train_step = step


def _assert_loaded_as_saved(model, saved):
    """The loaded parameters equal those saved (the vocabulary's padding rows are not stored)."""
    for name, param in model.named_parameters():
        rows = (
            model.vocab_size
            if name in ("embedding.word_embeddings.weight", "output_layer.weight")
            else None
        )
        assert torch.equal(param[:rows], saved[name][:rows]), name


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.e2e
def test_a_run_whose_disk_fills_trains_on_says_so_and_recovers(
    corpus_cache, tmp_path, caplog, async_save
):
    # A save that found the disk full was retried as an outage (for save_retry_timeout_s) and its
    # failure, raised by the next save, stopped the run mid-way, leaving its partial files to
    # fill the disk further.
    with small_disk(tmp_path / "disk", 16) as disk:
        root = disk / "ckpt"
        run = (
            tmp_path / "run"
        )  # the run directory is on another disk: only the checkpoints fill this one
        job = load_config(
            small_job_args(
                corpus_cache,
                run,
                **{
                    "train.train_iters": 12,
                    "train.eval_interval": 0,
                    "checkpoint.save_interval": 2,
                    "checkpoint.save": str(root),
                    "checkpoint.async_save": async_save,
                    "checkpoint.save_retry_timeout_s": 3600,
                },
            )
        )  # an outage's retry time: a full disk must not wait it out
        trainer = Trainer(job)
        saved = {}
        _fill_after_the_first_save(trainer, disk, saved)
        filled_step = trainer.train_step

        def step(i):
            if i == 7:  # before step 8, whose save comes next: step 6's save has failed
                trainer.checkpointer.settle()
                assert trainer.checkpointer.disk_full[0] == 6
                assert latest_step(str(root)) == 2
                assert os.listdir(root) == ["step_00000002"]  # the failed saves left nothing behind
                (disk / "filler").unlink()  # space is freed: the next save commits
            return filled_step(i)

        trainer.train_step = step
        with caplog.at_level(logging.INFO, logger="meshtrain"):
            result = trainer.run()
        assert sorted(result.losses) == list(range(1, 13)) and not result.stopped_early
        assert list_checkpoints(str(root)) == [2, 8, 10, 12]
        assert sorted(os.listdir(root)) == [f"step_{s:08d}" for s in (2, 8, 10, 12)]

        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        warned = {r["step"]: r["checkpoint_error"] for r in records if "checkpoint_error" in r}
        # From the logged step after step 4's save failed (step 5 once the failure is known;
        # an asynchronous save may take a step or two to fail) to the one before step 8's
        # commit is known, every logged step says so; none before or after.
        assert set(warned) >= {7, 8} and set(warned) <= set(range(5, 11)), sorted(warned)
        assert sorted(warned) == list(range(min(warned), max(warned) + 1))
        if not async_save:
            assert min(warned) == 5 and max(warned) == 8
        for s, message in warned.items():
            assert (
                f"disk full under {root}" in message
                and "latest committed checkpoint is step 2" in message
            )
            assert (
                "failed after 3 attempts: disk full" in message
            )  # checkpoint.save_attempts, not the hour
            assert (
                "checkpoint step 4 was not saved" in message
                or "checkpoint step 6 was not saved" in message
            )
        assert "checkpoint step 6 was not saved" in warned[8]
        lines = [
            r.getMessage()
            for r in caplog.records
            if "the last checkpoint save failed" in r.getMessage()
        ]
        assert len(lines) == len(warned) and all(
            r.levelno == logging.WARNING
            for r in caplog.records
            if "the last checkpoint save failed" in r.getMessage()
        )
        assert "checkpoint saves recovered: step 8 is committed" in caplog.text

        model = GPT(trainer.job.model)  # the step before the disk filled loads as it was saved
        assert load_checkpoint(str(root), model, step=2).iteration == 2
        _assert_loaded_as_saved(model, saved)


@pytest.mark.e2e
def test_a_run_whose_final_save_finds_the_disk_full_fails_naming_it(corpus_cache, tmp_path):
    # The final save's failure still ends the run with an error (as any failed final save does),
    # one that says the disk is full, where, and which checkpoint is the latest.
    with small_disk(tmp_path / "disk", 16) as disk:
        root = disk / "ckpt"
        job = load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "run",
                **{
                    "train.train_iters": 6,
                    "train.eval_interval": 0,
                    "checkpoint.save_interval": 2,
                    "checkpoint.save": str(root),
                },
            )
        )
        trainer = Trainer(job)
        saved = {}
        _fill_after_the_first_save(trainer, disk, saved)
        with pytest.raises(
            DiskFullError,
            match=rf"checkpoint step 6 was not saved: disk full under {root}: .*No space "
            r"left on device.*; nothing of it was committed; the latest committed "
            r"checkpoint is step 2",
        ):
            trainer.run()
        assert list_checkpoints(str(root)) == [2]
        assert os.listdir(root) == ["step_00000002"]
        model = GPT(trainer.job.model)
        assert load_checkpoint(str(root), model).iteration == 2
        _assert_loaded_as_saved(model, saved)


def _train_filling_the_disk(rank, world, args, disk):
    """One rank of a run whose disk rank 0 fills after step 2's commit and frees before step 8;
    returns (the steps whose losses it logged, its `disk_full` at the end)."""
    from pathlib import Path

    disk = Path(disk)
    trainer = Trainer(load_config(args))
    if rank == 0:
        step_fn = trainer.train_step

        def step(i):
            if i == 2:  # step 2's commit waited for every rank's part: nothing is being written now
                trainer.checkpointer.settle()
                fill(disk, ROOM)
            if i == 7:  # step 6's save has failed on rank 0 (rank 1 may still be writing its part)
                trainer.checkpointer.settle()
                assert trainer.checkpointer.disk_full[0] == 6
                (disk / "filler").unlink()
            return step_fn(i)

        trainer.train_step = step
    result = trainer.run()
    return sorted(result.losses), trainer.checkpointer.disk_full


@pytest.mark.dist
def test_a_tensor_parallel_run_whose_disk_fills_trains_on_on_every_rank(corpus_cache, tmp_path):
    # Both ranks write boxes of every save (tp=2): one's full disk fails the other's commit; every
    # rank trains on, and rank 0 removes the failed saves' folders once both ranks' writes ended.
    from tests.dist_utils import run_ranks

    with small_disk(tmp_path / "disk", 16) as disk:
        root = disk / "ckpt"
        run = tmp_path / "run"
        args = small_job_args(
            corpus_cache,
            run,
            **{
                "parallel.tp": 2,
                "train.train_iters": 12,
                "train.eval_interval": 0,
                "checkpoint.save_interval": 2,
                "checkpoint.save": str(root),
            },
        )
        results = run_ranks(_train_filling_the_disk, 2, args, str(disk), timeout=240)
        assert [losses for losses, _ in results] == [list(range(1, 13))] * 2
        assert [full for _, full in results] == [None, None]  # recovered on every rank
        assert list_checkpoints(str(root)) == [2, 8, 10, 12]
        assert sorted(os.listdir(root)) == [f"step_{s:08d}" for s in (2, 8, 10, 12)]
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        warned = sorted(r["step"] for r in records if "checkpoint_error" in r)
        assert 8 in warned and set(warned) <= set(range(5, 11)), warned
