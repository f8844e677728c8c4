"""Image preprocessing of the data worker: decode (Pillow), resize, crop or pad, normalize.

`ImageTransform.pixels` turns an encoded image (JPEG, PNG, WebP, ...) into (3, S, S) uint8
pixels: "crop" resizes the shortest side to S (bicubic, as CLIP's processor) and takes the
centre S x S; "pad" pads the image to a square with the normalization mean's colour (LLaVA-1.5's
`expand2square`) and resizes that to S. `normalize` maps uint8 pixels to float32
`(x / 255 - mean) / std` (CLIP's mean and std, or SigLIP's 0.5/0.5). The worker sends uint8
pixels (normalized on the client) or bf16 normalized ones (`encode_wire`), and the in-process
path goes through the same two functions, so both give bit-identical batches.

    t = ImageTransform(336, "crop", "clip")
    px = t.pixels(open("cat.jpg", "rb").read(), where="cat.jpg")   # (3, 336, 336) uint8
    x = t.normalize(px[None])                                       # (1, 3, 336, 336) float32
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.vision.sources import BadImageError

RESIZE_MODES = ("crop", "pad")
NORMALIZATIONS = {
    # OpenAI CLIP (and LLaVA's CLIP-ViT-L/14-336 processor)
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    # SigLIP (and SigLIP 2)
    "siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
WIRE_DTYPES = ("uint8", "bfloat16")
# Pillow refuses images over ~179 MP as decompression bombs only with a warning below 2x that;
# a training image past this is a corrupt or hostile file, not data.
MAX_IMAGE_PIXELS = 16384 * 16384


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the vision extra brings it
        raise DataError(
            "multimodal data needs Pillow to decode images: pip install 'meshtrain[vision]'"
        ) from None
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    return Image


@dataclass(frozen=True)
class ImageTransform:
    """Decode, resize and normalize images to one square size."""

    image_size: int = 336
    resize_mode: str = "crop"
    normalization: str = "clip"

    def __post_init__(self) -> None:
        if not 1 <= self.image_size <= 4096:
            raise DataError(f"image_size={self.image_size} must be in [1, 4096]")
        if self.resize_mode not in RESIZE_MODES:
            raise DataError(f"resize_mode {self.resize_mode!r} is not one of {RESIZE_MODES}")
        if self.normalization not in NORMALIZATIONS:
            raise DataError(
                f"image normalization {self.normalization!r} is not one of {tuple(NORMALIZATIONS)}"
            )

    @property
    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        mean, std = NORMALIZATIONS[self.normalization]
        return np.asarray(mean, np.float32), np.asarray(std, np.float32)

    def pixels(self, data: bytes, where: str) -> np.ndarray:
        """(3, S, S) uint8 RGB pixels of an encoded image.

        Raises:
            BadImageError: the bytes are not an image Pillow decodes (truncated, corrupt, a
                decompression bomb, empty); the message names `where`.
        """
        Image = _pil()
        if not data:
            raise BadImageError(f"{where}: empty image file")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as im:
                    im.load()  # decodes now: a truncated file fails here, not later
                    img = im.convert("RGB")
        except Exception as e:  # noqa: BLE001 -- Pillow raises many types for bad files
            raise BadImageError(f"{where}: cannot decode image: {type(e).__name__}: {e}") from e
        s = self.image_size
        w, h = img.size
        if self.resize_mode == "pad":
            if w != h:
                side = max(w, h)
                fill = tuple(int(m * 255) for m in NORMALIZATIONS[self.normalization][0])
                square = Image.new("RGB", (side, side), fill)
                square.paste(img, ((side - w) // 2, (side - h) // 2))
                img = square
            img = img.resize((s, s), Image.Resampling.BICUBIC)
        else:
            scale = s / min(w, h)
            nw, nh = max(s, round(w * scale)), max(s, round(h * scale))
            img = img.resize((nw, nh), Image.Resampling.BICUBIC)
            left, top = (nw - s) // 2, (nh - s) // 2
            img = img.crop((left, top, left + s, top + s))
        return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1).copy()  # (3, S, S)

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """(n, 3, S, S) float32 `(x / 255 - mean) / std` of uint8 pixels."""
        mean, std = self.mean_std
        x = pixels.astype(np.float32) / np.float32(255.0)
        return (x - mean[:, None, None]) / std[:, None, None]

    def encode_wire(self, pixels: np.ndarray, wire_dtype: str) -> np.ndarray:
        """What goes on the wire for (n, 3, S, S) uint8 pixels: the pixels themselves
        ("uint8"), or their normalized values as bf16 bits in uint16 ("bfloat16")."""
        if wire_dtype == "uint8":
            return pixels
        if wire_dtype == "bfloat16":
            return float32_to_bf16_bits(self.normalize(pixels))
        raise DataError(f"image wire dtype {wire_dtype!r} is not one of {WIRE_DTYPES}")

    def decode_wire(self, wire: np.ndarray, wire_dtype: str) -> np.ndarray:
        """(n, 3, S, S) float32 normalized pixels from `encode_wire`'s output."""
        if wire_dtype == "uint8":
            return self.normalize(wire)
        return bf16_bits_to_float32(wire)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) of float32 values, rounded to nearest even (torch's rounding), so the
    worker needs no torch; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bits (uint16): exact."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(
        np.float32
    )
