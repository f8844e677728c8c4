"""A tiny LLaVA-style model learns to read images: trained through the Trainer on the synthetic
coloured-shapes captions ("Three red circles.", examples/make_shapes_dataset.py) it names the
colour of held-out images far above chance, while the same model trained on the same captions
with every image blanked to one grey stays at chance. The colour is scored teacher-forced: the
whole-word log-likelihood of each colour after "<image>Three ", so colours sharing a first
letter do not collide.
Chance is 1/6: the blanked model can only answer its likeliest colour a priori. Image features
merged in the wrong places (each sample given another's image) leave the captions unreadable
and fail it."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.image_prompt import expand_prompt, load_images
from meshtrain.services.trainer.train import Trainer
from tests.services.dataloader.test_vision import REPO, load_shapes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
CHANCE = 1 / len(COLOURS)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """{"images": train JSONL, "blank": the same records with every image one grey,
    "held": held-out records (another seed)}."""
    out = tmp_path_factory.mktemp("shapes-learn")
    mod = load_shapes()
    train = mod.write_shapes(out / "train", samples=800, seed=0, image_size=32, style="caption")
    blank = mod.write_shapes(out / "blank", samples=800, seed=0, image_size=32, style="caption")
    for png in (blank["jsonl"].parent / "images").glob("*.png"):
        Image.new("RGB", (32, 32), (128, 128, 128)).save(png)
    held = mod.write_shapes(out / "held", samples=120, seed=123, image_size=32, style="caption")
    return {"images": train["jsonl"], "blank": blank["jsonl"], "held": held["jsonl"]}


def train(data: Path, run_dir: Path) -> Trainer:
    """A Trainer run through deploy/configs/vlm-tiny.toml (300 steps at a constant learning
    rate after the warmup) on `data`, kept open for its model."""
    args = [
        f"--config={REPO / 'deploy' / 'configs' / 'vlm-tiny.toml'}",
        f"--data.data_path={data}",
        "--train.eval_interval=0",
        "--checkpoint.save_interval=0",
        f"--log.run_dir={run_dir}",
        "--log.plot=false",
        "--log.log_interval=100",
    ]
    trainer = Trainer(load_config(args))
    trainer.run(keep_run_dir=True)
    return trainer


@torch.no_grad()
def colour_accuracy(trainer: Trainer, held: Path) -> float:
    """Share of held-out images whose caption's colour is the likeliest of the six after the
    image and the caption's count word, each colour scored by its whole word's log-likelihood."""
    model, vision = trainer.model, trainer.job.model.vision
    assert vision is not None
    model.eval()
    tok = build_tokenizer("byte")
    rows = [json.loads(line) for line in held.read_text().splitlines()]
    right = 0
    for row in rows:
        count, colour = row["text"].split()[:2]
        image = load_images([str(held.parent / row["image"])], vision)
        prefix = expand_prompt(f"<image>{count} ", 1, tok, vision)
        words = [tok.encode(f"{c} ") for c in COLOURS]
        width = len(prefix) + max(map(len, words))
        seqs = [prefix + w + [tok.eod_id] * (width - len(prefix) - len(w)) for w in words]
        logp = model(torch.tensor(seqs), images=image.repeat(len(COLOURS), 1, 1, 1))
        logp = logp.float().log_softmax(-1)  # (colours, seq, vocab)
        scores = [
            sum(logp[i, len(prefix) + j - 1, t].item() for j, t in enumerate(w))
            for i, w in enumerate(words)
        ]
        right += COLOURS[max(range(len(COLOURS)), key=scores.__getitem__)] == colour
    return right / len(rows)


def test_learns_colour_from_images_and_not_without(shapes, tmp_path):
    seen = train(shapes["images"], tmp_path / "images")
    try:
        with_images = colour_accuracy(seen, shapes["held"])
    finally:
        seen.release_run_dir()
    assert with_images >= 3 * CHANCE, with_images
    blind = train(shapes["blank"], tmp_path / "blank")
    try:
        blanked = colour_accuracy(blind, shapes["held"])
    finally:
        blind.release_run_dir()
    assert blanked <= CHANCE + 0.1, (with_images, blanked)
