"""Where a run starts (services/trainer/resume.py): what `--load` resumes, a fresh start in an
empty root saved into, damaged steps, and the checks that a resume continues the saved run."""

import logging

import pytest

from meshtrain.services.checkpoint.reader import list_checkpoints
from meshtrain.services.common.errors import CheckpointError, ConfigError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.services.trainer.conftest import small_job_args

# Each test trains a run and resumes it: end to end, out of `make test-fast`.
pytestmark = pytest.mark.e2e


def test_load_of_the_root_saved_into_starts_fresh_while_it_is_empty(corpus_cache, tmp_path, caplog):
    # Megatron's requeue idiom: the same `--load X --save X` command for the first launch and
    # every relaunch. It used to fail on the first with "no committed checkpoint".
    root = str(tmp_path / "ckpt")
    common = {"train.eval_interval": 0, "checkpoint.load": root, "checkpoint.save": root}
    with caplog.at_level(logging.WARNING, logger="meshtrain.train"):
        first = train(
            load_config(
                small_job_args(corpus_cache, tmp_path / "r1", **common, **{"train.train_iters": 2})
            )
        )
    assert sorted(first.losses) == [1, 2] and list_checkpoints(root) == [2]
    assert "no committed checkpoint under" in caplog.text and "starting from step 0" in caplog.text
    again = train(
        load_config(
            small_job_args(corpus_cache, tmp_path / "r2", **common, **{"train.train_iters": 4})
        )
    )
    assert sorted(again.losses) == [3, 4] and list_checkpoints(root) == [2, 4]
    # an explicit step, or a --load of another root, still has to exist
    with pytest.raises(CheckpointError, match="no committed checkpoint for step 1 under"):
        train(
            load_config(
                small_job_args(
                    corpus_cache, tmp_path / "r3", **common, **{"checkpoint.load_step": 1}
                )
            )
        )


def test_a_newest_step_with_a_damaged_manifest_is_refused_not_passed_over(corpus_cache, tmp_path):
    # Readers take a step whose manifest.json does not parse for uncommitted, so `--load` went
    # back to the step before it without a word, and the run failed on reaching the damaged
    # step again ("already exists").
    root = tmp_path / "ckpt"
    common = {"train.eval_interval": 0, "checkpoint.save_interval": 2, "checkpoint.save": str(root)}
    train(
        load_config(
            small_job_args(corpus_cache, tmp_path / "r1", **common, **{"train.train_iters": 4})
        )
    )
    (root / "step_00000004" / "manifest.json").write_text('{"format": 2, "arr')  # damaged storage
    resume = {**common, "checkpoint.load": str(root), "train.train_iters": 6}
    with pytest.raises(
        CheckpointError,
        match=r"step\(s\) \[4\], newer than committed step 2, hold a manifest"
        r".*--ckpt-step 2.*ckpt delete .* --step 4",
    ):
        train(load_config(small_job_args(corpus_cache, tmp_path / "r2", **resume)))
    # Resuming step 2 by name (as deploy/train.sh does) is refused too while step 4's folder is
    # there, since the run's save of step 4 would fail on it; deleting the damaged step lets it on.
    from meshtrain.services.checkpoint.maintenance import delete_checkpoint

    rolled_back = {**resume, "checkpoint.load_step": 2}  # deploy/train.sh names the step it resumes
    with pytest.raises(
        CheckpointError, match=r"steps \[4\] after this run's start \(step 2\) .* hold a manifest"
    ):
        train(load_config(small_job_args(corpus_cache, tmp_path / "r2b", **rolled_back)))
    assert delete_checkpoint(str(root), 4)
    again = train(load_config(small_job_args(corpus_cache, tmp_path / "r3", **resume)))
    assert sorted(again.losses) == [3, 4, 5, 6] and list_checkpoints(str(root)) == [2, 4, 6]
    # a root saved into that holds only a damaged step is not taken for an empty one either
    (root / "step_00000004" / "manifest.json").write_text("not json")
    for step in (2, 6):
        delete_checkpoint(str(root), step)
    with pytest.raises(CheckpointError, match=r"newer than no committed step"):
        train(load_config(small_job_args(corpus_cache, tmp_path / "r4", **resume)))


def test_load_errors_name_the_problem(corpus_cache, tmp_path):
    with pytest.raises(CheckpointError, match="no committed checkpoint|empty"):
        train(
            load_config(
                small_job_args(
                    corpus_cache,
                    tmp_path / "r1",
                    **{"checkpoint.load": str(tmp_path / "nothing-here")},
                )
            )
        )
    base = small_job_args(
        corpus_cache, tmp_path / "r2", **{"train.train_iters": 2, "train.eval_interval": 0}
    )
    train(load_config(base))
    ckpt = str(tmp_path / "r2" / "checkpoints")
    wider = small_job_args(
        corpus_cache,
        tmp_path / "r3",
        **{"checkpoint.load": ckpt, "model.hidden_size": 128, "train.eval_interval": 0},
    )
    with pytest.raises(CheckpointError, match="shape") as e:
        train(load_config(wider))
    assert "vocabulary" not in str(e.value)
    # The error leads with the setting that differs, which the user knows, not a tensor name.
    assert "differs from the checkpoint's in model.hidden_size=128 (64 saved)" in str(e.value)
    assert "--config RUN/config.toml" in str(e.value)
    deeper = small_job_args(
        corpus_cache,
        tmp_path / "r8",
        **{"checkpoint.load": ckpt, "model.num_layers": 3, "train.eval_interval": 0},
    )
    with pytest.raises(CheckpointError, match=r"in model\.num_layers=3 \(2 saved\); resume with"):
        train(load_config(deeper))
    other_vocab = small_job_args(
        corpus_cache,
        tmp_path / "r7",
        **{"checkpoint.load": ckpt, "model.vocab_size": 300, "train.eval_interval": 0},
    )
    with pytest.raises(CheckpointError, match=r"vocabulary differs .*--config RUN/config.toml"):
        train(load_config(other_vocab))
    done = small_job_args(
        corpus_cache,
        tmp_path / "r4",
        **{"checkpoint.load": ckpt, "train.train_iters": 2, "train.eval_interval": 0},
    )
    finished = train(load_config(done))  # a relaunch of a finished run succeeds, doing nothing
    assert finished.losses == {} and not finished.stopped_early
    assert finished.checkpoint is not None and finished.checkpoint.endswith(
        "step_00000002"
    )  # the one it loaded
    before = small_job_args(
        corpus_cache,
        tmp_path / "r6",
        **{"checkpoint.load": ckpt, "train.train_iters": 1, "train.eval_interval": 0},
    )
    with pytest.raises(CheckpointError, match="raise --train-iters"):
        train(load_config(before))
    bigger_batch = small_job_args(
        corpus_cache,
        tmp_path / "r5",
        **{
            "checkpoint.load": ckpt,
            "train.train_iters": 3,
            "train.global_batch_size": 32,
            "train.eval_interval": 0,
        },
    )
    with pytest.raises(ConfigError, match="consumed 32 samples in 2 steps.*skipped or repeated"):
        train(load_config(bigger_batch))


def test_resuming_with_other_train_iters_warns_that_it_continues_a_different_run(
    corpus_cache, tmp_path, caplog
):
    train(
        load_config(
            small_job_args(
                corpus_cache, tmp_path / "a", **{"train.train_iters": 2, "train.eval_interval": 0}
            )
        )
    )
    longer = small_job_args(
        corpus_cache,
        tmp_path / "b",
        **{
            "checkpoint.load": str(tmp_path / "a" / "checkpoints"),
            "train.train_iters": 3,
            "train.eval_interval": 0,
        },
    )
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        result = train(load_config(longer))
    assert sorted(result.losses) == [3]
    assert "train.train_iters changed from 2 to 3" in caplog.text


def test_resuming_with_another_residual_stream_dtype_warns(corpus_cache, tmp_path, caplog):
    """A bf16 run saved with the fp32 stream and resumed with the (default) bf16 one is told so."""
    bf16 = {"train.bf16": True, "train.eval_interval": 0}
    train(
        load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "a",
                **bf16,
                **{"train.train_iters": 2, "model.fp32_residual_connection": True},
            )
        )
    )
    load = {"checkpoint.load": str(tmp_path / "a" / "checkpoints"), "train.train_iters": 3}
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        train(
            load_config(
                small_job_args(
                    corpus_cache,
                    tmp_path / "same",
                    **bf16,
                    **load,
                    **{"model.fp32_residual_connection": True},
                )
            )
        )
    assert "fp32_residual_connection" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        result = train(load_config(small_job_args(corpus_cache, tmp_path / "b", **bf16, **load)))
    assert sorted(result.losses) == [3]
    assert "model.fp32_residual_connection changed from True to False" in caplog.text
    assert "pass --fp32-residual-connection" in caplog.text


def test_a_resume_into_a_root_with_later_steps_is_refused_before_training(corpus_cache, tmp_path):
    """Rolled back to step 4 in a root that holds step 8: its save at 8 (or a stop's save at any
    step that is there) would refuse to replace it after training up to it, and a save in
    between would leave the abandoned run's step 8 as the root's latest, which the next --load
    would resume. It is refused at the start, naming the steps and the switch; with
    checkpoint.overwrite the run goes ahead."""
    from meshtrain.services.trainer.train import Trainer

    run = tmp_path / "run"
    common = {"train.train_iters": 8, "train.eval_interval": 0, "checkpoint.save_interval": 4}
    train(load_config(small_job_args(corpus_cache, run, **common)))
    back = {"checkpoint.load": str(run / "checkpoints"), "checkpoint.load_step": 4}
    for iters in (8, 7):  # 7: no scheduled save on step 8, still the root's latest afterwards
        with pytest.raises(
            CheckpointError,
            match=r"steps \[8\] after this run's start \(step 4\).*"
            r"checkpoint.overwrite=true",
        ):
            Trainer(
                load_config(
                    small_job_args(
                        corpus_cache, run, **{**common, **back, "train.train_iters": iters}
                    )
                )
            )
    result = train(
        load_config(
            small_job_args(
                corpus_cache,
                run,
                **{
                    **common,
                    **back,
                    "train.train_iters": 7,
                    "checkpoint.save_interval": 0,
                    "checkpoint.overwrite": True,
                },
            )
        )
    )
    assert sorted(result.losses) == [5, 6, 7]


def test_resuming_with_another_lr_schedule_warns(corpus_cache, tmp_path, caplog):
    """The LR schedule is recomputed from the config each step: a changed peak or minimum LR on
    a resume moves the rate at once (Megatron refuses it without --override-opt_param-scheduler);
    it is named in a warning, and an unchanged resume says nothing of it."""
    saved = small_job_args(
        corpus_cache, tmp_path / "a", **{"train.train_iters": 2, "train.eval_interval": 0}
    )
    train(load_config(saved))

    def resume(run: str, **changes) -> str:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="meshtrain"):
            train(
                load_config(
                    small_job_args(
                        corpus_cache,
                        tmp_path / run,
                        **{
                            "checkpoint.load": str(tmp_path / "a" / "checkpoints"),
                            "train.train_iters": 3,
                            "train.eval_interval": 0,
                            **changes,
                        },
                    )
                )
            )
        return caplog.text

    assert "LR schedule changed" not in resume("same")
    text = resume("lower", **{"optim.lr": 1e-4, "optim.min_lr": 1e-5})
    assert (
        "the LR schedule changed since the checkpoint "
        "(optim.lr 0.003 -> 0.0001, optim.min_lr 0.0003 -> 1e-05)"
        in text
        and "from step 3" in text
    )


@pytest.mark.parametrize(("key", "value"), [("train.seed", 7), ("data.split", "70,30,0")])
def test_resuming_with_another_sample_stream_warns(corpus_cache, tmp_path, caplog, key, value):
    """The seed and the split decide which samples each step takes (and which documents are held
    out): changed on a resume, the steps after it skip and repeat samples of the saved run's order,
    or train on documents its evaluations held out."""
    train(
        load_config(
            small_job_args(
                corpus_cache, tmp_path / "a", **{"train.train_iters": 2, "train.eval_interval": 0}
            )
        )
    )
    resumed = small_job_args(
        corpus_cache,
        tmp_path / "b",
        **{
            "checkpoint.load": str(tmp_path / "a" / "checkpoints"),
            "train.train_iters": 3,
            "train.eval_interval": 0,
            key: value,
        },
    )
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        train(load_config(resumed))
    assert f"{key} changed from" in caplog.text


def test_rerunning_a_first_command_into_a_saved_root_suggests_load(corpus_cache, tmp_path):
    from meshtrain.services.trainer.train import Trainer

    common = {
        "train.train_iters": 2,
        "train.eval_interval": 0,
        "checkpoint.save_interval": 2,
        "checkpoint.save": str(tmp_path / "ckpt"),
    }
    train(load_config(small_job_args(corpus_cache, tmp_path / "run1", **common)))
    with pytest.raises(CheckpointError, match=r"to resume them pass --load .*ckpt; .*overwrite"):
        Trainer(load_config(small_job_args(corpus_cache, tmp_path / "run2", **common)))


def test_finetune_starts_a_new_run_from_the_weights_alone(corpus_cache, tmp_path):
    """Megatron's --finetune: step 0, no samples consumed, an empty optimizer, whatever plan
    the loaded run had (another global batch size is no error); --no-load-optim keeps the step
    but not Adam's moments."""
    import torch

    from meshtrain.services.trainer.train import Trainer

    root = str(tmp_path / "base")
    args = {"train.eval_interval": 0, "checkpoint.save": root, "train.train_iters": 3}
    train(load_config(small_job_args(corpus_cache, tmp_path / "r1", **args)))
    start = {"checkpoint.load": root, "train.eval_interval": 0}

    def job(run: str, *flags: str, **extra):
        return load_config(
            [*small_job_args(corpus_cache, tmp_path / run, **start, **extra), *flags]
        )

    with pytest.raises(ConfigError, match="global_batch_size"):
        Trainer(job("r2", **{"train.global_batch_size": 8}))
    tuned = Trainer(
        job("r3", "--finetune", f"--checkpoint.save={tmp_path / 'ft'}",
            **{"train.global_batch_size": 8, "train.train_iters": 2})
    )  # fmt: skip
    assert tuned.job.checkpoint.finetune
    assert tuned.state.iteration == 0 and tuned.state.consumed_samples == 0
    assert not any(tuned.optimizer.state.values())  # no moments loaded
    base = Trainer(job("r4", **{"train.train_iters": 5}))
    assert base.state.iteration == 3 and any(base.optimizer.state.values())
    for p, q in zip(tuned.model.parameters(), base.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert sorted(tuned.run().losses) == [1, 2]
    assert list_checkpoints(str(tmp_path / "ft")) == [2]
    fresh = Trainer(job("r5", "--no-load-optim", **{"train.train_iters": 5}))
    assert fresh.state.iteration == 3 and not any(fresh.optimizer.state.values())
    with pytest.raises(ConfigError, match="finetune.*needs checkpoint.load"):
        load_config(["--finetune"])
