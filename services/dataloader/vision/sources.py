"""Where image-text records come from, and the index that reads any one of them directly.

Three inputs, each named by a path (`open_records`):

- a folder of WebDataset tar shards (`*.tar`, sorted by name) or one `.tar` file: files are
  grouped into records by key as WebDataset does (consecutive members whose names agree up to
  the first dot of the base name: `KEY.jpg` + `KEY.txt`); a record holds its images
  (`jpg jpeg png webp bmp gif tif tiff ppm`, several as `KEY.0.png`, `KEY.1.png`, in name
  order) and a caption (`txt`) or a conversation (`json`: a LLaVA `[{"from": "human", "value":
  "<image>\\n..."}, {"from": "gpt", ...}]` list or an object with `conversations` or `messages`);
- an Energon-prepared dataset, read as it is: a folder with `.nv-meta/` whose `split.yaml` (or
  `split.json`) lists each split part's shards (`train`, `val`, `test`) and what to `exclude`
  (whole shards, or `shard/index` samples), whose `.info.yaml` (or `.info.json`) gives every
  shard's sample count (checked against the shard), and whose `dataset.yaml` `field_map` names the
  extension of each field of a `CaptioningSample` (`image`, `caption`) or `VQASample` (`image`,
  `context`, `answers`);
- a JSONL file of `{"image": "rel/path.png" or [...], "text": ...}` (or `"conversations"` /
  `"messages"`), image paths relative to the file's folder (and never outside it).

Shards are indexed once: every member's byte offset and size (tar headers only, no data read),
cached on disk like the text datasets' sample indices (`index_cache.cached_arrays`, keyed by each
shard's path, size and modification time), so a record is one seek and one read of each of its
files, and any worker reads any record. Tars are read with Python's `tarfile` rather than the
`webdataset` package: webdataset streams shards front to back, while exactly-once batches that
are a pure function of the step need random access by record.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshtrain.services.common.errors import DataError
from meshtrain.services.dataloader.index_cache import IndexCache, cached_arrays
from meshtrain.services.dataloader.samples import split_ranges

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm")
NV_META = ".nv-meta"
INDEX_CACHE_DIR = ".meshtrain-index"
ENERGON_SPLITS = {"train": "train", "valid": "val", "test": "test"}
_KEY = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]*)$")  # WebDataset's key/extension split
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class BadRecordError(DataError):
    """A record that cannot be trained on (an undecodable image, malformed text, too long); the
    message names it. `data.bad_image_policy` decides whether the run stops or skips it."""


class BadImageError(BadRecordError):
    """An image that cannot be read or decoded; the message names its shard and key, or file."""


@dataclass
class Record:
    """One sample's raw content: encoded images and its text, as a caption or a conversation."""

    name: str  # where it is: "shard.tar/KEY" or "file.jsonl:LINE"
    images: list[tuple[bytes, str]] = field(default_factory=list)  # (bytes, "where") in order
    caption: str | None = None
    conversation: list[tuple[str, str]] | None = None  # (role, text), role user/assistant/system


def parse_conversation(value, where: str) -> list[tuple[str, str]]:
    """(role, text) turns of a LLaVA `[{"from", "value"}]` list or `[{"role", "content"}]`
    messages (content a string or a list of `{"type": "text"|"image"}` parts: an image part is
    the `<image>` tag). Raises DataError naming `where`."""
    if isinstance(value, dict):
        for key in ("conversations", "messages"):
            if key in value:
                return parse_conversation(value[key], where)
        raise BadRecordError(f"{where}: a JSON object without 'conversations' or 'messages'")
    if not isinstance(value, list) or not value:
        raise BadRecordError(f"{where}: a conversation must be a non-empty list of turns")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise BadRecordError(f"{where}: turn {i} is not an object")
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if role not in ROLES:
            raise BadRecordError(f"{where}: turn {i} has role {role!r}, not one of {sorted(ROLES)}")
        if isinstance(text, list):  # content parts
            parts = []
            for p in text:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "image":
                    parts.append("<image>")
                elif kind == "text" and isinstance(p.get("text"), str):
                    parts.append(p["text"])
                else:
                    raise BadRecordError(f"{where}: turn {i} has a content part {p!r}")
            text = "".join(parts)
        if not isinstance(text, str):
            raise BadRecordError(f"{where}: turn {i} has no text ('value' or 'content')")
        turns.append((ROLES[role], text))
    if not any(role == "assistant" for role, _ in turns):
        raise BadRecordError(f"{where}: the conversation has no assistant turn to train on")
    return turns


def _fingerprint(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _scan_shards(shards: list[Path]) -> dict[str, np.ndarray]:
    """Every regular file member of the shards: shard number, data offset, size and name."""
    shard_of, offsets, sizes, names = [], [], [], []
    for s, path in enumerate(shards):
        try:
            with tarfile.open(path, mode="r:") as tar:
                for m in tar:
                    if m.isfile():
                        shard_of.append(s)
                        offsets.append(m.offset_data)
                        sizes.append(m.size)
                        names.append(m.name.encode("utf-8", "surrogateescape"))
        except (tarfile.TarError, OSError) as e:
            raise DataError(f"shard {path}: not a readable tar file: {e}") from e
    width = max((len(n) for n in names), default=1)
    return {
        "shard": np.asarray(shard_of, np.int32),
        "offset": np.asarray(offsets, np.int64),
        "size": np.asarray(sizes, np.int64),
        "name": np.asarray(names, dtype=f"S{width}"),
    }


class ShardRecords:
    """The records of WebDataset shards, by number: consecutive members grouped by key."""

    def __init__(
        self,
        shards: list[Path],
        cache: str | os.PathLike | IndexCache | None,
        field_map: dict[str, str] | None = None,
        counts: dict[str, int] | None = None,
        exclude: set[tuple[str, int]] | None = None,
        names: list[str] | None = None,
    ):
        """Args:
        shards: tar files, in order.
        cache: where the member index is cached (None: built in memory each time).
        field_map: Energon's field -> extension (image, caption, context, answers); None: by
            extension.
        counts: shard name -> sample count to check (Energon's `.info.yaml`).
        exclude: (shard name, index in shard) samples to leave out.
        names: each shard's name in `counts` and `exclude` (default: its file name).
        """
        if not shards:
            raise DataError("no tar shards to read")
        self.shards = shards
        self.shard_names = names if names is not None else [p.name for p in shards]
        self.field_map = field_map
        desc = {"kind": "webdataset-members", "shards": [_fingerprint(p) for p in shards]}
        m = cached_arrays(cache, desc, lambda: _scan_shards(shards))
        self.m_shard, self.m_offset, self.m_size = m["shard"], m["offset"], m["size"]
        self.m_name = [bytes(n).decode("utf-8", "surrogateescape") for n in m["name"]]
        keys = [None if (k := _KEY.match(n)) is None else k.group(1) for n in self.m_name]
        # a record: a run of members with one key in one shard
        begins: list[int] = []
        for i, key in enumerate(keys):
            if key is None:
                continue  # a member without an extension (or a hidden file) belongs to nothing
            if begins and keys[begins[-1]] == key and self.m_shard[begins[-1]] == self.m_shard[i]:
                continue
            begins.append(i)
        self.begins = begins
        self.ends = begins[1:] + [len(keys)]
        self.keys = keys
        in_shard = np.zeros(len(begins), np.int64)  # index of each record in its shard
        per_shard = np.zeros(len(shards), np.int64)
        for r, b in enumerate(begins):
            s = self.m_shard[b]
            in_shard[r] = per_shard[s]
            per_shard[s] += 1
        if counts is not None:
            for s, path in enumerate(shards):
                want = counts.get(self.shard_names[s])
                if want is not None and want != per_shard[s]:
                    raise DataError(
                        f"shard {path} holds {per_shard[s]} samples but .nv-meta/.info.yaml says "
                        f"{want}: the shard changed since `energon prepare`; prepare it again"
                    )
        keep = [
            r
            for r in range(len(begins))
            if not exclude
            or (self.shard_names[self.m_shard[begins[r]]], int(in_shard[r])) not in exclude
        ]
        self.records = np.asarray(keep, np.int64)

    def __len__(self) -> int:
        return len(self.records)

    def name(self, i: int) -> str:
        b = self.begins[int(self.records[i])]
        return f"{self.shards[self.m_shard[b]]}/{self.keys[b]}"

    def read(self, i: int) -> Record:
        r = int(self.records[i])
        b, e = self.begins[r], self.ends[r]
        shard = self.shards[self.m_shard[b]]
        key = self.keys[b]
        assert key is not None  # a record begins at a member with a key
        files: dict[str, bytes] = {}
        with open(shard, "rb") as f:
            for j in range(b, e):
                ext = self.m_name[j][len(key) + 1 :]
                f.seek(int(self.m_offset[j]))
                files[ext] = f.read(int(self.m_size[j]))
        rec = Record(name=f"{shard}/{key}")
        fm = self.field_map
        image_exts = (
            [fm["image"]]
            if fm and "image" in fm
            else sorted(x for x in files if x.rsplit(".", 1)[-1].lower() in IMAGE_EXTS)
        )
        for x in image_exts:
            if x in files:
                rec.images.append((files[x], f"{rec.name}.{x}"))
        if fm and ("context" in fm or "answers" in fm):  # Energon VQASample
            context = _text(files, fm.get("context"), rec.name)
            answers = _text(files, fm.get("answers"), rec.name)
            try:  # answers may be a JSON list; the first is the target
                parsed = json.loads(answers)
                answers = parsed[0] if isinstance(parsed, list) and parsed else answers
            except ValueError:
                pass
            rec.conversation = [("user", context), ("assistant", str(answers))]
        elif fm and "caption" in fm:
            rec.caption = _text(files, fm["caption"], rec.name)
        elif "json" in files:
            try:
                value = json.loads(files["json"])
            except ValueError as e:
                raise BadRecordError(f"{rec.name}.json: not JSON: {e}") from e
            rec.conversation = parse_conversation(value, f"{rec.name}.json")
        elif "txt" in files:
            rec.caption = _text(files, "txt", rec.name)
        else:
            raise BadRecordError(
                f"{rec.name}: no caption (.txt) or conversation (.json) among {sorted(files)}"
            )
        return rec


def _text(files: dict[str, bytes], ext: str | None, where: str) -> str:
    if ext is None or ext not in files:
        raise BadRecordError(f"{where}: no .{ext} file among {sorted(files)}")
    try:
        return files[ext].decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecordError(f"{where}.{ext}: not UTF-8 text: {e}") from e


def _load_yaml_or_json(folder: Path, stem: str, what: str):
    for ext in (".yaml", ".json"):
        path = folder / f"{stem}{ext}"
        if path.is_file():
            text = path.read_text()
            if ext == ".json":
                return json.loads(text)
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                raise DataError(
                    f"{path}: reading an Energon dataset's YAML needs PyYAML: "
                    "pip install 'meshtrain[vision]'"
                ) from None
            return yaml.safe_load(text)
    raise DataError(f"{folder}: no {stem}.yaml or {stem}.json ({what})")


def _braces(pattern: str) -> list[str]:
    """Brace expansion of shard names as Energon's split files use: `a_{000..002}.tar`, `{a,b}`."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail, body = pattern[: m.start()], pattern[m.end() :], m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        a, b = rng.groups()
        width = len(a) if a.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(a), int(b) + 1)]
    else:
        items = body.split(",")
    return [x for item in items for x in _braces(head + item + tail)]


def energon_shards(
    folder: Path, split_name: str
) -> tuple[list[str], dict[str, int], set[tuple[str, int]], dict[str, str] | None]:
    """(shard names, sample counts, excluded samples, field map) of split `split_name` ("train",
    "valid" or "test") of an Energon-prepared dataset."""
    meta = folder / NV_META
    split = _load_yaml_or_json(meta, "split", "the split parts")
    info = _load_yaml_or_json(meta, ".info", "the shards' sample counts")
    part = ENERGON_SPLITS[split_name]
    parts = (split or {}).get("split_parts") or {}
    if part not in parts:
        raise DataError(f"{meta}/split.yaml has no split part {part!r} (it has {sorted(parts)})")
    excluded = {x for e in (split.get("exclude") or []) for x in _braces(str(e))}
    counts = {str(k): int(v) for k, v in ((info or {}).get("shard_counts") or {}).items()}
    shards = []
    for name in (x for p in parts[part] or [] for x in _braces(str(p))):
        if name in excluded:
            continue
        if name not in counts:
            raise DataError(f"{meta}: shard {name} of split {part!r} is not in .info.yaml")
        shards.append(name)
    if not shards:
        raise DataError(f"{meta}: split part {part!r} has no shards (after `exclude`)")
    samples: set[tuple[str, int]] = set()
    for e in excluded:
        shard, sep, idx = e.rpartition("/")
        if sep and idx.isdigit():
            samples.add((shard, int(idx)))
    field_map = None
    if (meta / "dataset.yaml").is_file() or (meta / "dataset.json").is_file():
        desc = _load_yaml_or_json(meta, "dataset", "the sample type") or {}
        if "sample_loader" in desc:
            raise DataError(
                f"{meta}/dataset.yaml reads samples with a Python sample_loader, which meshtrain "
                "does not run; give a field_map (or plain KEY.jpg + KEY.txt/KEY.json files)"
            )
        cls = (desc.get("sample_type") or {}).get("__class__")
        if cls not in (None, "CaptioningSample", "VQASample", "VQAOCRSample"):
            raise DataError(
                f"{meta}/dataset.yaml has sample type {cls}; meshtrain reads CaptioningSample "
                "and VQASample field maps (or plain KEY.jpg + KEY.txt/KEY.json files)"
            )
        fm = desc.get("field_map")
        if fm is not None:
            field_map = {str(k): str(v) for k, v in fm.items()}
    return shards, counts, samples, field_map


class JsonlRecords:
    """The records of a JSONL file of texts whose images lie in the file's folder."""

    def __init__(self, path: Path, cache: str | os.PathLike | IndexCache | None):
        self.path = path
        self.folder = path.parent.resolve()

        def build() -> dict[str, np.ndarray]:
            starts = [0]
            with open(path, "rb") as f:
                for line in f:
                    starts.append(starts[-1] + len(line))
            s = np.asarray(starts, np.int64)
            return {"starts": s}

        starts = cached_arrays(cache, {"kind": "jsonl-lines", "file": _fingerprint(path)}, build)[
            "starts"
        ]
        lengths = np.diff(starts)
        self.starts = starts[:-1]
        self.lengths = lengths
        # blank lines are not records
        self.lines = np.flatnonzero(lengths > 1).astype(np.int64)

    def __len__(self) -> int:
        return len(self.lines)

    def name(self, i: int) -> str:
        return f"{self.path}:{int(self.lines[i]) + 1}"

    def read(self, i: int) -> Record:
        line = int(self.lines[i])
        where = f"{self.path}:{line + 1}"
        with open(self.path, "rb") as f:
            f.seek(int(self.starts[line]))
            raw = f.read(int(self.lengths[line]))
        try:
            row = json.loads(raw)
        except ValueError as e:
            raise BadRecordError(f"{where}: not a JSON object: {e}") from e
        if not isinstance(row, dict):
            raise BadRecordError(f"{where}: not a JSON object")
        rec = Record(name=where)
        images = row.get("image", row.get("images", []))
        images = [images] if isinstance(images, str) else images
        if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
            raise BadRecordError(f"{where}: 'image' must be a path or a list of paths")
        for rel in images:
            p = (self.folder / rel).resolve()
            if not p.is_relative_to(self.folder):
                raise BadRecordError(f"{where}: image {rel!r} lies outside {self.folder}")
            try:
                rec.images.append((p.read_bytes(), str(p)))
            except OSError as e:
                raise BadImageError(f"{p}: cannot read image: {e}") from e
        if "conversations" in row or "messages" in row:
            rec.conversation = parse_conversation(row, where)
        else:
            text = row.get("text", row.get("caption"))
            if not isinstance(text, str):
                raise BadRecordError(
                    f"{where}: give 'text' (a caption) or 'conversations'/'messages' (turns)"
                )
            rec.caption = text
        return rec


class Records:
    """Several sources' records end to end, restricted to one split."""

    def __init__(self, parts: list, split: str, split_name: str, energon: list[bool]):
        self.parts = parts
        # a plain source's records are cut into train/valid/test like text documents; an
        # Energon dataset's split is its own split.yaml's
        ranges = []
        for part, is_energon in zip(parts, energon):
            if is_energon:
                ranges.append((0, len(part)))
            else:
                from meshtrain.services.dataloader.spec import SPLITS

                ranges.append(split_ranges(len(part), split)[SPLITS.index(split_name)])
        self.ranges = ranges
        self.offsets = np.cumsum([0] + [b - a for a, b in ranges])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, i: int):
        p = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[p], self.ranges[p][0] + i - int(self.offsets[p])

    def name(self, i: int) -> str:
        part, j = self._locate(i)
        return part.name(j)

    def read(self, i: int) -> Record:
        part, j = self._locate(i)
        return part.read(j)


def open_records(
    paths: list[str],
    split: str,
    split_name: str,
    cache: bool | str | os.PathLike | IndexCache = True,
) -> Records:
    """The records of split `split_name` of the sources at `paths` (see the module docstring).

    Args:
        paths: Energon dataset folders, folders of `*.tar` shards, `.tar` files, `.jsonl` files.
        split: train/valid/test weights over a plain source's records ("969,30,1").
        split_name: "train", "valid" or "test".
        cache: True: cache shard indices beside the data (`.meshtrain-index/`); a folder or an
            `IndexCache`: there; False: build them in memory.
    """
    parts: list[ShardRecords | JsonlRecords] = []
    energon: list[bool] = []
    for p in paths:
        if "://" in p:
            raise DataError(f"multimodal source {p}: only local paths are read (no URLs)")
        path = Path(p)
        if not path.exists():
            raise DataError(f"multimodal source {p} does not exist")
        folder = path if path.is_dir() else path.parent
        where: str | os.PathLike | IndexCache | None
        if cache is True:
            where = folder / INDEX_CACHE_DIR
        elif cache is False:
            where = None
        else:
            where = cache
        if path.is_dir() and (path / NV_META).is_dir():
            names, counts, exclude, fm = energon_shards(path, split_name)
            shards = [path / n for n in names]
            parts.append(ShardRecords(shards, where, fm, counts, exclude, names))
            energon.append(True)
        elif path.is_dir():
            shards = sorted(path.glob("*.tar"))
            if not shards:
                raise DataError(
                    f"multimodal source {p}: a folder without *.tar shards or .nv-meta/"
                )
            parts.append(ShardRecords(shards, where))
            energon.append(False)
        elif path.suffix == ".tar":
            parts.append(ShardRecords([path], where))
            energon.append(False)
        elif path.suffix in (".jsonl", ".json"):
            parts.append(JsonlRecords(path, where))
            energon.append(False)
        else:
            raise DataError(
                f"multimodal source {p}: expected an Energon dataset folder, a folder of .tar "
                "shards, a .tar file or a .jsonl file"
            )
    records = Records(parts, split, split_name, energon)
    if len(records) == 0:
        raise DataError(f"the {split_name} split of {paths} holds no records")
    return records
