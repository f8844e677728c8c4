"""`meshtrain dpo reference` and dpo.reference='precomputed': the column equals what the frozen
reference computes (exact, fp32, one process), training on it gives the frozen reference's
losses, a column for other data or cut short is refused, and a pass that fails leaves nothing
that loads. On 2 gloo ranks (dp, tp, pp; marked `dist`) the pass writes the column one process
writes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from meshtrain.services.cli import main
from meshtrain.services.common.errors import ConfigError, DataError
from meshtrain.services.dataloader.preference import PreferencePairs, write_pairs
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.checkpointing import save_checkpoint
from meshtrain.services.trainer.config.load import load_config, replace
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.objectives import reference_pass
from meshtrain.services.trainer.objectives.dpo import FrozenReference, pair_micro_batches
from meshtrain.services.trainer.train import Trainer, train
from tests.dist_utils import run_ranks
from tests.services.trainer.objectives.test_dpo_train import job_args, synthetic_pairs

SMALL = {
    "train.train_iters": 3,
    "train.eval_interval": 3,
    "train.eval_iters": 1,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 4,
}


def starting_checkpoint(run, pairs, root, seed: int) -> str:
    """A committed step-0 checkpoint of the tests' tiny model, weights from `seed`."""
    job = load_config(job_args(run, pairs[0], pairs[1]))
    job = replace(job, model={"vocab_size": build_tokenizer("byte").vocab_size})
    torch.manual_seed(seed)
    save_checkpoint(str(root), 0, GPT(job.model), None, job=job)
    return str(root)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    tok = build_tokenizer("byte")
    synthetic_pairs(d / "train.jsonl", 21, seed=0)  # odd: the last micro-batch is filled up
    synthetic_pairs(d / "valid.jsonl", 8, seed=1)
    write_pairs(d / "train.jsonl", d / "train", tok, max_length=17)
    write_pairs(d / "valid.jsonl", d / "valid", tok, max_length=17)
    return d / "train", d / "valid"


@pytest.fixture(scope="module")
def start(pairs, tmp_path_factory):
    d = tmp_path_factory.mktemp("start")
    return starting_checkpoint(d / "run", pairs, d / "ckpt", seed=7)


def args(run, pairs, **extra):
    return job_args(run, pairs[0], pairs[1], **{**SMALL, **extra})


def clear(pairs):
    for prefix in pairs:
        for suffix in (".ref_logps.npy", ".ref_logps.json"):
            if os.path.exists(f"{prefix}{suffix}"):
                os.remove(f"{prefix}{suffix}")


def test_the_command_needs_a_model_and_a_reference(tmp_path, pairs):
    with pytest.raises(ConfigError, match="set checkpoint.load"):
        reference_pass.compute_reference(load_config(args(tmp_path / "r", pairs)))
    simpo = {"dpo.loss_type": "simpo", "dpo.reference": "none", "checkpoint.load": "x"}
    assert main(["dpo", "reference", *args(tmp_path / "r", pairs, **simpo)]) == 2


def test_precomputed_column_equals_the_frozen_reference(tmp_path, pairs, start):
    clear(pairs)
    assert (
        main(["dpo", "reference", *args(tmp_path / "p", pairs, **{"checkpoint.load": start})]) == 0
    )
    train_pairs, valid_pairs = PreferencePairs(pairs[0]), PreferencePairs(pairs[1])
    column = train_pairs.reference()
    assert column.shape == (42,) and np.all(column < 0)
    assert valid_pairs.reference().shape == (16,)
    assert train_pairs.reference_source() == f"{start} step 0"
    # the frozen reference of a run starting from the same checkpoint, on the run's own
    # micro-batches (another order and grouping than the pass's)
    trainer = Trainer(load_config(args(tmp_path / "f", pairs, **{"checkpoint.load": start})))
    assert isinstance(trainer.reference, FrozenReference)
    seen = set()
    for step in range(6):
        for b in trainer.data.train.micro_batches(step):
            (sums,) = trainer.reference.logps(pair_micro_batches([b], lambda ts: ts, None))
            assert sums is not None
            torch.testing.assert_close(sums, torch.from_numpy(column[b.sequences]), rtol=0, atol=0)
            seen.update(b.sequences.tolist())
    assert seen == set(range(42))


@pytest.mark.e2e
def test_training_on_the_column_equals_training_with_the_frozen_reference(tmp_path, pairs, start):
    clear(pairs)
    common = {"checkpoint.load": start}
    assert main(["dpo", "reference", *args(tmp_path / "p", pairs, **common)]) == 0
    frozen = train(load_config(args(tmp_path / "frozen", pairs, **common)))
    pre = train(
        load_config(args(tmp_path / "pre", pairs, **common, **{"dpo.reference": "precomputed"}))
    )
    assert sorted(pre.losses) == [1, 2, 3]
    assert pre.losses == frozen.losses
    assert pre.eval_losses == frozen.eval_losses


def test_a_column_for_other_data_or_cut_short_is_refused(tmp_path, pairs, start):
    clear(pairs)
    assert (
        main(["dpo", "reference", *args(tmp_path / "p", pairs, **{"checkpoint.load": start})]) == 0
    )
    train_prefix, valid_prefix = map(str, pairs)
    good = PreferencePairs(train_prefix).reference()
    npy, meta = f"{train_prefix}.ref_logps.npy", f"{train_prefix}.ref_logps.json"
    saved = open(npy, "rb").read(), open(meta, "rb").read()
    try:
        # another dataset's column put in its place
        for suffix in (".ref_logps.npy", ".ref_logps.json"):
            with (
                open(f"{valid_prefix}{suffix}", "rb") as f,
                open(f"{train_prefix}{suffix}", "wb") as g,
            ):
                g.write(f.read())
        with pytest.raises(DataError, match="computed for other data"):
            PreferencePairs(train_prefix).reference()
        # a consistent commit of the wrong length
        with pytest.raises(DataError, match="need 42"):
            PreferencePairs(train_prefix).write_reference(good[:-2], "x")
        open(meta, "wb").write(saved[1])
        np.save(npy, good[:-2])
        with pytest.raises(DataError, match="expected 42 float32 values"):
            PreferencePairs(train_prefix).reference()
        # cut short, and changed in place
        open(npy, "wb").write(saved[0][: len(saved[0]) // 2])
        with pytest.raises(DataError, match="unreadable"):
            PreferencePairs(train_prefix).reference()
        np.save(npy, good + 1)
        with pytest.raises(DataError, match="not the file its pass committed"):
            PreferencePairs(train_prefix).reference()
        # and the run says so before it trains
        with pytest.raises(DataError, match="not the file its pass committed"):
            Trainer(load_config(args(tmp_path / "t", pairs, **{"dpo.reference": "precomputed"})))
    finally:
        open(npy, "wb").write(saved[0])
        open(meta, "wb").write(saved[1])
    np.testing.assert_array_equal(PreferencePairs(train_prefix).reference(), good)


def test_a_failed_pass_leaves_nothing_that_loads(tmp_path, pairs, start, monkeypatch):
    clear(pairs)
    job = load_config(args(tmp_path / "p", pairs, **{"checkpoint.load": start}))
    calls = {"n": 0}
    real_logps = FrozenReference.logps

    def dies_midway(self, micro):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("killed")
        return real_logps(self, micro)

    with monkeypatch.context() as m:
        m.setattr(FrozenReference, "logps", dies_midway)
        with pytest.raises(RuntimeError, match="killed"):
            reference_pass.compute_reference(job)
    with pytest.raises(DataError, match="is missing"):
        PreferencePairs(pairs[0]).reference()
    # an earlier complete column, then a pass that dies between the values and their commit
    reference_pass.compute_reference(job)
    PreferencePairs(pairs[0]).reference()
    real_replace = os.replace

    def dies_at_the_commit(src, dst):
        if str(dst).endswith(".ref_logps.json"):
            raise OSError("killed")
        return real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", dies_at_the_commit)
        with pytest.raises(OSError, match="killed"):
            reference_pass.compute_reference(job)
    with pytest.raises(DataError, match="did not finish"):
        PreferencePairs(pairs[0]).reference()
    leftovers = [p for p in os.listdir(pairs[0].parent) if ".tmp-" in p]
    assert leftovers == []


def _rank_pass(rank, world, argv):
    reference_pass.compute_reference(load_config(argv))
    return None


@pytest.mark.dist
@pytest.mark.parametrize(
    "extra, exact",
    [({}, True), ({"parallel.tp": 2}, False), ({"parallel.pp": 2}, True)],
    ids=["dp2", "tp2", "pp2"],
)
def test_the_pass_on_two_ranks_equals_one_process(tmp_path, pairs, start, extra, exact):
    clear(pairs)
    common = {"checkpoint.load": start}
    reference_pass.compute_reference(load_config(args(tmp_path / "one", pairs, **common)))
    one = [PreferencePairs(p).reference() for p in pairs]
    clear(pairs)
    run_ranks(_rank_pass, 2, args(tmp_path / "two", pairs, **common, **extra), timeout=240)
    for prefix, want in zip(pairs, one, strict=True):
        got = PreferencePairs(prefix).reference()
        if exact:
            np.testing.assert_array_equal(got, want)
        else:  # the vocab-parallel log-softmax adds in another order
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
