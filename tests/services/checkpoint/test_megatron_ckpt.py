"""Megatron Core torch_dist import/export, verified against megatron-core itself on CPU (gloo).

In each test megatron-core builds a tiny GPTModel (local layer spec, fp32, every parameter
random, norms included), computes its logits on fixed tokens and saves it with
`dist_checkpointing.save` -- from one rank, from two tensor-parallel ranks, or laid out as
Megatron-LM's training saves (`iter_0000100/` with the tracker file and `args` in common.pt).
meshtrain imports the folder on one process and its logits must equal megatron-core's; an
export must load back into a GPTModel with `dist_checkpointing.load` and give the same logits.

The forwards run in eval mode under megatron-core's inference RNG tracker (no dropout, so no CUDA
RNG streams). megatron-core's torch_dist writer calls `torch.cuda.synchronize()` and
`torch.cuda.current_device()` unconditionally; on a CPU-only torch build the ranks turn those two
into their CPU meaning (nothing to wait for; tensors on the CPU) before saving. Everything else is
megatron-core's own code.
"""

from __future__ import annotations

import argparse
import os
import shutil

import pytest
import torch

from meshtrain.services.checkpoint.megatron.torch_dist import export_megatron, import_megatron
from meshtrain.services.checkpoint.reader import read_manifest, read_tensor
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model.gpt import GPT
from tests.dist_utils import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # megatron-core's torch_dist writer needs it (it hangs without)
pytestmark = pytest.mark.dist  # megatron-core runs in spawned gloo ranks (the module's fixture too)

GPT_SETTINGS = {
    "normalization": "LayerNorm",
    "swiglu": False,
    "position_embedding_type": "learned_absolute",
    "num_query_groups": None,
    "add_bias_linear": True,
    "untie": False,
}
LLAMA_SETTINGS = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "num_query_groups": 2,
    "add_bias_linear": False,
    "untie": True,
}
HIDDEN, HEADS, LAYERS, FFN, VOCAB, SEQ, ROPE_BASE = 64, 4, 2, 96, 300, 16, 5000.0
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _cpu_only_cuda_calls() -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"


def _build(settings: dict, tp: int, vocab_rows: int = VOCAB, pp: int = 1):
    """A megatron-core GPTModel of `settings` on this rank, after initializing model parallelism."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.utils import openai_gelu

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    # megatron-core's inference tracker: dropout-free forwards need no per-rank CUDA RNG streams.
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    swiglu = settings["swiglu"]
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        num_query_groups=settings["num_query_groups"],
        normalization=settings["normalization"],
        layernorm_epsilon=1e-5,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else openai_gelu,
        add_bias_linear=settings["add_bias_linear"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(normalization=settings["normalization"])
    return GPTModel(
        config,
        spec,
        vocab_size=vocab_rows,
        max_sequence_length=SEQ + 4,
        position_embedding_type="learned_absolute"
        if settings["position_embedding_type"] != "rope"
        else "rope",
        rotary_base=ROPE_BASE,
        parallel_output=False,
        share_embeddings_and_output_weights=not settings["untie"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def _logits(model) -> torch.Tensor:
    b, s = TOKENS.shape
    positions = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[
        None, None
    ]  # True: masked (the future)
    model.eval()
    with torch.no_grad():
        out = model(TOKENS, positions, mask)
    return (
        out.transpose(0, 1) if out.shape[0] == s and out.shape[1] == b else out
    )  # (batch, seq, vocab)


def _save_megatron(rank: int, world: int, settings: dict, path: str, layout: str) -> torch.Tensor:
    """Rank body: random GPTModel saved with dist_checkpointing.save; returns its logits."""
    from megatron.core import dist_checkpointing

    _cpu_only_cuda_calls()
    model = _build(settings, world)
    torch.manual_seed(7)  # the same draws on every rank: replicated parameters stay equal
    with torch.no_grad():
        for name, p in model.named_parameters():  # norm weights near 1, so the logits are O(1)
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "layernorm.weight" in name else 0.0))
    logits = _logits(model)
    if rank == 0:
        os.makedirs(path if layout == "folder" else f"{path}/iter_0000100")
    torch.distributed.barrier()
    if layout == "folder":
        dist_checkpointing.save(model.sharded_state_dict(), path)
    else:
        # what megatron.training.checkpointing.save_checkpoint writes for --ckpt-format torch_dist
        from megatron.core.transformer.enums import AttnBackend

        args = argparse.Namespace(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            ffn_hidden_size=FFN,
            num_attention_heads=HEADS,
            group_query_attention=settings["num_query_groups"] is not None,
            num_query_groups=settings["num_query_groups"] or 1,
            kv_channels=HIDDEN // HEADS,
            seq_length=SEQ,
            max_position_embeddings=SEQ + 4,
            position_embedding_type=settings["position_embedding_type"],
            rotary_base=int(ROPE_BASE),
            rotary_percent=1.0,
            normalization=settings["normalization"],
            norm_epsilon=1e-5,
            swiglu=settings["swiglu"],
            openai_gelu=not settings["swiglu"],
            add_bias_linear=settings["add_bias_linear"],
            add_qkv_bias=False,
            untie_embeddings_and_output_weights=settings["untie"],
            tensor_model_parallel_size=world,
            pipeline_model_parallel_size=1,
            attention_backend=AttnBackend.auto,
            params_dtype=torch.float32,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            make_vocab_size_divisible_by=128,
        )
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        # Beside the model, as Megatron-LM saves them: an optimizer moment
        # (keyed "optimizer.state..."), each rank's RNG state (a ShardedObject);
        # the import must pass over both.
        embedding = model.embedding.word_embeddings.weight  # (vocab/tp, hidden): this rank's rows
        moment = ShardedTensor.from_rank_offsets(
            "optimizer.state.exp_avg.embedding.word_embeddings.weight",
            torch.zeros_like(embedding),
            (0, rank, world),
        )
        rng = ShardedObject(
            "rng_state",
            {"random_rng_state": torch.get_rng_state()},
            (world,),
            (rank,),
            replica_id=0,
        )
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": 100,
            "model": model.sharded_state_dict(),
            "optimizer": {"state": {"exp_avg": moment}},
            "rng_state": rng,
        }
        dist_checkpointing.save(state, f"{path}/iter_0000100")
        if rank == 0:
            with open(f"{path}/latest_checkpointed_iteration.txt", "w") as f:
                f.write("100")
    return logits


def _save_pp(rank: int, world: int, path: str) -> None:
    """Rank body: one pipeline stage of a random Llama-style GPTModel,
    saved with its stage's layers."""
    from megatron.core import dist_checkpointing

    _cpu_only_cuda_calls()
    model = _build(LLAMA_SETTINGS, 1, pp=world)
    torch.manual_seed(11 + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "layernorm.weight" in name else 0.0))
    if rank == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), path)


def _load_megatron(
    rank: int, world: int, settings: dict, path: str, vocab_rows: int, exported: bool = True
) -> torch.Tensor:
    """Rank body: a fresh GPTModel filled by dist_checkpointing.load from `path`;
    returns its logits."""
    from megatron.core import dist_checkpointing

    _cpu_only_cuda_calls()
    model = _build(settings, world, vocab_rows)
    # Shaped as Megatron-LM's load_checkpoint asks: the model's tensors under "model",
    # common.pt beside.
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    if exported:
        assert loaded["checkpoint_version"] == 3.0 and loaded["iteration"] == 0
    model.load_state_dict(loaded["model"])
    return _logits(model)


def _meshtrain_logits(root: str) -> torch.Tensor:
    table = read_manifest(root, 0)["metadata"]["config"]["model"]
    model = GPT(ModelConfig(**table))
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = read_tensor(root, 0, name)
            p[: t.shape[0]].copy_(t)
    model.eval()
    with torch.no_grad():
        return model(TOKENS)


FLAGS = {
    "gpt": {"num_attention_heads": HEADS, "openai_gelu": True},
    "llama": {"num_attention_heads": HEADS, "rotary_base": ROPE_BASE, "seq_length": SEQ},
}


@pytest.mark.parametrize("layout", ["folder", "training"])
@pytest.mark.parametrize("name, settings", [("gpt", GPT_SETTINGS), ("llama", LLAMA_SETTINGS)])
def test_import_gives_megatron_cores_logits_and_export_loads_back(tmp_path, name, settings, layout):
    """fp32 throughout; 1e-4 absolute, as test_hf: summation order differs between the two
    attention implementations, while a wrong head order, norm or transpose is O(1)."""
    src = str(tmp_path / "megatron")
    (theirs,) = run_ranks(_save_megatron, 1, settings, src, layout, daemon=False)
    root = str(tmp_path / "ckpt")
    import_megatron(src, root, flags=FLAGS[name] if layout == "folder" else None)
    ours = _meshtrain_logits(root)
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB)
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    if layout == "training":
        return  # the export's own round trip runs once per architecture

    dst = tmp_path / "exported"
    _, flags = export_megatron(root, str(dst))
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in (dst / "release").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "common.pt",
        "metadata.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt",
        "exported",
        "megatron",
    ]  # no build folder left
    assert "--num-attention-heads" in flags
    rows = 384  # the vocabulary padded to a multiple of 128, as Megatron-LM pads it
    (back,) = run_ranks(_load_megatron, 1, settings, str(dst / "release"), rows)
    torch.testing.assert_close(back[..., :VOCAB], theirs, atol=1e-5, rtol=1e-5)
    assert back[..., VOCAB:].abs().max() == 0  # the zero padding rows of a tied or untied output


def test_tp2_sharded_save_imports_on_one_process(tmp_path):
    """Two tensor-parallel ranks save the Llama-style model (GQA's query groups and SwiGLU's
    gate/up halves are split between them); one process without a process group imports it."""
    src = str(tmp_path / "megatron")
    theirs = run_ranks(_save_megatron, 2, LLAMA_SETTINGS, src, "training", daemon=False)[0]
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(f"{src}/iter_0000100").read_metadata().state_dict_metadata
    assert (
        "optimizer.state.exp_avg.embedding.word_embeddings.weight" in saved
    )  # passed over by the import
    assert any(k.startswith("rng_state/") for k in saved)
    root = str(tmp_path / "ckpt")
    import_megatron(src, root)
    torch.testing.assert_close(_meshtrain_logits(root), theirs, atol=1e-4, rtol=1e-4)


def test_pp2_sharded_save_imports_as_megatron_core_reads_it_at_pp1(tmp_path):
    """Two pipeline stages save a layer each (the embedding on the first, the output layer on
    the last); megatron-core itself loads the folder into one unsplit GPTModel, whose logits the
    import must give."""
    src = str(tmp_path / "megatron")
    run_ranks(_save_pp, 2, src, daemon=False)
    (theirs,) = run_ranks(_load_megatron, 1, LLAMA_SETTINGS, src, VOCAB, False)
    root = str(tmp_path / "ckpt")
    import_megatron(src, root, flags=FLAGS["llama"])
    ours = _meshtrain_logits(root)
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def gpt_folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mc") / "gpt")
    run_ranks(_save_megatron, 1, GPT_SETTINGS, path, "folder", daemon=False)
    return path


def test_missing_facts_name_the_flag(gpt_folder, tmp_path):
    with pytest.raises(CheckpointError, match="--num-attention-heads"):
        import_megatron(gpt_folder, str(tmp_path / "a"))
    with pytest.raises(CheckpointError, match="no multiple of 3 heads.*--num-attention-heads"):
        import_megatron(gpt_folder, str(tmp_path / "b"), flags={"num_attention_heads": 3})
    with pytest.raises(
        CheckpointError, match="do not match.*--num-attention-heads, --num-query-groups"
    ):
        import_megatron(
            gpt_folder,
            str(tmp_path / "b"),
            flags={"num_attention_heads": HEADS, "num_query_groups": 1},
        )
    with pytest.raises(CheckpointError, match="swiglu=True but the tensors say False"):
        import_megatron(
            gpt_folder, str(tmp_path / "c"), flags={"num_attention_heads": HEADS, "swiglu": True}
        )


def test_unsupported_features_are_named(gpt_folder, tmp_path):
    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        import_megatron(
            gpt_folder, str(tmp_path / "a"), flags={"num_attention_heads": HEADS, "num_experts": 8}
        )
    with pytest.raises(CheckpointError, match="multi-latent attention"):
        import_megatron(
            gpt_folder,
            str(tmp_path / "b"),
            flags={"num_attention_heads": HEADS, "multi_latent_attention": True},
        )


@pytest.mark.parametrize(
    "key, what",
    [
        ("decoder.layers.mlp.router.weight", "mixture-of-experts layers"),
        ("decoder.layers.self_attention.linear_q_down_proj.weight", "multi-latent attention"),
        ("mtp.layers.0.enorm.weight", "multi-token prediction"),
    ],
)
def test_unsupported_tensors_are_named(gpt_folder, tmp_path, key, what):
    """A folder holding such a feature's tensor (written with DCP beside a GPT's own)
    is refused by name."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "extra"
    state = {k: torch.zeros(2, 3) for k in ("decoder.layers.self_attention.linear_qkv.weight", key)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    shutil.copy(f"{gpt_folder}/metadata.json", folder / "metadata.json")
    with pytest.raises(CheckpointError, match=f"{what}.*{key}.*not supported"):
        import_megatron(str(folder), str(tmp_path / "a"), flags={"num_attention_heads": HEADS})


def test_corrupt_or_missing_files_are_named(gpt_folder, tmp_path):
    flags = {"num_attention_heads": HEADS, "openai_gelu": True}
    with pytest.raises(CheckpointError, match="neither a torch_dist checkpoint folder"):
        import_megatron(str(tmp_path), str(tmp_path / "a"), flags=flags)
    broken = tmp_path / "broken"
    shutil.copytree(gpt_folder, broken)
    data = sorted(broken.glob("*.distcp"))
    data[-1].write_bytes(data[-1].read_bytes()[:100])
    with pytest.raises(CheckpointError, match="a data file is missing or corrupt"):
        import_megatron(str(broken), str(tmp_path / "b"), flags=flags)
    (broken / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata: not readable"):
        import_megatron(str(broken), str(tmp_path / "c"), flags=flags)
    (broken / "latest_checkpointed_iteration.txt").write_text("banana")
    (broken / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="neither an iteration number nor 'release'"):
        import_megatron(str(broken), str(tmp_path / "d"), flags=flags)


def test_exact_gelu_is_imported_with_a_note(gpt_folder, tmp_path):
    root = str(tmp_path / "ckpt")
    import_megatron(gpt_folder, root, flags={"num_attention_heads": HEADS})
    notes = read_manifest(root, 0)["metadata"]["imported_from"]["notes"]
    assert any("tanh" in n for n in notes)


def test_cli_imports_with_flags_and_exports_with_the_megatron_flags(gpt_folder, tmp_path, capsys):
    """The CLI passes Megatron's flags through, refuses one that belongs to the other format,
    and the export names the Megatron-LM flags that build the model it wrote."""
    from meshtrain.services.checkpoint.convert_cli import register_subcommands

    parser = argparse.ArgumentParser()
    register_subcommands(parser.add_subparsers(dest="ckpt_cmd", required=True))

    def run(*argv: str) -> str:
        args = parser.parse_args(list(argv))
        assert args.func(args) == 0
        return capsys.readouterr().out

    root = str(tmp_path / "ckpt")
    out = run(
        "import",
        "--format",
        "megatron",
        gpt_folder,
        root,
        "--num-attention-heads",
        str(HEADS),
        "--openai-gelu",
        "--vocab-size",
        "290",
    )
    assert "optimizer state is not imported" in out and "note:" not in out
    model = read_manifest(root, 0)["metadata"]["config"]["model"]
    assert model["vocab_size"] == 290 and model["activation"] == "gelu"
    assert (
        model["position_embedding_type"] == "learned"
        and model["max_position_embeddings"] == SEQ + 4
    )
    assert tuple(read_tensor(root, 0, "embedding.word_embeddings.weight").shape) == (290, HIDDEN)

    args = parser.parse_args(
        ["import", "--format", "hf", gpt_folder, str(tmp_path / "x"), "--rotary-base", "5"]
    )
    with pytest.raises(CheckpointError, match="--rotary-base does not apply to --format hf"):
        args.func(args)

    out = run(
        "export", "--format", "megatron", root, str(tmp_path / "mc"), "--padded-vocab-size", "512"
    )
    assert f"--load {tmp_path / 'mc'}" in out
    assert "--num-attention-heads 4" in out and "--openai-gelu" in out and "--swiglu" not in out
    assert (
        "--position-embedding-type learned_absolute" in out and "--disable-bias-linear" not in out
    )
    import torch.distributed.checkpoint as dcp

    meta = (
        dcp.FileSystemReader(str(tmp_path / "mc" / "release")).read_metadata().state_dict_metadata
    )
    assert tuple(meta["embedding.word_embeddings.weight"].size) == (512, HIDDEN)
    assert tuple(meta["decoder.layers.self_attention.linear_qkv.weight"].size) == (
        LAYERS,
        3 * HIDDEN,
        HIDDEN,
    )
    with pytest.raises(CheckpointError, match="already exists"):
        run("export", "--format", "megatron", root, str(tmp_path / "mc"))

    # The export's root (tracker: release) imports back bit-exact, its padding rows dropped again.
    again = str(tmp_path / "again")
    run(
        "import",
        "--format",
        "megatron",
        str(tmp_path / "mc"),
        again,
        "--num-attention-heads",
        str(HEADS),
        "--openai-gelu",
        "--vocab-size",
        "290",
    )
    assert read_manifest(again, 0)["metadata"]["config"]["model"] == model
    for name in (
        "embedding.word_embeddings.weight",
        "layers.1.attention.qkv.weight",
        "final_norm.bias",
    ):
        assert torch.equal(read_tensor(again, 0, name), read_tensor(root, 0, name))


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"num_experts": 4}, "mixture-of-experts"),
        (
            {"rope_scaling_factor": 8.0, "rope_scaling_original_max_positions": 4096},
            r"fixes them at \(1, 4, 8192\)",
        ),
    ],
)
def test_export_refuses_what_a_megatron_gptmodel_cannot_compute(settings, match):
    from meshtrain.services.checkpoint.megatron.torch_dist import rules

    base = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 300,
        "seq_length": 16,
        "normalization": "rmsnorm",
        "activation": "swiglu",
        "position_embedding_type": "rope",
    }
    with pytest.raises(CheckpointError, match=match):
        rules(ModelConfig(**base, **settings))
