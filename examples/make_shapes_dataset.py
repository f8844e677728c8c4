"""Write the synthetic "coloured shapes" vision-language task, deterministically from a seed.

Each image shows 1-4 shapes (all circles or all squares, of one colour) on a plain background;
its text states what is there, as a caption ("3 red circles.") or as a conversation asking
for the count or the colour. A model that learns to read images gets the answer right; one
that ignores them cannot beat the base rates. The same records are written as WebDataset tar
shards (`KEY.png` + `KEY.txt` or `KEY.json`, optionally with Energon's `.nv-meta/`) and as a
folder of images with a JSONL, which meshtrain's `data.format = "multimodal"` reads.

    python examples/make_shapes_dataset.py OUT --samples 2000 --seed 0 --energon
    # OUT/wds/shapes-000000.tar ...  OUT/wds/.nv-meta/  OUT/jsonl/data.jsonl OUT/jsonl/images/
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

import numpy as np

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 180),
    "orange": (240, 130, 20),
}
SHAPES = ("circle", "square")
NUMBERS = ("one", "two", "three", "four")


def make_record(rng: np.random.Generator, image_size: int, style: str) -> tuple[bytes, dict]:
    """(PNG bytes, {"count", "colour", "shape", "caption", "conversation"}) of one record.

    `style` is "caption", "conversation" or "mixed" (each record picks one at random)."""
    from PIL import Image, ImageDraw

    count = int(rng.integers(1, 5))
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape = SHAPES[int(rng.integers(2))]
    grey = int(rng.integers(200, 256))
    img = Image.new("RGB", (image_size, image_size), (grey, grey, grey))
    draw = ImageDraw.Draw(img)
    # one shape per cell of a 2 x 2 grid, so shapes never overlap and the count is unambiguous
    cells = rng.permutation(4)[:count]
    half = image_size // 2
    for cell in cells:
        cx, cy = (cell % 2) * half, (cell // 2) * half
        r = int(rng.integers(half // 5, half * 2 // 5))
        x = cx + int(rng.integers(r, half - r + 1))
        y = cy + int(rng.integers(r, half - r + 1))
        box = (x - r, y - r, x + r, y + r)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        else:
            draw.rectangle(box, fill=COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    plural = shape + ("s" if count > 1 else "")
    caption = f"{NUMBERS[count - 1].capitalize()} {colour} {plural}."
    if style == "mixed":
        style = ("caption", "conversation")[int(rng.integers(2))]
    if int(rng.integers(2)):
        question, answer = "How many shapes are in the image?", f"{count}"
    else:
        question, answer = "What colour are the shapes?", colour
    conversation = [
        {"from": "human", "value": f"<image>\n{question}"},
        {"from": "gpt", "value": answer},
    ]
    meta = {"count": count, "colour": colour, "shape": shape, "style": style}
    meta["caption" if style == "caption" else "conversation"] = (
        caption if style == "caption" else conversation
    )
    return buf.getvalue(), meta


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # byte-identical shards from one seed
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shapes(
    out: str | Path,
    samples: int = 1000,
    seed: int = 0,
    image_size: int = 64,
    shard_size: int = 250,
    style: str = "mixed",
    energon: bool = False,
    val_shards: int = 0,
) -> dict[str, Path]:
    """Write the task under `out`: `wds/` (tar shards) and `jsonl/` (data.jsonl + images/).

    Args:
        out: the folder to write into.
        samples: records.
        seed: the only source of randomness: the same seed writes the same bytes.
        image_size: side of the square images, pixels.
        shard_size: records per tar shard.
        style: "caption", "conversation" or "mixed".
        energon: also write `wds/.nv-meta/` as `energon prepare` does (CaptioningSample-free:
            the files are read by extension), with the last `val_shards` shards as "val".
        val_shards: shards of the Energon "val" split part.

    Returns:
        {"wds": folder of the shards, "jsonl": the JSONL file}.
    """
    if style not in ("caption", "conversation", "mixed"):
        raise ValueError(f"style {style!r} is not caption, conversation or mixed")
    out = Path(out)
    wds, jl = out / "wds", out / "jsonl"
    (jl / "images").mkdir(parents=True, exist_ok=True)
    wds.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    tar = None
    with open(jl / "data.jsonl", "w") as lines:
        for i in range(samples):
            if i % shard_size == 0:
                if tar is not None:
                    tar.close()
                name = f"shapes-{i // shard_size:06d}.tar"
                tar = tarfile.open(wds / name, "w", format=tarfile.USTAR_FORMAT)
                counts[name] = 0
            png, meta = make_record(rng, image_size, style)
            key = f"{i:08d}"
            assert tar is not None
            _add(tar, f"{key}.png", png)
            if "caption" in meta:
                _add(tar, f"{key}.txt", meta["caption"].encode())
                text = {"text": meta["caption"]}
            else:
                _add(tar, f"{key}.json", json.dumps(meta["conversation"]).encode())
                text = {"conversations": meta["conversation"]}
            counts[name] += 1
            (jl / "images" / f"{key}.png").write_bytes(png)
            row = {"image": f"images/{key}.png", **text, "count": meta["count"]}
            lines.write(json.dumps(row) + "\n")
    if tar is not None:
        tar.close()
    if energon:
        names = sorted(counts)
        if not 0 <= val_shards < len(names):
            raise ValueError(f"val_shards={val_shards} must leave at least one train shard")
        cut = len(names) - val_shards
        meta_dir = wds / ".nv-meta"
        meta_dir.mkdir(exist_ok=True)
        (meta_dir / ".info.json").write_text(json.dumps({"shard_counts": counts}, indent=1))
        split = {"split_parts": {"train": names[:cut], "val": names[cut:], "test": []}}
        (meta_dir / "split.json").write_text(json.dumps(split, indent=1))
    return {"wds": wds, "jsonl": jl / "data.jsonl"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder to write wds/ and jsonl/ into")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--shard-size", type=int, default=250)
    p.add_argument("--style", default="mixed", choices=("caption", "conversation", "mixed"))
    p.add_argument("--energon", action="store_true", help="also write wds/.nv-meta/")
    p.add_argument("--val-shards", type=int, default=0, help="shards of Energon's val split")
    a = p.parse_args(argv)
    paths = write_shapes(
        a.out, a.samples, a.seed, a.image_size, a.shard_size, a.style, a.energon, a.val_shards
    )
    print(json.dumps({k: str(v) for k, v in paths.items()}))


if __name__ == "__main__":
    main()
