"""Multimodal data in-process: sources (WebDataset, Energon, JSONL), images, tokens with image
placeholders, loss masks, the deterministic order, and bad records."""

import importlib.util
import io
import json
import shutil
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.tokenizers.base import ByteTokenizer
from meshtrain.services.dataloader.vision.dataset import (
    MultimodalBatchSource,
    MultimodalSpec,
    open_multimodal,
)
from meshtrain.services.dataloader.vision.images import (
    NORMALIZATIONS,
    ImageTransform,
    bf16_bits_to_float32,
    float32_to_bf16_bits,
)
from meshtrain.services.dataloader.vision.sources import BadImageError, BadRecordError

REPO = Path(__file__).resolve().parents[3]
IMG = 257  # the byte tokenizer's ids are 0..255 and EOD 256
TPI = 8


def load_shapes():
    spec = importlib.util.spec_from_file_location(
        "make_shapes_dataset", REPO / "examples" / "make_shapes_dataset.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """40 records as plain shards (no .nv-meta) and as JSONL."""
    out = tmp_path_factory.mktemp("shapes")
    return load_shapes().write_shapes(out, samples=40, seed=3, image_size=24, shard_size=16)


def mm_spec(path, **kw):
    base = dict(
        tokenizer="byte",
        seq_length=80,
        num_samples=64,
        seed=5,
        image_token_id=IMG,
        tokens_per_image=TPI,
        image_size=16,
        split="100,0,0",
    )
    base.update(kw)
    return MultimodalSpec((str(path),), **base)


def src_of(spec, dp_rank=0, dp_size=1, mbs=2, gbs=8):
    return MultimodalBatchSource(open_multimodal(spec), mbs, gbs, dp_rank, dp_size)


def same(a, b):
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.loss_mask, b.loss_mask) and torch.equal(a.images, b.images)


def test_shards_and_jsonl_give_the_same_batches(shapes):
    """The same records as tar shards and as a JSONL make bit-identical batches, and the
    placeholders, images and loss mask follow the contract."""
    wds = src_of(mm_spec(shapes["wds"]))
    jl = src_of(mm_spec(shapes["jsonl"]))
    assert len(wds.dataset.records) == len(jl.dataset.records) == 40
    for step in range(3):
        for mb in range(wds.num_micro_batches):
            a, b = wds.get(step, mb), jl.get(step, mb)
            same(a, b)
            assert a.images.dtype == torch.float32 and a.images.shape[1:] == (3, 16, 16)
            # exactly tokens_per_image placeholders per image, in runs of that length
            assert int((a.tokens == IMG).sum()) == a.images.shape[0] * TPI
            assert a.loss_mask[a.labels == IMG].sum() == 0  # placeholders are never targets
            assert a.loss_mask.sum() > 0


def test_loss_counts_answers_and_captions_only(shapes):
    src = src_of(mm_spec(shapes["jsonl"]))
    rows = [json.loads(x) for x in Path(shapes["jsonl"]).read_text().splitlines()]
    ds = src.dataset
    for k in range(12):
        tokens, mask, pixels = ds.sample(k)
        row = rows[ds.record_index(k)]
        trained = bytes(int(t) for t, m in zip(tokens[1:], mask) if m and t < 256)
        eods = int(sum(1 for t, m in zip(tokens[1:], mask) if m and t == 256))
        if "text" in row:
            # the first caption token, predicted from the image's last position, is trained
            assert trained == row["text"].encode() and eods == 1
        else:
            assert trained == row["conversations"][1]["value"].encode() and eods == 1
            assert b"USER: " in bytes(int(t) for t in tokens if t < 256)
        assert pixels.shape == (1, 3, 16, 16) and pixels.dtype == np.uint8


def test_order_is_a_pure_function_of_step_and_rank(shapes):
    spec = mm_spec(shapes["wds"])
    one = src_of(spec)
    fresh = src_of(spec)
    same(fresh.get(5, 2), one.get(5, 2))  # no history: resume at any step is exact
    # two dp ranks split each step's global batch between them, in Megatron's order
    r0, r1 = src_of(spec, 0, 2), src_of(spec, 1, 2)
    whole = [one.get(2, m) for m in range(4)]
    parts = [r.get(2, m) for m in range(2) for r in (r0, r1)]
    assert torch.equal(torch.cat([b.tokens for b in whole]), torch.cat([b.tokens for b in parts]))
    # every epoch is a permutation of the records: 40 records, samples 0..39 use each once
    ds = one.dataset
    assert sorted(ds.record_index(k) for k in range(40)) == list(range(40))
    assert [ds.record_index(k) for k in range(40)] != [ds.record_index(k) for k in range(40, 80)]
    other = src_of(replace(spec, seed=6))
    assert not torch.equal(other.get(0, 0).tokens, one.get(0, 0).tokens)


def test_shard_index_is_cached(shapes, tmp_path):
    cache = tmp_path / "cache"
    spec = mm_spec(shapes["wds"])
    a = MultimodalBatchSource(open_multimodal(spec, cache=str(cache)), 2, 8)
    assert len(list(cache.glob("*.json"))) == 1
    b = MultimodalBatchSource(open_multimodal(spec, cache=str(cache)), 2, 8)
    assert isinstance(b.dataset.records.parts[0].m_offset, np.memmap)
    same(a.get(1, 0), b.get(1, 0))


def energon_copy(shapes, tmp_path, yaml_meta=False, exclude=()):
    d = tmp_path / "energon"
    shutil.copytree(shapes["wds"], d)
    meta = d / ".nv-meta"
    meta.mkdir()
    names = sorted(p.name for p in d.glob("*.tar"))
    counts = {n: len(tarfile.open(d / n).getnames()) // 2 for n in names}
    split = {"split_parts": {"train": names[:-1], "val": names[-1:]}, "exclude": list(exclude)}
    if yaml_meta:
        import yaml

        (meta / ".info.yaml").write_text(yaml.safe_dump({"shard_counts": counts}))
        (meta / "split.yaml").write_text(yaml.safe_dump(split))
    else:
        (meta / ".info.json").write_text(json.dumps({"shard_counts": counts}))
        (meta / "split.json").write_text(json.dumps(split))
    return d, names, counts


def test_energon_dataset_is_read_as_it_is(shapes, tmp_path):
    d, names, counts = energon_copy(
        shapes, tmp_path, yaml_meta=True, exclude=[f"{sorted(counts_names(shapes))[0]}/3"]
    )
    train = open_multimodal(mm_spec(d)).records
    val = open_multimodal(mm_spec(d, split_name="valid")).records
    assert len(train) == counts[names[0]] + counts[names[1]] - 1  # one sample excluded
    assert len(val) == counts[names[2]]
    assert all("/00000003" not in train.name(i) for i in range(len(train)))
    assert val.name(0).endswith(f"{names[2]}/00000032")


def counts_names(shapes):
    return [p.name for p in Path(shapes["wds"]).glob("*.tar")]


def test_energon_counts_and_split_are_checked(shapes, tmp_path):
    d, names, counts = energon_copy(shapes, tmp_path)
    info = d / ".nv-meta" / ".info.json"
    info.write_text(json.dumps({"shard_counts": {**counts, names[0]: 99}}))
    with pytest.raises(DataError, match="holds 16 samples but .nv-meta/.info.yaml says 99"):
        open_multimodal(mm_spec(d), cache=False)
    with pytest.raises(DataError, match="no split part 'test'"):
        open_multimodal(mm_spec(d, split_name="test"), cache=False)


def test_energon_captioning_field_map(tmp_path):
    """A CaptioningSample dataset whose fields have their own extensions."""
    d = tmp_path / "cap"
    (d / ".nv-meta").mkdir(parents=True)
    png = image_bytes((200, 10, 10))
    with tarfile.open(d / "s0.tar", "w") as tar:
        for key in ("a", "b"):
            add(tar, f"{key}.image.png", png)
            add(tar, f"{key}.cap.txt", f"caption {key}".encode())
            add(tar, f"{key}.other.txt", b"ignored")
    (d / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
        "field_map:\n  image: image.png\n  caption: cap.txt\n"
    )
    (d / ".nv-meta" / "split.yaml").write_text("split_parts:\n  train:\n    - s0.tar\n")
    (d / ".nv-meta" / ".info.yaml").write_text("shard_counts:\n  s0.tar: 2\n")
    ds = open_multimodal(mm_spec(d, num_samples=2), cache=False)
    texts = sorted(bytes(int(t) for t in ds.sample(k)[0] if t < 256) for k in range(2))
    assert texts == [b"caption a", b"caption b"]


def image_bytes(colour, size=(30, 20), fmt="PNG"):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_jsonl(d, rows, images):
    d.mkdir(parents=True, exist_ok=True)
    for name, data in images.items():
        (d / name).write_bytes(data)
    path = d / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_image_tags_several_images_and_prepending(tmp_path):
    red, blue = image_bytes((255, 0, 0)), image_bytes((0, 0, 255))
    rows = [
        {
            "image": ["r.png", "b.png"],
            "conversations": [
                {"from": "human", "value": "Left <image> right <image>?"},
                {"from": "gpt", "value": "ok"},
            ],
        },
        {
            "image": "r.png",
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "no tag"},
                {"role": "assistant", "content": "x"},
            ],
        },
    ]
    path = write_jsonl(tmp_path / "d", rows, {"r.png": red, "b.png": blue})
    ds = open_multimodal(mm_spec(path, seq_length=64, num_samples=2), cache=False)
    by_record = {ds.record_index(k): ds.sample(k) for k in range(2)}
    tokens, _, pixels = by_record[0]
    assert pixels.shape[0] == 2 and pixels[0, 0].mean() > pixels[1, 0].mean()  # red then blue
    text = tokens.tolist()
    first = text.index(IMG)
    assert bytes(text[:first]) == b"USER: Left "
    assert text[first : first + TPI] == [IMG] * TPI and text[first + TPI] != IMG
    tokens, _, pixels = by_record[1]
    s = tokens.tolist()
    # the tag is prepended to the first user turn, after the system turn
    assert bytes(s[:4]) == b"sys\n" and bytes(s[4:10]) == b"USER: "
    assert s[10 : 10 + TPI] == [IMG] * TPI and s[10 + TPI] == ord("\n")


def test_tag_count_mismatch_and_collisions(tmp_path):
    rows = [{"image": "r.png", "text": "<image> and <image>"}]
    path = write_jsonl(tmp_path / "d", rows, {"r.png": image_bytes((1, 2, 3))})
    with pytest.raises(BadRecordError, match=r"data.jsonl:1: 2 <image> tags for 1 images"):
        open_multimodal(mm_spec(path, num_samples=1), cache=False).sample(0)
    with pytest.raises(DataError, match="end-of-document id"):
        open_multimodal(mm_spec(path, image_token_id=256, num_samples=1), cache=False)
    rows = [{"image": "r.png", "text": "A"}]
    path = write_jsonl(tmp_path / "e", rows, {"r.png": image_bytes((1, 2, 3))})
    with pytest.raises(DataError, match="gives the text 'A' the id image_token_id=65"):
        open_multimodal(mm_spec(path, image_token_id=65, num_samples=1), cache=False).sample(0)


def test_corrupt_image_stops_or_is_skipped_deterministically(shapes, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(shapes["wds"], d)
    # cut one PNG short inside its shard: the tar stays valid, the image does not decode
    shard = d / "shapes-000000.tar"
    with tarfile.open(shard) as tar:
        m = tar.getmember("00000002.png")
    data = bytearray(shard.read_bytes())
    data[m.offset_data + 40 : m.offset_data + m.size] = b"\0" * (m.size - 40)
    shard.write_bytes(bytes(data))
    spec = mm_spec(d, num_samples=40, split="100,0,0")
    ds = open_multimodal(spec, cache=False)
    k = next(k for k in range(40) if ds.record_index(k) == 2)
    with pytest.raises(BadImageError, match=r"shapes-000000.tar/00000002.png: cannot decode"):
        ds.sample(k)
    skip = replace(spec, bad_image_policy="skip")
    a, b = open_multimodal(skip, cache=False), open_multimodal(skip, cache=False)
    ta, _, _ = a.sample(k)
    # replaced by the next record of the epoch's order, the same in every process
    assert np.array_equal(ta, b.sample(k)[0])
    assert np.array_equal(ta, a.sample(k + 1)[0]) or k == 39
    assert a.skipped["bad"] == 1
    # whole batches agree between fresh datasets whatever else they read first
    sa, sb = MultimodalBatchSource(a, 2, 8), MultimodalBatchSource(b, 2, 8)
    for step in range(5):
        for mb in range(4):
            same(sa.get(step, mb), sb.get(step, mb))


def test_missing_jsonl_image_is_named(tmp_path):
    path = write_jsonl(tmp_path / "d", [{"image": "gone.png", "text": "x"}], {})
    with pytest.raises(BadImageError, match="gone.png: cannot read image"):
        open_multimodal(mm_spec(path, num_samples=1), cache=False).sample(0)
    path = write_jsonl(tmp_path / "e", [{"image": "../x.png", "text": "x"}], {})
    with pytest.raises(BadRecordError, match="lies outside"):
        open_multimodal(mm_spec(path, num_samples=1), cache=False).sample(0)


def test_sample_whose_images_would_be_cut_is_refused(tmp_path, caplog):
    rows = [
        {"image": "r.png", "text": "x" * 60 + "<image>"},  # the image lands past seq_length
        {"image": "r.png", "text": "short, " + "y" * 100},  # only text is cut
    ]
    path = write_jsonl(tmp_path / "d", rows, {"r.png": image_bytes((9, 9, 9))})
    ds = open_multimodal(mm_spec(path, seq_length=64, num_samples=4), cache=False)
    with caplog.at_level("WARNING", logger="meshtrain.data"):
        samples = [ds.sample(k) for k in range(4)]
    assert ds.skipped["too long"] == 1
    assert "data.jsonl:1" in caplog.text and "image tokens would be cut" in caplog.text
    for tokens, mask, pixels in samples:  # always the second record, its text cut
        assert tokens.shape == (65,) and int((tokens == IMG).sum()) == TPI
        assert bytes(int(t) for t in tokens[TPI : TPI + 7]) == b"short, "


def test_image_transforms():
    t = ImageTransform(16, "crop", "clip")
    wide = image_bytes((10, 20, 30), size=(64, 32))
    px = t.pixels(wide, "w")
    assert px.shape == (3, 16, 16) and (px[:, 8, 8] == [10, 20, 30]).all()
    # pad: a wide image keeps all its content, with the mean colour above and below it
    from PIL import Image

    im = Image.new("RGB", (64, 32), (0, 0, 0))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    padded = ImageTransform(16, "pad", "clip").pixels(buf.getvalue(), "p")
    mean = [int(m * 255) for m in NORMALIZATIONS["clip"][0]]
    assert (padded[:, 0, 8] == mean).all() and (padded[:, 8, 8] == 0).all()
    x = t.normalize(px[None])
    expect = (np.array([10, 20, 30]) / 255 - np.array(NORMALIZATIONS["clip"][0])) / np.array(
        NORMALIZATIONS["clip"][1]
    )
    assert np.allclose(x[0, :, 0, 0], expect, atol=1e-6)
    s = ImageTransform(16, "crop", "siglip").normalize(np.full((1, 3, 1, 1), 255, np.uint8))
    assert np.allclose(s, 1.0)
    with pytest.raises(BadImageError, match="junk.jpg: cannot decode"):
        t.pixels(b"\xff\xd8 not a jpeg", "junk.jpg")
    with pytest.raises(DataError, match="resize_mode"):
        ImageTransform(16, "stretch")


def test_bf16_wire_matches_torch():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 3
    bits = float32_to_bf16_bits(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bits, ref)
    assert np.array_equal(
        bf16_bits_to_float32(bits), torch.from_numpy(x).bfloat16().float().numpy()
    )


def test_bf16_wire_batches_are_close_to_uint8_ones(shapes):
    a = src_of(mm_spec(shapes["wds"])).get(0, 0)
    b = src_of(mm_spec(shapes["wds"], wire_dtype="bfloat16")).get(0, 0)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.images, b.images, atol=2e-2, rtol=1e-2)


def test_shapes_dataset_is_deterministic(tmp_path):
    mod = load_shapes()
    a = mod.write_shapes(
        tmp_path / "a", samples=12, seed=1, shard_size=5, energon=True, val_shards=1
    )
    b = mod.write_shapes(
        tmp_path / "b", samples=12, seed=1, shard_size=5, energon=True, val_shards=1
    )
    c = mod.write_shapes(tmp_path / "c", samples=12, seed=2, shard_size=5)
    for name in ("shapes-000000.tar", "shapes-000002.tar"):
        assert (a["wds"] / name).read_bytes() == (b["wds"] / name).read_bytes()
    assert a["jsonl"].read_text() == b["jsonl"].read_text() != c["jsonl"].read_text()
    words = {"One": 1, "Two": 2, "Three": 3, "Four": 4}
    for row in map(json.loads, a["jsonl"].read_text().splitlines()):
        if "text" in row:
            assert words[row["text"].split()[0]] == row["count"]
        else:
            q, ans = (t["value"] for t in row["conversations"])
            if "How many" in q:
                assert ans == str(row["count"])
    # the Energon copy reads as it is: 2 train shards of 5, the last shard is val
    ds = open_multimodal(mm_spec(a["wds"], num_samples=10), cache=False)
    assert len(ds.records) == 10
    assert len(open_multimodal(mm_spec(a["wds"], split_name="valid"), cache=False).records) == 2


def test_spec_validation():
    with pytest.raises(DataError, match="bad_image_policy"):
        mm_spec("x", bad_image_policy="ignore").validate()
    with pytest.raises(DataError, match="tokens_per_image"):
        mm_spec("x", tokens_per_image=100).validate()
    with pytest.raises(DataError, match="wire dtype"):
        mm_spec("x", wire_dtype="float16").validate()
    with pytest.raises(DataError, match="does not exist"):
        open_multimodal(mm_spec("/nonexistent/shards"))
    assert ByteTokenizer().eod_id == 256  # the ids these tests rely on
