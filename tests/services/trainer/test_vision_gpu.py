"""Vision-language training on CUDA in bf16 through the real loop: deploy/configs/vlm-tiny.toml
(a CLIP-style ViT, the mlp2x_gelu projector, a Llama-style language model) on the synthetic
coloured-shapes captions read with data.format = "multimodal" (images decoded and normalized by
the in-process data source, uploaded with the tokens).

Finite losses that fall within a few steps (the captions' wording), and the first step equal to
the fp32 CPU run's within bf16 rounding. The body takes its device from `gpu_device`
(conftest.py: CUDA, and the CPU under MESHTRAIN_GPU_TESTS_ON_CPU=1). About 5 s on one H100.
"""

import math

import pytest
import torch

from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.services.dataloader.test_vision import REPO, load_shapes
from tests.services.trainer.conftest import first_step_loss, losses_in_order

pytestmark = pytest.mark.gpu


def test_vision_language_bf16_training(gpu_device, tmp_path):
    shapes = load_shapes().write_shapes(
        tmp_path / "shapes", samples=300, seed=0, image_size=32, style="caption"
    )
    args = [
        f"--config={REPO / 'deploy' / 'configs' / 'vlm-tiny.toml'}",
        f"--data.data_path={shapes['jsonl']}",
        "--train.train_iters=12",
        "--train.eval_interval=12",
        "--checkpoint.save_interval=0",
        "--log.log_interval=1",
        "--log.plot=false",
    ]
    cpu = first_step_loss([*args, f"--log.run_dir={tmp_path / 'cpu'}"])
    result = train(
        load_config(
            [
                *args,
                f"--train.device={gpu_device}",
                "--train.bf16=true",
                f"--log.run_dir={tmp_path / 'run'}",
            ]
        )
    )
    losses = losses_in_order(result)
    assert len(losses) == 12 and bool(torch.isfinite(torch.tensor(losses)).all()), losses
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert losses[0] == pytest.approx(cpu, rel=1e-2)
    assert math.isfinite(result.eval_losses[12])
