"""Hugging Face <-> meshtrain checkpoints: `LlamaForCausalLM` (Llama 3 RoPE scaling included),
`MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` (`llama.py`), `GPT2LMHeadModel`,
for mixture-of-experts models `MixtralForCausalLM` and `Qwen2MoeForCausalLM` (`moe.py`), and
for vision-language models `LlavaForConditionalGeneration` (`llava.py`; a CLIP or SigLIP tower
alone joins a language model's import with `vision_tower=`).

`export_hf(src_root, dst_dir)` turns a training checkpoint into a folder `transformers` loads
(safetensors shards of at most `max_shard_size` with their index, or one `model.safetensors`;
`config.json`, `generation_config.json` when the special-token ids are known, and the run's
`tokenizer.json` with a `tokenizer_config.json`); `import_hf(src, dst_root)` turns such a
folder, or a repo id found in the local Hugging Face cache (`files.model_folder`), into a
step-0 training checkpoint (fresh RNG, no optimizer state) that `meshtrain train --load` continues.
The import records the source's architecture and the config fields meshtrain does not compute
with (special-token ids, Mistral's window, dtype) as the model's `hf_*` settings, which every
later save carries, so the export writes the same model back.
The mapping is a list of `Rule`s (`mapping.py`), one per meshtrain tensor, each naming the HF
tensors it becomes and the two conversions. Every tensor is planned and shape-checked before
anything is written; an unmapped, missing or misshapen tensor is an error, and the export is
built in a temporary folder that is renamed into place only when complete. Both directions
stream one tensor at a time: export writes safetensors itself (`write.py`: headers from the
plan).

    export_hf("runs/a/checkpoints", "out/hf")        # then AutoModelForCausalLM.from_pretrained
    import_hf("out/hf", "runs/b/checkpoints")         # then meshtrain train --load ...
    import_hf("Qwen/Qwen3-0.6B", "runs/c/checkpoints")  # from ~/.cache/huggingface/hub, offline
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import posixpath
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from meshtrain.services.checkpoint import layout
from meshtrain.services.checkpoint.convert import (
    TensorSpec,
    numpy_rng_state,
    open_source,
    save_streaming,
)
from meshtrain.services.checkpoint.hf import llava
from meshtrain.services.checkpoint.hf import tokenizer as hf_tokenizer
from meshtrain.services.checkpoint.hf.files import (
    model_folder,
    open_safetensors,
    read_json,
    safetensors_files,
)
from meshtrain.services.checkpoint.hf.mapping import (
    Rule,
    canonical_names,
    hf_config,
    imported_architecture,
    model_from_hf,
    rules,
)
from meshtrain.services.checkpoint.hf.write import (
    DEFAULT_MAX_SHARD_SIZE,
    LOGICAL,
    parse_size,
    plan_shards,
    write_shards,
)
from meshtrain.services.checkpoint.reader import list_checkpoints, read_tensor
from meshtrain.services.checkpoint.store import Root, open_root, remove_tree
from meshtrain.services.checkpoint.tokenizer_store import (
    METADATA_KEY,
    tokenizer_boxes,
    tokenizer_spec,
)
from meshtrain.services.common.builds import local_build_dir, remove_dead_builds
from meshtrain.services.common.config import to_dict
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig

log = logging.getLogger(__name__)

TRAIN_FORMAT = "meshtrain-train/1"  # meshtrain.services.trainer.checkpoint_state.FORMAT
# HF tensors that are derived buffers, not weights: old GPT-2 files carry the causal mask,
# old Llama files the RoPE inverse frequencies. They are skipped on import.
_DERIVED = (
    ".attn.bias",
    ".attn.masked_bias",
    ".rotary_emb.inv_freq",
    ".embeddings.position_ids",
)
# A tensor an import finds: its shape and logical dtype (None: made here, not read: the new
# projector between a vision tower and a language model).
_Found = tuple[tuple[int, ...], str | None]
# Written first and removed last by an export to an object store (see `export_hf`).
INCOMPLETE = ".meshtrain-export-incomplete"


def _export_dtype(plan: list, specs: dict, model, where: str) -> str:
    """The one dtype of the exported parameters (refused when mixed); a warning where it is not
    the imported model's."""
    dtypes = {specs[r.ours][1] for r in plan}
    if len(dtypes) != 1:
        raise CheckpointError(
            f"{where}: parameters have mixed dtypes {sorted(dtypes)}; "
            "convert to one with `ckpt convert --dtype` first"
        )
    dtype = dtypes.pop()
    if model.hf_torch_dtype not in (None, dtype):
        log.warning(
            "%s: the weights are %s, the imported model's were %s: exporting them as %s "
            "(`meshtrain ckpt convert --dtype` casts a checkpoint first)",
            where,
            dtype,
            model.hf_torch_dtype,
            dtype,
        )
    return dtype


def _remove_failed_export(dst, out: str) -> None:
    """Nothing half-written is left, in place or beside it (closing the failed write uploaded
    what it had), nor the folder marker SeaweedFS keeps for every prefix written."""
    remove_tree(dst, out)
    if not dst.is_local:
        try:
            dst.fs.rm_file(out + "/")
        except FileNotFoundError:
            pass


def export_hf(
    src_root: str,
    dst_dir: str,
    step: int | None = None,
    tokenizer: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    arch: str | None = None,
) -> str:
    """Writes a training checkpoint as a Hugging Face model folder.

    Args:
        src_root: checkpoint root URL.
        dst_dir: the folder to create (local path or fsspec URL); it must not exist, unless it is
            what an interrupted export to an object store left (marked `INCOMPLETE`): replaced.
        step: the step; None exports the latest committed one.
        tokenizer: a `tokenizer.json` (or folder holding one) to ship instead of the run's.
        max_shard_size: bytes of tensor data per safetensors file (an int, or "5GB", "500MB",
            "2GiB"); a model over it is written in shards with `model.safetensors.index.json`.
        arch: the HF model_type to write ("mistral" for a Llama-shaped model); None: the
            imported model's (model.hf_model_type) while the settings fit it, else the one they
            name (see `architecture`).

    Returns:
        `dst_dir`.

    Raises:
        CheckpointError: the model maps to no HF architecture, a tensor is missing, unmapped,
            of the wrong shape or of mixed dtype, the run's tokenizer file is gone, or
            `dst_dir` exists. Nothing is left at `dst_dir` then.
    """
    source = open_source(src_root, step)
    step, where, manifest, model = source.step, source.where, source.manifest, source.model
    limit = parse_size(max_shard_size)
    if arch is None:
        arch = imported_architecture(model, source.metadata, where)
    plan = rules(model, arch)
    _check_tensors(
        {r.ours: r.shape for r in plan}, source.specs, where, ignore=layout.NON_PARAMETER
    )
    dtype = _export_dtype(plan, source.specs, model, where)
    spec = (
        tokenizer
        if tokenizer is not None
        else tokenizer_spec(src_root, step, source.metadata, manifest)
    )
    tokenizer_file = hf_tokenizer.tokenizer_file(spec, where)
    eod = hf_tokenizer.eod_id(tokenizer_file, spec, model, where)
    special, kept = _special_ids(model, tokenizer_file, eod, where)

    dst = open_root(dst_dir)  # the checkpoint store's way in: fresh listings, the run's S3 endpoint
    fs, path = dst.fs, dst.path
    out, marker = _start_export(dst, dst_dir)
    shards = plan_shards(
        ((n, shape) for r in plan for n, shape in zip(r.theirs, r.hf_shapes)), dtype, limit
    )

    def produced():  # (HF name, tensor) in the plan's order, one meshtrain tensor read at a time
        for rule in plan:
            yield from zip(
                rule.theirs, rule.to_hf(read_tensor(src_root, step, rule.ours, manifest=manifest))
            )

    try:
        write_shards(fs, out, shards, dtype, produced())
        config = {**hf_config(model, dtype, eod, arch), **special}
        _write_files(fs, out, config, special, kept, tokenizer_file, model, where)
        if dst.is_local:
            fs.mv(out, path, recursive=True)
        else:
            fs.rm_file(marker)
    except BaseException:
        _remove_failed_export(dst, out)
        raise
    log.info(
        "exported %s to %s (%s, %s, %d safetensors file%s)",
        where,
        dst_dir,
        config["architectures"][0],
        dtype,
        len(shards),
        "" if len(shards) == 1 else "s",
    )
    return dst_dir


def _start_export(dst: Root, dst_dir: str) -> tuple[str, str]:
    """Where an export writes its files (a local build folder beside `dst_dir`, or the object
    store's prefix itself), and the path of its INCOMPLETE marker (written here on an object
    store).

    Raises:
        CheckpointError: `dst_dir` exists, and is not what an interrupted export left.
    """
    fs, path = dst.fs, dst.path
    # A local folder is built beside its place and renamed into it in one step. An object store
    # has no rename (a move copies every object, model.safetensors's gigabytes included), so
    # there the files go straight to their place, config.json last: transformers starts from
    # it, so a folder holding it holds every file, and one left by a crash has none. There an
    # INCOMPLETE object, written first and removed last, marks the prefix as an export in
    # progress, so that one killed (SIGKILL, a lost machine) is told from someone's data, and
    # exporting again replaces it.
    marker = posixpath.join(path, INCOMPLETE)
    if fs.exists(path):
        if dst.is_local or not fs.exists(marker):
            raise CheckpointError(f"export destination {dst_dir!r} already exists")
        log.warning("%s: replacing the leftovers of an interrupted export", dst_dir)
        remove_tree(dst, path)
    out = local_build_dir(path) if dst.is_local else path
    if dst.is_local:
        for folder in remove_dead_builds(path):  # a killed export's, else never removed
            log.warning("removed %s, left by an export to %s that was killed", folder, dst_dir)
        fs.makedirs(out, exist_ok=True)  # object stores have no folders to make
    else:
        fs.pipe_file(marker, b"an export to this prefix began and has not finished\n")
    return out, marker


def _write_files(
    fs: Any,
    out: str,
    config: dict[str, Any],
    special: dict[str, Any],
    kept: bool,
    tokenizer_file: Path | None,
    model: ModelConfig,
    where: str,
) -> None:
    """An export's files besides the weights, into `out` of filesystem `fs`:
    generation_config.json, the tokenizer (with its chat template and tokenizer_config.json) and
    config.json, last."""
    files = {}
    generation = {k: v for k, v in special.items() if v is not None}
    if generation:
        # transformers 5 takes generate()'s stopping ids from here only, not config.json.
        files["generation_config.json"] = generation
    if tokenizer_file is not None:
        fs.put_file(str(tokenizer_file), posixpath.join(out, "tokenizer.json"))
        template = hf_tokenizer.chat_template_file(tokenizer_file)
        if template is not None:
            fs.put_file(str(template), posixpath.join(out, "chat_template.jinja"))
        files["tokenizer_config.json"] = hf_tokenizer.tokenizer_config(
            tokenizer_file, model, where, special if kept else None
        )
    files["config.json"] = config  # last
    for name, content in files.items():
        fs.pipe_file(posixpath.join(out, name), json.dumps(content, indent=2).encode())


def _special_ids(
    model: ModelConfig, tokenizer_file: Path | None, eod: int | None, where: str
) -> tuple[dict[str, Any], bool]:
    """The special-token ids of an export's config.json, and whether they are the imported ones.

    An imported model keeps its config's bos/eos/pad ids (model.hf_*_token_id) while the
    tokenizer shipped is the one imported with it (model.hf_tokenizer_sha256; an import without
    a tokenizer.json keeps them whatever the tokenizer). Otherwise the tokenizer's end of
    document is both bos and eos (None too: a missing key means HF's own default, some other
    token here).
    """
    own = {"bos_token_id": eod, "eos_token_id": eod}
    if model.hf_model_type is None:
        return own, False
    if model.hf_tokenizer_sha256 is not None:
        digest = None
        if tokenizer_file is not None:
            digest = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
        if digest != model.hf_tokenizer_sha256:
            log.info(
                "%s: the tokenizer is not the one imported with the model: its end of document "
                "(%s) is written as bos and eos, not the imported ids",
                where,
                eod,
            )
            return own, False
    ids = {"bos_token_id": model.hf_bos_token_id, "eos_token_id": model.hf_eos_token_id}
    if model.hf_pad_token_id is not None:
        ids["pad_token_id"] = model.hf_pad_token_id
    return ids, True


def _source_model(
    src: Path,
    seq_length: int | None,
    vision_tower: str | None,
    vision: dict[str, Any] | None,
    revision: str | None,
    cache_dir: str | None,
) -> tuple[dict, ModelConfig, Path | None]:
    """The HF config of `src`, the model it describes (with `vision_tower` in front, if given)
    and the tower's folder (None without one)."""
    config_path = src / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{src}: no config.json, so not a Hugging Face model folder")
    hf = read_json(config_path)
    model = model_from_hf(hf, seq_length)
    tower_src = None
    if vision_tower is not None:
        if model.vision is not None:
            raise CheckpointError(f"{src} has a vision tower already (model_type 'llava')")
        tower_src = model_folder(vision_tower, revision, cache_dir)
        model = _with_vision_tower(model, src, tower_src, vision)
    elif vision is not None:
        raise CheckpointError("vision= settings apply with vision_tower= only")
    return hf, model, tower_src


def import_hf(
    src_dir: str,
    dst_root: str,
    seed: int = 1234,
    seq_length: int | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    vision_tower: str | None = None,
    vision: dict[str, Any] | None = None,
) -> str:
    """Writes a Hugging Face model folder as a step-0 meshtrain training checkpoint.

    The checkpoint holds the weights, `metadata.config` (a whole job config whose model
    section comes from `config.json`), no optimizer state (`optimizer_step` 0), and RNG states
    seeded with `seed`, which is what `checkpoint_restore.restore` needs to continue training.

    Args:
        src_dir: local folder with `config.json` and `model.safetensors` (or a sharded
            `model.safetensors.index.json`), or a repo id (`org/name`) or `models--org--name`
            folder of the Hugging Face cache, read offline (`files.model_folder`).
        dst_root: checkpoint root URL, holding no committed checkpoint.
        seed: seeds the stored RNG states.
        seq_length: the model's sequence length (RoPE models); None: max_position_embeddings.
        revision: a cached branch, tag or commit of a repo id; None: main.
        cache_dir: the hub cache; None: HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub.
        vision_tower: a CLIPVisionModel or SiglipVisionModel folder (or cached repo id) to put
            in front of the language model `src_dir`: the checkpoint is then a LLaVA-style model
            whose projector is new (initialized from `seed`), ready for LLaVA's first stage.
        vision: with `vision_tower`, the model.vision keys the tower does not fix
            (image_token_id, which must be a token of the language model's vocabulary;
            select_layer, select_feature, projector, projector_bias).

    Returns:
        The URL of the committed checkpoint.

    Raises:
        CheckpointError: the source is not found, the config cannot be expressed, a tensor is
            missing, unmapped or of the wrong shape or mixed dtype, or `dst_root` already holds a
            committed checkpoint (of any step: `train --load` would resume the latest, not step 0).
    """
    src = model_folder(src_dir, revision, cache_dir)
    hf, model, tower_src = _source_model(src, seq_length, vision_tower, vision, revision, cache_dir)
    _refuse_committed(dst_root)
    kind = "llava" if model.vision is not None else hf["model_type"]  # one `architecture` names
    plan = rules(model, kind)
    sources: list[tuple[Path, Callable[[str], str]]] = [
        (src, canonical_names(kind, tower_src is not None))
    ]
    if tower_src is not None:
        sources.append((tower_src, llava.tower_name))
    stored = _stored_tensors(sources)
    found = _tensor_specs(stored, src)
    fresh: dict[str, torch.Tensor] = {}
    if tower_src is not None:  # a new projector, between a tower and a language model
        fresh = llava.fresh_projector(model, seed)
    dtype = _checked_dtype(found, plan, model, kind, fresh, src)

    def read_hf(name: str) -> torch.Tensor:
        handle, original = stored[name]
        return handle.get_tensor(original)

    by_ours = {r.ours: r for r in plan}

    tokenizer = src / "tokenizer.json"
    # the folder resolved, not the file: in the hub cache the file is a link to a blob
    tokenizer_path = str(src.resolve() / "tokenizer.json") if tokenizer.is_file() else None
    if tokenizer_path is not None:  # the tokenizer the special-token ids belong to
        digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
        model = dataclasses.replace(model, hf_tokenizer_sha256=digest)
    carried, record = tokenizer_boxes(tokenizer_path)  # the checkpoint carries the file itself
    carried_tensors = {box.array: tensor for box, tensor in carried}

    def load(name: str) -> torch.Tensor:
        if name == "rng.torch_cpu":
            return torch.Generator().manual_seed(seed).get_state()
        if name in carried_tensors:
            return carried_tensors[name]
        if name in fresh:
            return fresh[name].to(layout.torch_dtype(dtype))
        rule = by_ours[name]
        return rule.from_hf([read_hf(t) for t in rule.theirs]).contiguous()

    specs: dict[str, TensorSpec] = {r.ours: (r.shape, dtype) for r in plan}
    specs["rng.torch_cpu"] = (tuple(torch.get_rng_state().shape), "uint8")
    specs.update({box.array: (box.global_shape, box.dtype) for box, _ in carried})
    metadata = _import_metadata(model, seed, tokenizer_path, record, src, kind, tower_src)
    url, _ = save_streaming(dst_root, 0, specs, load, metadata, desc="import")
    return url


def _with_vision_tower(
    model: ModelConfig, src: Path, tower_src: Path, vision: dict[str, Any] | None
) -> ModelConfig:
    """The language model `model` (of `src`) with the vision tower of folder `tower_src` in
    front: a LLaVA-style model (`import_hf`'s vision_tower=, with its `vision` settings)."""
    if not (tower_src / "config.json").is_file():
        raise CheckpointError(f"{tower_src}: no config.json, so not a Hugging Face model folder")
    if vision is None or "image_token_id" not in vision:
        raise CheckpointError(
            "a vision tower needs vision={'image_token_id': ...}: the placeholder token of "
            "the language model's vocabulary that image features take the place of"
        )
    encoder = llava.vision_from_hf(read_json(tower_src / "config.json"), **vision)
    try:
        return dataclasses.replace(model, vision=encoder, hf_model_type="llava")
    except ValueError as e:
        raise CheckpointError(f"{tower_src} with {src}: {e}") from e


def _refuse_committed(dst_root: str) -> None:
    """An import's root must hold no committed checkpoint: step 0 would be passed over by
    `train --load`, which resumes the latest step."""
    existing = list_checkpoints(dst_root)
    if existing:
        raise CheckpointError(
            f"{dst_root!r} already holds committed checkpoints "
            f"{existing[:5]}{' ...' if len(existing) > 5 else ''}: "
            "`meshtrain train --load` would resume the latest of them, not the import (step 0); "
            "import into an empty root"
        )


def _stored_tensors(
    sources: list[tuple[Path, Callable[[str], str]]],
) -> dict[str, tuple[Any, str]]:
    """HF name -> (the safetensors file's handle, the name there), over the source folders,
    each with its renaming to the names the rules use; derived buffers left out."""
    stored: dict[str, tuple[Any, str]] = {}
    for folder, rename in sources:
        files = safetensors_files(folder)
        missing = sorted(f for f in set(files.values()) if not (folder / f).is_file())
        if missing:
            raise CheckpointError(
                f"{folder}: the safetensors index names files that are not there: {missing}"
            )
        handles = {f: open_safetensors(folder / f) for f in set(files.values())}
        for n, f in files.items():
            if n.endswith(_DERIVED):
                continue
            if n not in handles[f].keys():  # noqa: SIM118 (not a dict)
                raise CheckpointError(
                    f"{folder}: model.safetensors.index.json puts tensor {n!r} in {f}, which "
                    "does not hold it (a shard from another download?)"
                )
            stored[rename(n)] = (handles[f], n)
    return stored


def _tensor_specs(stored: dict[str, tuple[Any, str]], src: Path) -> dict[str, _Found]:
    """The shape and logical dtype of every stored tensor, read from the headers."""
    found: dict[str, _Found] = {}
    for name, (handle, original) in stored.items():
        tensor_slice = handle.get_slice(original)
        dtype = LOGICAL.get(tensor_slice.get_dtype())
        if dtype is None:
            raise CheckpointError(
                f"{src}: tensor {original!r} has unsupported dtype {tensor_slice.get_dtype()}"
            )
        found[name] = (tuple(tensor_slice.get_shape()), dtype)
    return found


def _checked_dtype(
    found: dict[str, _Found],
    plan: list[Rule],
    model: ModelConfig,
    kind: str,
    fresh: dict[str, torch.Tensor],
    src: Path,
) -> str:
    """The one logical dtype of the tensors an import reads, once every tensor the plan wants
    is found (a tied output layer's stored copy and SigLIP's pooling head left out, the `fresh`
    projector's tensors made here) with its shape, and nothing is left unmapped."""
    head = "language_model.lm_head.weight" if kind == "llava" else "lm_head.weight"
    if not model.untie_embeddings_and_output_weights:
        found.pop(head, None)  # tied: HF ignores a stored copy, so do we
    dropped = [n for n in found if n.startswith(llava.SIGLIP_HEAD)]
    if dropped:  # SigLIP's pooling head: no part of a LLaVA model
        log.info(
            "%s: SigLIP's attention-pooling head (%d tensors) is not imported", src, len(dropped)
        )
        for n in dropped:
            del found[n]
    # a new projector, between a tower and a language model: no file holds it
    found.update({r.theirs[0]: (r.shape, None) for r in plan if r.ours in fresh})
    wanted = {t: s for r in plan for t, s in zip(r.theirs, r.hf_shapes)}
    _check_tensors(wanted, found, f"HF folder {src}", ignore=())
    dtypes = {d for t in wanted if (d := found[t][1]) is not None}  # the new projector's: none
    if len(dtypes) != 1:
        raise CheckpointError(f"HF folder {src}: tensors have mixed dtypes {sorted(dtypes)}")
    return dtypes.pop()


def _import_metadata(
    model: ModelConfig,
    seed: int,
    tokenizer_path: str | None,
    record: dict[str, Any] | None,
    src: Path,
    kind: str,
    tower_src: Path | None,
) -> dict[str, Any]:
    """A step-0 training checkpoint's metadata: the model section, no training yet, RNG states
    seeded with `seed`, the carried tokenizer and where the import came from."""
    return {
        "format": TRAIN_FORMAT,
        "iteration": 0,
        "consumed_samples": 0,
        "optimizer_step": 0,
        "config": {"model": to_dict(model)},  # an import has an architecture, no training settings
        "rng_python": random.Random(seed).getstate(),
        "rng_numpy": numpy_rng_state(seed),
        "tokenizer": tokenizer_path,
        **({METADATA_KEY: record} if record else {}),
        "imported_from": {
            "url": str(src.resolve()),
            "format": "hf",
            "architecture": kind,
            **({"vision_tower": str(tower_src.resolve())} if tower_src is not None else {}),
        },
    }


def _check_tensors(
    wanted: dict[str, tuple[int, ...]],
    have: Mapping[str, _Found],
    where: str,
    ignore: tuple[str, ...],
) -> None:
    """Raises CheckpointError naming missing, misshapen and unmapped tensors."""
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise CheckpointError(
            f"{where}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    wrong = [
        f"{n} is {have[n][0]}, expected {s}"
        for n, s in wanted.items()
        if tuple(have[n][0]) != tuple(s)
    ]
    if wrong:
        raise CheckpointError(f"{where}: wrong shapes: {'; '.join(wrong[:5])}")
    unmapped = sorted(n for n in have if n not in wanted and not (ignore and n.startswith(ignore)))
    if unmapped:
        raise CheckpointError(f"{where}: tensors with no mapping {unmapped[:5]}")
