"""The prompt of a vision-language model: image files made into the model's input exactly as
the data worker makes them for training (`dataloader.vision.images.ImageTransform`: decode,
resize, normalize), and the text's `<image>` tags expanded to the placeholders the image
features take the place of. `meshtrain generate --image` and the tests that ask a trained
model about held-out images read their prompts through here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import VisionConfig
from meshtrain.services.dataloader.tokenizers.base import Tokenizer
from meshtrain.services.dataloader.vision.dataset import IMAGE_TAG
from meshtrain.services.dataloader.vision.images import ImageTransform


def load_images(
    paths: list[str], vision: VisionConfig, resize: str = "crop", normalization: str | None = None
) -> torch.Tensor:
    """(n, 3, S, S) float32 images, S = model.vision.image_size: decoded, resized
    (data.image_resize) and normalized (data.image_normalization; None: the variant's statistics).

    Raises:
        ConfigError: a file that does not exist.
        BadImageError: one that does not decode (naming it).
    """
    transform = ImageTransform(vision.image_size, resize, normalization or vision.variant)
    pixels = np.empty((len(paths), 3, vision.image_size, vision.image_size), np.uint8)
    for i, path in enumerate(paths):
        if not Path(path).is_file():
            raise ConfigError(f"--image {path}: no such file")
        pixels[i] = transform.pixels(Path(path).read_bytes(), path)
    return torch.from_numpy(transform.normalize(pixels))


def expand_prompt(
    prompt: str, n_images: int, tokenizer: Tokenizer, vision: VisionConfig
) -> list[int]:
    """Token ids of `prompt` with each `<image>` tag replaced by tokens_per_image copies of
    model.vision.image_token_id. Without tags, the images go first (as the data puts them before
    a caption).

    Raises:
        ConfigError: the number of tags is not the number of images, or the tokenizer gives
            ordinary text the placeholder id.
    """
    tags = prompt.count(IMAGE_TAG)
    if tags == 0:
        prompt, tags = IMAGE_TAG * n_images + prompt, n_images
    if tags != n_images:
        raise ConfigError(f"--prompt has {tags} {IMAGE_TAG} tags for {n_images} --image files")
    block = [vision.image_token_id] * vision.tokens_per_image
    ids: list[int] = []
    for k, piece in enumerate(prompt.split(IMAGE_TAG)):
        if k:
            ids += block
        if piece:
            text = tokenizer.encode(piece)
            if vision.image_token_id in text:
                raise ConfigError(
                    f"the tokenizer gives the text {piece[:40]!r} the image placeholder id "
                    f"{vision.image_token_id} (model.vision.image_token_id)"
                )
            ids += text
    return ids
