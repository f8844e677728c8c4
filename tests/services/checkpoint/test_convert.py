"""`convert`: dtype change, dropping the optimizer, target-layout shard shapes, memory, CLI."""

import argparse
import json
import random
import subprocess
import sys
import textwrap
import uuid

import fsspec
import numpy as np
import pytest
import torch

from meshtrain.services.checkpoint.convert import (
    convert,
    inspect_checkpoint,
    target_shard_shapes,
    tensor_specs,
)
from meshtrain.services.checkpoint.convert_cli import register_subcommands
from meshtrain.services.checkpoint.reader import list_checkpoints, load_checkpoint, read_manifest
from meshtrain.services.checkpoint.writer import save_checkpoint
from meshtrain.services.common.config import to_dict
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer import checkpoint_restore
from meshtrain.services.trainer.checkpoint_state import Parallel
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.optim.optimizer import build_optimizer
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor_layers import TPSplit

from .conftest import assert_same, toy_model_state

# Llama-style with 4 heads in 2 query groups, so a tp=2 split is by group, not by head.
MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 96,
    "seq_length": 16,
    "vocab_size": 300,
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
}
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def training_state(settings: dict = MODEL, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and metadata shaped like a trainer checkpoint: params, Adam moments, RNG."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**settings))
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach()[: model.vocab_size] if name in VOCAB_ROWS else p.detach()
        tensors[name] = torch.randn_like(t)
        tensors[f"optim.exp_avg.{name}"] = torch.randn_like(t)
        tensors[f"optim.exp_avg_sq.{name}"] = torch.rand_like(t)
    tensors["rng.torch_cpu"] = torch.get_rng_state()
    np_state = np.random.RandomState(seed).get_state()
    meta = {
        "format": "meshtrain-train/1",
        "iteration": 9,
        "consumed_samples": 72,
        "optimizer_step": 9,
        "config": to_dict(JobConfig(model=model.config)),
        "rng_python": random.Random(seed).getstate(),
        "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "tokenizer": "byte",
    }
    return tensors, meta


@pytest.fixture
def memory_root():
    name = f"meshtrain-test-{uuid.uuid4().hex}"
    yield f"memory://{name}/ckpt"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def test_plain_copy_is_bit_exact_across_filesystems(root, memory_root):
    tensors, meta = training_state()
    tensors["layers.0.attention.qkv.weight"] = tensors["layers.0.attention.qkv.weight"].bfloat16()
    save_checkpoint(root, 9, tensors, meta)
    result = convert(root, memory_root, progress=False)
    assert result.step == 9 and result.tensors == len(tensors)
    assert (
        result.bytes_read
        == result.bytes_written
        == sum(t.numel() * t.element_size() for t in tensors.values())
    )
    loaded, got_meta = load_checkpoint(memory_root, 9)
    assert_same(loaded, tensors)
    assert got_meta["converted_from"] == {
        "url": root,
        "step": 9,
        "dtype": None,
        "drop_optimizer": False,
        "target_tp": 1,
        "target_pp": 1,
        "target_ep": 1,
    }
    assert {k: got_meta[k] for k in meta} == json.loads(json.dumps(meta))  # JSON: tuples -> lists


def test_copy_keeps_every_dtype_0d_and_stacked_scalars(tmp_path):
    state = toy_model_state()  # bf16, fp16, int64 0-d, int32, bool, uint8, per-layer 0-d scalars
    save_checkpoint(str(tmp_path / "a"), 3, state, {"note": "no model config needed for a copy"})
    convert(str(tmp_path / "a"), str(tmp_path / "b"), dtype="fp32", progress=False)
    loaded, _ = load_checkpoint(str(tmp_path / "b"), 3)
    for name, t in state.items():
        want = t.float() if t.is_floating_point() and not name.startswith(("optim.", "rng.")) else t
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name
    assert read_manifest(str(tmp_path / "b"), 3)["arrays"]["layers.scale"]["shape"] == [4]


def test_bf16_changes_parameters_only(tmp_path):
    tensors, meta = training_state()
    save_checkpoint(str(tmp_path / "a"), 9, tensors, meta)
    convert(str(tmp_path / "a"), str(tmp_path / "b"), dtype="bf16", progress=False)
    loaded, _ = load_checkpoint(str(tmp_path / "b"), 9)
    for name, t in tensors.items():
        if name.startswith(("optim.", "rng.")):
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
        else:
            assert loaded[name].dtype == torch.bfloat16, name
            assert torch.equal(loaded[name].view(torch.int16), t.bfloat16().view(torch.int16)), name
    with pytest.raises(CheckpointError, match="dtype 'int8'"):
        convert(str(tmp_path / "a"), str(tmp_path / "c"), dtype="int8", progress=False)


def test_a_dtype_too_narrow_for_a_value_is_an_error_not_inf(tmp_path):
    """fp16 tops out at 65504: a parameter beyond it (fp32's, or bf16's, which has fp32's range)
    would be stored as inf, a value the source never held. Values that merely round to the
    largest fp16 number, and infs already in the source, convert as they are."""
    tensors, meta = training_state()
    tensors["final_norm.weight"][3] = 1e5
    save_checkpoint(str(tmp_path / "a"), 9, tensors, meta)
    with pytest.raises(CheckpointError, match=r"'final_norm.weight'.* 1e\+05.*float16"):
        convert(str(tmp_path / "a"), str(tmp_path / "b"), dtype="fp16", progress=False)
    assert 9 not in list_checkpoints(str(tmp_path / "b"))

    tensors["final_norm.weight"][3:5] = torch.tensor([65510.0, float("inf")])
    save_checkpoint(str(tmp_path / "c"), 9, tensors, meta)
    convert(str(tmp_path / "c"), str(tmp_path / "d"), dtype="fp16", progress=False)
    loaded, _ = load_checkpoint(str(tmp_path / "d"), 9)
    assert loaded["final_norm.weight"][3:5].tolist() == [65504.0, float("inf")]

    tensors["final_norm.weight"][3:5] = 1.0
    tensors["layers.1.input_norm.weight"] = tensors["layers.1.input_norm.weight"].bfloat16()
    tensors["layers.1.input_norm.weight"][0] = -3e38
    save_checkpoint(str(tmp_path / "e"), 9, tensors, meta)
    with pytest.raises(CheckpointError, match=r"'layers.1.input_norm.weight'.* -3.*float16"):
        convert(str(tmp_path / "e"), str(tmp_path / "f"), dtype="fp16", progress=False)


def test_drop_optimizer_gives_a_checkpoint_the_trainer_resumes(tmp_path):
    tensors, meta = training_state()
    save_checkpoint(str(tmp_path / "a"), 9, tensors, meta)
    convert(str(tmp_path / "a"), str(tmp_path / "b"), drop_optimizer=True, progress=False)
    manifest = read_manifest(str(tmp_path / "b"), 9)
    assert not [n for n in tensor_specs(manifest) if n.startswith("optim.")]
    assert manifest["metadata"]["optimizer_step"] == 0
    model = GPT(ModelConfig(**MODEL))
    optimizer = build_optimizer(model, JobConfig().optim)
    state, _ = checkpoint_restore.restore(
        str(tmp_path / "b"), model, optimizer, Parallel(Mesh.single())
    )
    assert (state.iteration, state.consumed_samples) == (9, 72)
    assert not optimizer.state  # Adam starts afresh
    assert torch.equal(model.layers[1].mlp.fc2.weight, tensors["layers.1.mlp.fc2.weight"])


def test_inspect_shows_sizes_config_and_provenance(tmp_path):
    tensors, meta = training_state()
    save_checkpoint(str(tmp_path / "a"), 9, tensors, meta)
    convert(
        str(tmp_path / "a"), str(tmp_path / "b"), dtype="bf16", drop_optimizer=True, progress=False
    )
    info = inspect_checkpoint(str(tmp_path / "b"))
    assert info["step"] == 9
    qkv = info["tensors"]["layers.0.attention.qkv.weight"]
    assert qkv == {"shape": [128, 64], "dtype": "bfloat16", "bytes": 128 * 64 * 2}
    assert info["bytes"] == sum(t["bytes"] for t in info["tensors"].values())
    assert info["stored_bytes"] > info["bytes"]  # shard indexes and zarr.json on top
    assert info["config"]["model"]["num_query_groups"] == 2
    assert info["provenance"]["converted_from"]["dtype"] == "bfloat16"
    assert inspect_checkpoint(str(tmp_path / "a"))["provenance"] == "training"
    assert info["metadata"]["iteration"] == 9 and "rng_numpy" not in info["metadata"]


def test_convert_refuses_a_step_that_exists_at_the_destination(tmp_path):
    tensors, meta = training_state()
    save_checkpoint(str(tmp_path / "a"), 9, tensors, meta)
    convert(str(tmp_path / "a"), str(tmp_path / "b"), progress=False)
    # the hint names what a converter can do
    # (the trainer's --checkpoint.overwrite is no option here)
    with pytest.raises(
        CheckpointError,
        match=r"already exists .*: write to another root, or delete it first "
        r"\(meshtrain ckpt delete .* --step 9\)",
    ):
        convert(str(tmp_path / "a"), str(tmp_path / "b"), progress=False)


def test_convert_refuses_its_own_source_root_without_advising_to_delete_the_source(tmp_path):
    """The step is kept, so converting a root into itself meets its own source step; the
    'delete it first' hint of an existing destination step would have the user delete the
    checkpoint being converted. The same root spelled as a file:// URL, through `..` or through a
    symlink is the same root."""
    tensors, meta = training_state()
    root = str(tmp_path / "a")
    save_checkpoint(root, 9, tensors, meta)
    (tmp_path / "link").symlink_to(root)
    for dst in (root, f"file://{root}/", str(tmp_path / "x" / ".." / "a"), str(tmp_path / "link")):
        with pytest.raises(
            CheckpointError, match=r"is the source root .*write to another root"
        ) as e:
            convert(root, dst, dtype="bf16", progress=False)
        assert "delete" not in str(e.value)
    assert list_checkpoints(root) == [9]
    assert_same(load_checkpoint(root, 9)[0], tensors)


# Megatron's split of each parameter kind (dim, halves, vocab), as the trainer shards it.
SPLITS = {
    "attention.qkv.weight": TPSplit(0),
    "mlp.fc1.weight": TPSplit(0, halves=True),
    "attention.proj.weight": TPSplit(1),
    "mlp.fc2.weight": TPSplit(1),
    "embedding.word_embeddings.weight": TPSplit(0, vocab=True),
    "output_layer.weight": TPSplit(0, vocab=True),
}


@pytest.mark.parametrize("tp", [2, 4])
def test_target_tp_shards_are_what_each_rank_reads(tmp_path, tp):
    """Each tp rank's slice (by the trainer's own TPSplit) must be whole shards of the output."""
    settings = {**MODEL, "num_query_groups": 4} if tp == 4 else MODEL
    tensors, meta = training_state(settings)
    save_checkpoint(str(tmp_path / "a"), 9, tensors, meta)
    convert(str(tmp_path / "a"), str(tmp_path / "b"), target_tp=tp, target_pp=2, progress=False)
    loaded, _ = load_checkpoint(str(tmp_path / "b"), 9)
    assert_same(loaded, tensors)
    arrays = read_manifest(str(tmp_path / "b"), 9)["arrays"]
    config = ModelConfig(**settings)
    padded = -(-config.vocab_size // (128 * tp)) * 128 * tp
    for array_name, entry in arrays.items():
        kind = array_name.removeprefix("optim.exp_avg_sq.").removeprefix("optim.exp_avg.")
        kind = kind.removeprefix("layers.")
        shape, grid = entry["shape"], entry["shards"]
        stacked = entry["layer_count"] is not None
        if stacked:
            assert grid[0] == 1, array_name  # pipeline stages own whole layers
            shape, grid = shape[1:], grid[1:]
        split = SPLITS.get(kind)
        if split is None:
            assert grid == shape, f"{array_name} is replicated, so one shard"
            continue
        rows = padded if split.vocab else shape[split.dim]
        index = torch.arange(rows)
        shard_size = grid[split.dim]
        assert shard_size < shape[split.dim], f"{array_name} is not split at all"
        for rank in range(tp):
            owned = TPSplit(0, split.halves).shard(index, rank, tp)  # indices along split.dim
            owned = owned[owned < shape[split.dim]]  # padded vocabulary rows are not stored
            if not len(owned):
                continue  # a rank holding only padding rows reads nothing
            touched = set((owned // shard_size).tolist())
            whole = torch.cat(
                [
                    torch.arange(s * shard_size, min((s + 1) * shard_size, shape[split.dim]))
                    for s in sorted(touched)
                ]
            )
            assert torch.equal(owned, whole), f"{array_name}: tp rank {rank} reads part of a shard"
        assert len(entry["objects"]) - 1 == (entry["layer_count"] or 1) * len(
            range(0, shape[split.dim], shard_size)
        ), array_name


def test_target_layout_must_fit_the_model():
    tensors, _ = training_state()
    specs = {n: (tuple(t.shape), "float32") for n, t in tensors.items()}
    config = ModelConfig(**MODEL)
    with pytest.raises(CheckpointError, match="tp=4 does not divide model.num_query_groups=2"):
        target_shard_shapes(specs, config, tp=4)
    with pytest.raises(CheckpointError, match="pp=3 exceeds model.num_layers=2"):
        target_shard_shapes(specs, config, pp=3)
    with pytest.raises(CheckpointError, match="no experts"):
        target_shard_shapes(specs, config, ep=2)
    with pytest.raises(CheckpointError, match="positive int"):
        target_shard_shapes(specs, config, tp=0)


MEASURE = textwrap.dedent("""
    import json, sys
    from meshtrain.services.checkpoint.convert import convert
    def status(key):  # kB from /proc/self/status; VmHWM is this process's peak RSS
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    before = status("VmRSS")
    convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3] or None, progress=False)
    print(json.dumps({"before": before, "peak": status("VmHWM")}))
""")


@pytest.mark.e2e
def test_peak_memory_is_a_few_times_the_largest_tensor(tmp_path):
    """Measured in a fresh process (VmHWM, not ru_maxrss: the latter keeps the forking parent's
    peak across exec) with glibc told to return freed blocks over 1 MiB to the OS, so the peak
    is what conversion holds, not heap slack."""
    largest = 8 * 2**20 // 4  # fp32 elements of the largest tensor: 8 MiB
    tensors = {f"layers.{i}.mlp.fc1.weight": torch.randn(largest // 1024, 1024) for i in range(8)}
    tensors.update({f"t{i}": torch.randn(largest // 2048, 1024) for i in range(8)})
    total = sum(t.numel() * 4 for t in tensors.values())
    save_checkpoint(str(tmp_path / "a"), 1, tensors, {})
    del tensors
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "a"), str(tmp_path / "b"), "bf16"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={"MALLOC_MMAP_THRESHOLD_": str(2**20), "PATH": "/usr/bin:/bin", "PYTHONPATH": "."},
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    grown = measured["peak"] - measured["before"]
    # Reads hold one shard plus its decoded copy (2x), the writer one encoded box more: 2.5x
    # measured on a quiet machine, 3.4x in a fresh CI-like run (fixed overheads weigh more on an
    # 8 MiB tensor). total is 12x the largest tensor: loading everything would blow far past 4x.
    print(f"peak grew {grown / (largest * 4):.2f}x the largest tensor")
    assert grown < 4 * largest * 4, (
        f"peak grew {grown / 2**20:.1f} MiB for a {largest * 4 / 2**20:.0f} MiB tensor"
    )
    assert total >= 12 * largest * 4


def test_cli_convert_export_import(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register_subcommands(parser.add_subparsers(dest="ckpt_cmd", required=True))
    tensors, meta = training_state()
    save_checkpoint(str(tmp_path / "a"), 9, tensors, meta)

    def run(*words):
        args = parser.parse_args([str(w) for w in words])
        assert args.func(args) == 0
        return capsys.readouterr().out

    out = run(
        "convert",
        tmp_path / "a",
        tmp_path / "b",
        "--dtype",
        "bf16",
        "--drop-optimizer",
        "--target-tensor-parallel-size",
        "2",
    )
    assert "converted step 9" in out and "GB/s" in out
    assert read_manifest(str(tmp_path / "b"), 9)["arrays"]["layers.attention.qkv.weight"][
        "shards"
    ] == [1, 64, 64]
    assert "exported" in run("export", "--format", "hf", tmp_path / "b", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    out = run("import", "--format", "hf", tmp_path / "hf", tmp_path / "c")
    assert "num_query_groups = 2" in out
    back, _ = load_checkpoint(str(tmp_path / "c"), 0)
    assert torch.equal(
        back["layers.1.attention.qkv.weight"].view(torch.int16),
        tensors["layers.1.attention.qkv.weight"].bfloat16().view(torch.int16),
    )
    with pytest.raises(CheckpointError, match="--format 'gguf'"):
        run("export", "--format", "gguf", tmp_path / "b", tmp_path / "x")


def test_convert_from_and_to_s3(s3_root, tmp_path):
    """Both directions through the real S3 server: local -> s3:// (bf16, target tp=2) -> local."""
    tensors, meta = training_state()
    save_checkpoint(str(tmp_path / "src"), 9, tensors, meta)
    convert(str(tmp_path / "src"), s3_root, dtype="bf16", target_tp=2, progress=False)
    convert(s3_root, str(tmp_path / "back"), progress=False)
    loaded, _ = load_checkpoint(str(tmp_path / "back"), 9)
    for name, t in tensors.items():
        expected = t.bfloat16() if not name.startswith(("optim.", "rng.")) else t
        assert torch.equal(loaded[name], expected), name


def test_convert_reads_the_source_manifest_once_not_once_per_tensor(tmp_path, monkeypatch):
    """On S3 every manifest read is a request; a convert fetched it again for each tensor."""
    from meshtrain.services.checkpoint import reader

    tensors, meta = training_state()
    save_checkpoint(str(tmp_path / "a"), 9, tensors, meta)
    fetched = []
    real = reader.read_bytes

    def counting(root, path):
        if path.endswith("manifest.json"):
            fetched.append(path)
        return real(root, path)

    monkeypatch.setattr(reader, "read_bytes", counting)
    convert(str(tmp_path / "a"), str(tmp_path / "b"), dtype="bf16", progress=False)
    assert len(tensors) > 20 and len(fetched) <= 3, (
        fetched
    )  # listing the steps, then the step's own
    monkeypatch.undo()
    loaded, _ = load_checkpoint(str(tmp_path / "b"), 9)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():  # the values the per-tensor reads gave
        want = t if name.startswith(("optim.", "rng.")) else t.to(torch.bfloat16)
        assert torch.equal(loaded[name], want), name
