"""A training checkpoint's recorded position (iteration, samples, optimizer steps) is checked
against the step it is stored as before a resume starts from it."""

import json

import pytest

from meshtrain.services.checkpoint.multiwriter import MANIFEST_DIGEST, manifest_digest
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.trainer.checkpointing import load_checkpoint, save_checkpoint
from tests.services.trainer.test_checkpointing_attention import BASE, random_model


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("iteration", 3, "records iteration 3; a resume would start from the wrong step"),
        ("consumed_samples", -8, "records consumed_samples -8, not a count"),
        ("optimizer_step", "5", "records optimizer_step '5', not a count"),
    ],
)
def test_a_checkpoint_whose_position_disagrees_with_its_step_is_refused(
    tmp_path, field, value, message
):
    """A manifest rewritten whole (its digest recomputed, as a faulty writer would) that puts
    the run elsewhere than its step is refused, not resumed from the wrong place."""
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 5, random_model(BASE), None, consumed_samples=40)
    assert load_checkpoint(root, random_model(BASE)).iteration == 5  # as saved, it loads
    path = tmp_path / "ckpt" / "step_00000005" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metadata"][field] = value
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(root, random_model(BASE))
