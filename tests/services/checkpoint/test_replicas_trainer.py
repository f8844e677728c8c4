"""The trainer saving through two checkpoint service replicas (`checkpoint.service_address`
naming both), with the shards streamed through them or, with `checkpoint.service_direct`,
stored by the ranks themselves; the checkpoint loads back into the model bit for bit."""

import pytest
import torch

from meshtrain.services.checkpoint.reader import list_checkpoints, load_checkpoint, read_manifest
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import Trainer
from tests.services.checkpoint.test_replicas import replicas
from tests.services.trainer.conftest import corpus_cache, small_job_args  # noqa: F401 -- the fixture


@pytest.mark.parametrize("direct", [False, True], ids=["streamed", "direct"])
def test_the_trainer_saves_through_two_replicas(corpus_cache, tmp_path, direct):  # noqa: F811
    root = str(tmp_path / "ckpt")
    with replicas(root) as addresses:
        trainer = Trainer(
            load_config(
                small_job_args(
                    corpus_cache,
                    tmp_path / "run",
                    **{
                        "checkpoint.save": root,
                        "checkpoint.service_address": ",".join(addresses),
                        "checkpoint.service_direct": direct,
                        "checkpoint.async_save": False,
                    },
                )
            )
        )
        try:
            trainer.train_step(0)
            trainer.state.iteration = 1
            assert trainer.save().endswith("step_00000001")
        finally:
            trainer.checkpointer.close()
    assert list_checkpoints(root) == [1] and read_manifest(root, 1)["metadata"]["iteration"] == 1
    state, _ = load_checkpoint(root, 1)
    for name, param in trainer.model.named_parameters():
        saved = state[name]
        # the embedding is stored at the tokenizer's vocabulary, the model's may be padded
        held = param.detach()[tuple(slice(0, n) for n in saved.shape)]
        assert (
            saved.dtype == held.dtype
            and torch.equal(saved.view(torch.int16), held.view(torch.int16))
            if held.dtype == torch.bfloat16
            else torch.equal(saved, held)
        ), name
