"""Megatron Core `torch_dist` checkpoints <-> meshtrain checkpoints, for GPT models (LayerNorm,
GELU, learned or RoPE positions) and Llama-style ones (RMSNorm, SwiGLU, RoPE, grouped-query
attention, untied output).

A `torch_dist` folder is a torch.distributed.checkpoint (DCP) checkpoint: `.metadata`, the
`__R_T.distcp` data files, `common.pt` (the non-tensor state: Megatron-LM's `args`, `iteration`)
and `metadata.json` naming the backend. Each rank writes its chunks of tensors indexed in global
coordinates, so DCP reassembles whole tensors whatever the TP/PP degrees that wrote them, and
per-layer tensors are stacked on a leading layer axis
(`decoder.layers.self_attention.linear_qkv.weight` is (num_layers, rows, hidden)). The fused qkv
rows are per query group [its q heads; k; v] and SwiGLU's `linear_fc1` is [gate; up] -- meshtrain's
canonical orders, so the weights map one to one; layer norms are saved under the TE names
(`linear_qkv.layer_norm_weight`; the local layer spec maps its own to them), and the local ones
(`input_layernorm.weight`) are accepted too. `import_megatron`
reads such a folder on one process, with no process group, one stacked tensor at a time through
the DCP API, and writes a step-0 meshtrain checkpoint (no optimizer state); `export_megatron`
writes the reverse as a Megatron-LM `release` checkpoint (`DST/release/` and
`DST/latest_checkpointed_iteration.txt`), which `dist_checkpointing.load` and `--load DST` read.
The architecture comes from the saved `args` where there are any, else from Megatron-style
flags (`args.py`).

    import_megatron("ckpts/gpt", "runs/b/checkpoints")     # ckpts/gpt/iter_0000100 or the root
    export_megatron("runs/b/checkpoints", "out/megatron")  # then --load out/megatron
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtrain.services.checkpoint.convert import numpy_rng_state, open_source, save_streaming
from meshtrain.services.checkpoint.megatron.args import (
    check_exportable,
    megatron_flags,
    model_from_megatron,
    read_common,
    refuse_unsupported_keys,
)
from meshtrain.services.checkpoint.reader import list_checkpoints, read_tensor
from meshtrain.services.common.builds import local_build_dir, remove_dead_builds
from meshtrain.services.common.config import to_dict
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
TRAIN_FORMAT = "meshtrain-train/1"
BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
"""metadata.json of a megatron-core torch_dist checkpoint."""
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


@dataclass(frozen=True)
class Rule:
    """One meshtrain tensor per layer (or a global one) and the Megatron tensor(s) holding it.

    Attributes:
        ours: meshtrain name; "{i}" stands for the layer of a per-layer tensor.
        theirs: Megatron keys, the first of each tuple being the one export writes (import also
            accepts the others: the TE and local layer-norm names).
        shape: meshtrain shape (of one layer).
        layered: the Megatron tensor has a leading layer axis.
    """

    ours: str
    theirs: tuple[str, ...]
    shape: tuple[int, ...]
    layered: bool


def rules(model: ModelConfig) -> list[Rule]:
    """The mapping of every meshtrain parameter of `model` to Megatron Core's GPTModel keys.

    Raises:
        CheckpointError: the model has mixture-of-experts layers, or RoPE scaling Megatron cannot
            express, or its vocabulary size is unset.
    """
    check_exportable(model)
    h, v, ffn, d = model.hidden_size, model.vocab_size, model.ffn_size, model.head_dim
    if v is None:
        raise CheckpointError("model.vocab_size is unset: the mapping to Megatron needs it")
    qkv_rows = (model.num_attention_heads + 2 * model.groups) * d
    fc1_rows = 2 * ffn if model.activation == "swiglu" else ffn
    out = [
        Rule(
            "embedding.word_embeddings.weight", ("embedding.word_embeddings.weight",), (v, h), False
        )
    ]
    if model.position_embedding_type == "learned":
        out.append(
            Rule(
                "embedding.position_embeddings.weight",
                ("embedding.position_embeddings.weight",),
                (model.max_positions, h),
                False,
            )
        )
    norms = ("weight", "bias") if model.normalization == "layernorm" else ("weight",)
    for s in norms:
        out.append(
            Rule(
                f"layers.{{i}}.input_norm.{s}",
                (
                    f"decoder.layers.self_attention.linear_qkv.layer_norm_{s}",
                    f"decoder.layers.input_layernorm.{s}",
                ),
                (h,),
                True,
            )
        )
    qkv_suffixes = ("weight", "bias") if model.add_bias_linear or model.qkv_bias else ("weight",)
    for s in qkv_suffixes:
        out.append(
            Rule(
                f"layers.{{i}}.attention.qkv.{s}",
                (f"decoder.layers.self_attention.linear_qkv.{s}",),
                (qkv_rows, h) if s == "weight" else (qkv_rows,),
                True,
            )
        )
    if model.qk_norm:
        for p in "qk":
            out.append(
                Rule(
                    f"layers.{{i}}.attention.{p}_norm.weight",
                    (f"decoder.layers.self_attention.{p}_layernorm.weight",),
                    (d,),
                    True,
                )
            )
    biases = ("weight", "bias") if model.add_bias_linear else ("weight",)
    for s in biases:
        out.append(
            Rule(
                f"layers.{{i}}.attention.proj.{s}",
                (f"decoder.layers.self_attention.linear_proj.{s}",),
                (h, model.num_attention_heads * d) if s == "weight" else (h,),
                True,
            )
        )
    for s in norms:
        out.append(
            Rule(
                f"layers.{{i}}.pre_mlp_norm.{s}",
                (
                    f"decoder.layers.mlp.linear_fc1.layer_norm_{s}",
                    f"decoder.layers.pre_mlp_layernorm.{s}",
                ),
                (h,),
                True,
            )
        )
    for s in biases:
        out.append(
            Rule(
                f"layers.{{i}}.mlp.fc1.{s}",
                (f"decoder.layers.mlp.linear_fc1.{s}",),
                (fc1_rows, h) if s == "weight" else (fc1_rows,),
                True,
            )
        )
        out.append(
            Rule(
                f"layers.{{i}}.mlp.fc2.{s}",
                (f"decoder.layers.mlp.linear_fc2.{s}",),
                (h, ffn) if s == "weight" else (h,),
                True,
            )
        )
    for s in norms:
        out.append(Rule(f"final_norm.{s}", (f"decoder.final_layernorm.{s}",), (h,), False))
    if model.untie_embeddings_and_output_weights:
        out.append(Rule("output_layer.weight", ("output_layer.weight",), (v, h), False))
    return out


def checkpoint_folder(src: str, iteration: int | None = None) -> tuple[Path, int | None]:
    """The torch_dist folder `src` names, and its iteration (None for a release or unknown).

    `src` is a Megatron-LM checkpoint root (with `latest_checkpointed_iteration.txt`, holding
    `iter_NNNNNNN/` or `release/` folders) or one such folder itself (what
    `dist_checkpointing.save(state_dict, folder)` writes).

    Raises:
        CheckpointError: not a torch_dist checkpoint, the iteration asked for or the tracker's is
            not there, or the tracker file is unreadable; names the path.
    """
    root = Path(src)
    if not root.is_dir():
        raise CheckpointError(f"Megatron checkpoint {src!r} is not a folder")
    tracker = root / TRACKER
    if (root / ".metadata").is_file() and iteration is None:
        return root, None
    if iteration is not None:
        folder = root / f"iter_{iteration:07d}"
    elif tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            folder = root / "release"
        elif text.isdigit():
            iteration = int(text)
            folder = root / f"iter_{iteration:07d}"
        else:
            raise CheckpointError(
                f"{tracker}: holds {text[:40]!r}, neither an iteration number nor 'release'"
            )
    else:
        raise CheckpointError(
            f"{src}: neither a torch_dist checkpoint folder (no .metadata) nor a Megatron-LM "
            f"checkpoint root (no {TRACKER})"
        )
    if not (folder / ".metadata").is_file():
        raise CheckpointError(
            f"{folder}: no .metadata, so not a torch_dist checkpoint folder"
            + ("" if folder.is_dir() else " (the folder is not there)")
        )
    return folder, iteration


def _check_backend(folder: Path) -> None:
    path = folder / "metadata.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no metadata.json, so not a megatron-core dist checkpoint")
    try:
        backend = json.loads(path.read_text()).get("sharded_backend")
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a JSON object ({e})") from None
    if backend != "torch_dist":
        raise CheckpointError(
            f"{path}: sharded_backend {backend!r} is not supported; only 'torch_dist'"
        )


def _tensor_metadata(folder: Path) -> dict[str, TensorStorageMetadata]:
    try:
        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata unpickles into anything
        raise CheckpointError(
            f"{folder}/.metadata: not readable as a torch.distributed.checkpoint index "
            f"({type(e).__name__}: {e})"
        ) from None
    return {
        k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
    }


def _read_dcp(folder: Path, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
    """One whole tensor of the checkpoint, assembled from every rank's chunks."""
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({key: tensor}, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    except (
        Exception,
        CheckpointException,
    ) as e:  # DCP's, a BaseException, wraps a missing or short file
        raise CheckpointError(
            f"{folder}: reading tensor {key!r} failed, a data file is missing or corrupt "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from None
    return tensor


def import_megatron(
    src: str,
    dst_root: str,
    iteration: int | None = None,
    flags: dict[str, Any] | None = None,
    seed: int = 1234,
) -> str:
    """Writes a megatron-core torch_dist checkpoint's weights as a step-0 meshtrain checkpoint.

    Args:
        src: a torch_dist folder, or a Megatron-LM checkpoint root (see `checkpoint_folder`).
        dst_root: meshtrain checkpoint root holding no committed checkpoint.
        iteration: the `iter_NNNNNNN` folder to read under a root; None: the tracker's.
        flags: Megatron argument names -> values (`num_attention_heads`, `rotary_base`, ...),
            over those of the saved `args`; needed where the checkpoint has none.
        seed: seeds the stored RNG states.

    Returns:
        The URL of the committed checkpoint.

    Raises:
        CheckpointError: not a torch_dist checkpoint, a fact of the architecture missing (names
            the flag to give), an unsupported feature (MoE, MLA, ...), a missing, misshapen or
            unmapped tensor, a corrupt file, or `dst_root` already holding a checkpoint.
    """
    folder, iteration = checkpoint_folder(src, iteration)
    _check_backend(folder)
    common = read_common(folder)
    metas = _tensor_metadata(folder)
    model_keys = {
        k: tuple(m.size)
        for k, m in metas.items()
        if k.startswith(("embedding.", "decoder.", "output_layer.", "mtp."))
    }
    refuse_unsupported_keys(model_keys, folder)
    args = common.get("args")
    model, notes = model_from_megatron(args, flags or {}, model_keys, folder)
    existing = list_checkpoints(dst_root)
    if existing:
        raise CheckpointError(
            f"{dst_root!r} already holds committed checkpoints {existing[:5]}: `meshtrain train "
            "--load` would resume the latest of them, not the import (step 0); import into an "
            "empty root"
        )
    plan = rules(model)
    found: dict[str, str] = {}  # rule.ours -> the Megatron key holding it
    for rule in plan:
        key = next((k for k in rule.theirs if k in model_keys), None)
        if key is None and rule.ours.startswith("layers.{i}.mlp.fc1."):
            key = _singleton_fc1(rule, model_keys)
        if key is None:
            raise CheckpointError(
                f"{folder}: missing tensor {rule.theirs[0]!r} (meshtrain {rule.ours})"
            )
        found[rule.ours] = key
    used = {k for key in found.values() for k in key.split("|")}
    unmapped = sorted(k for k in model_keys if k not in used)
    if unmapped:
        raise CheckpointError(
            f"{folder}: tensors with no mapping {unmapped[:5]} (a feature meshtrain does not "
            "import, or settings that disagree with the tensors)"
        )
    for rule in plan:
        key = found[rule.ours]
        have = _joined(key, model_keys) if "|" in key else model_keys[key]
        want = ((model.num_layers,) if rule.layered else ()) + rule.shape
        if rule.ours in VOCAB_ROWS:  # Megatron-LM pads the vocabulary: at least the tokens' rows
            ok = have[1:] == want[1:] and have[0] >= want[0]
        else:
            ok = tuple(have) == want
        if not ok:
            raise CheckpointError(
                f"{folder}: tensor {key!r} is {tuple(have)}, expected {want} for this architecture"
            )
    dtypes = {metas[k].properties.dtype for key in found.values() for k in key.split("|")}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise CheckpointError(
            f"{folder}: model tensors have dtypes {sorted(map(str, dtypes))}; one float dtype "
            "is needed"
        )
    dtype = dtypes.pop()

    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    source: dict[str, tuple[Rule, int | None]] = {}
    dname = str(dtype).removeprefix("torch.")
    for rule in plan:
        for i in range(model.num_layers) if rule.layered else [None]:
            name = rule.ours.format(i=i) if i is not None else rule.ours
            specs[name] = (rule.shape, dname)
            source[name] = (rule, i)
    specs["rng.torch_cpu"] = (tuple(torch.get_rng_state().shape), "uint8")
    cache: dict[str, torch.Tensor] = {}

    def load(name: str) -> torch.Tensor:
        if name == "rng.torch_cpu":
            return torch.Generator().manual_seed(seed).get_state()
        rule, layer = source[name]
        key = found[rule.ours]
        if key not in cache:  # the stacked tensor serves every layer; keep only the current one
            cache.clear()
            parts = [_read_dcp(folder, k, metas[k]) for k in key.split("|")]
            cache[key] = (
                torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            )  # (layers, [gate; up], hidden)
        full = cache[key]
        tensor = full[layer] if layer is not None else full
        if rule.ours in VOCAB_ROWS:
            tensor = tensor[: model.vocab_size]  # Megatron-LM's padding rows are no tokens
        return tensor.contiguous()

    metadata = {
        "format": TRAIN_FORMAT,
        "iteration": 0,
        "consumed_samples": 0,
        "optimizer_step": 0,
        "config": {"model": to_dict(model)},
        "rng_python": random.Random(seed).getstate(),
        "rng_numpy": numpy_rng_state(seed),
        "tokenizer": None,
        "imported_from": {
            "url": str(folder.resolve()),
            "format": "megatron",
            "iteration": iteration,
            "notes": notes,
        },
    }
    for note in notes:
        log.warning("%s: %s", folder, note)
    url, _ = save_streaming(dst_root, 0, specs, load, metadata, desc="import")
    return url


def _singleton_fc1(rule: Rule, keys: dict[str, tuple[int, ...]]) -> str | None:
    """`linear_fc1.weight_w|linear_fc1.weight_v`: SwiGLU's halves saved as two tensors
    (megatron-core's singleton_local_shards), joined on import."""
    base = rule.theirs[0]
    halves = (f"{base}_w", f"{base}_v")
    return "|".join(halves) if all(h in keys for h in halves) else None


def _joined(key: str, keys: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    w, v = (keys[k] for k in key.split("|"))
    if w != v:
        return (*w[:1], -1, *w[2:])  # never matches: the halves differ
    return (w[0], 2 * w[1], *w[2:])


def export_megatron(
    src_root: str, dst_dir: str, step: int | None = None, padded_vocab_size: int | None = None
) -> tuple[str, list[str]]:
    """Writes a meshtrain checkpoint's weights as a megatron-core torch_dist `release` checkpoint.

    `DST/latest_checkpointed_iteration.txt` says `release` and `DST/release/` is the torch_dist
    folder: Megatron-LM's `--load DST` reads it as a weights-only checkpoint (no optimizer, RNG or
    iteration; training starts at iteration 0), and
    `dist_checkpointing.load(model.sharded_state_dict(), DST/release)` fills a GPTModel built with
    the flags returned. All the weights are held in memory at once while DCP writes them.

    Args:
        src_root: meshtrain checkpoint root.
        dst_dir: local folder to create; it must not exist.
        step: the step; None: the latest committed one.
        padded_vocab_size: rows of the embedding and output layer (Megatron-LM pads the
            vocabulary to a multiple of make_vocab_size_divisible_by x TP); None: the model's
            padded vocabulary (`model.padded_vocab_size()`). Padding rows are zeros.

    Returns:
        (dst_dir, the Megatron-LM flags that build the same model).

    Raises:
        CheckpointError: the model maps to no Megatron GPTModel here (MoE, RoPE scaling bounds of
            its own), a tensor is missing or
            misshapen, the padded vocabulary is smaller than the vocabulary, or `dst_dir` exists.
    """
    source = open_source(src_root, step)
    step, where, manifest, specs, model = (
        source.step,
        source.where,
        source.manifest,
        source.specs,
        source.model,
    )
    plan = rules(model)
    rows = model.padded_vocab_size() if padded_vocab_size is None else padded_vocab_size
    assert model.vocab_size is not None  # `rules` refused a model without one
    if rows < model.vocab_size:
        raise CheckpointError(
            f"padded vocabulary size {rows} is smaller than model.vocab_size={model.vocab_size}"
        )
    for rule in plan:
        for i in range(model.num_layers) if rule.layered else [None]:
            name = rule.ours.format(i=i) if i is not None else rule.ours
            if name not in specs:
                raise CheckpointError(f"{where}: missing tensor {name!r}")
            if tuple(specs[name][0]) != rule.shape:
                raise CheckpointError(
                    f"{where}: tensor {name!r} is {tuple(specs[name][0])}, expected {rule.shape}"
                )
    dst = Path(dst_dir)
    if dst.exists():
        raise CheckpointError(f"export destination {dst_dir!r} already exists")
    state: dict[str, Any] = {}
    for rule in plan:
        if rule.layered:  # (layers, *shape): Megatron stacks the layers on a leading axis
            tensor = torch.stack(
                [
                    read_tensor(src_root, step, rule.ours.format(i=i), manifest=manifest)
                    for i in range(model.num_layers)
                ]
            )
        else:
            tensor = read_tensor(src_root, step, rule.ours, manifest=manifest)
        if rule.ours in VOCAB_ROWS and rows > tensor.shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], tensor.shape[1])])
        state[rule.theirs[0]] = tensor.contiguous()
    layers = model.num_layers
    for linear in _LINEARS:
        for i in range(layers):
            # Each linear layer's extra state, a ShardedObject megatron-core's load asks for: the
            # list of its ranks' objects (one, None: no FP8 metadata), which DCP pickles as bytes.
            state[f"decoder.layers.{linear}._extra_state/shard_{i}_{layers}"] = [None]
    dst.parent.mkdir(parents=True, exist_ok=True)
    for folder in remove_dead_builds(str(dst)):
        log.warning("removed %s, left by an export to %s that was killed", folder, dst_dir)
    build = Path(local_build_dir(str(dst)))
    release = build / "release"
    try:
        release.mkdir(parents=True)
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: it is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                state,
                storage_writer=FileSystemWriter(str(release), single_file_per_rank=True),
                no_dist=True,
            )
        torch.save({"checkpoint_version": 3.0, "iteration": 0}, release / "common.pt")
        (release / "metadata.json").write_text(json.dumps(BACKEND))
        (build / TRACKER).write_text("release")
        build.rename(dst)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    log.info("exported %s to %s (megatron-core torch_dist, release)", where, dst_dir)
    return dst_dir, megatron_flags(model)
