"""Checkpoints of mixture-of-experts models: experts by global id, any expert-parallel layout.

A model whose blocks alternate dense and MoE (so neither the experts nor the dense MLPs are
held by every layer), with a gated shared expert and the auxiliary-loss-free expert bias, is
trained, saved mid-run and restored into a fresh model: the continued losses must equal the
uninterrupted run's exactly (same process, same order of operations, so bit-identical).
The expert-parallel case saves at ep=4, resumes at ep=1, saves, resumes at ep=2, and compares
every loss with one uninterrupted single-process run.
"""

import pytest
import torch

from meshtrain.services.checkpoint.maintenance import verify_checkpoint
from meshtrain.services.checkpoint.reader import read_manifest
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.checkpoint_boxes import Place, layer_stacks, pieces, save_place
from meshtrain.services.trainer.checkpointing import load_checkpoint, save_checkpoint
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.model.moe import moe_layers
from meshtrain.services.trainer.parallel.mesh import Mesh

MOE = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    seq_length=16,
    vocab_size=100,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_experts=4,
    moe_layer_freq=[0, 1, 0, 1],
    moe_ffn_hidden_size=24,
    moe_router_topk=2,
    moe_aux_loss_coeff=0.01,
    moe_z_loss_coeff=0.001,
    moe_shared_expert_intermediate_size=32,
    moe_shared_expert_gate=True,
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.05,
)
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def batches(
    n: int, seed: int = 3, batch: int = 2, seq: int = 16, vocab: int = 100
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def build(seed: int = 0, **overrides) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**{**MOE, **overrides}))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def train(model: GPT, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[float]:
    """One optimizer step per sample batch, then the expert-bias update, as the trainer does."""
    losses = []
    for sample in data:
        optimizer.zero_grad()
        loss = model(sample[:, :-1], sample[:, 1:])
        loss.backward()
        optimizer.step()
        for _, layer in moe_layers(model):
            layer.update_expert_bias()
            layer.reset_stats()
        losses.append(loss.item())
    return losses


@pytest.mark.e2e
def test_moe_model_resumes_with_identical_losses(tmp_path):
    data = batches(6)
    model, optimizer = build()
    whole = train(model, optimizer, data)

    model, optimizer = build()
    first = train(model, optimizer, data[:3])
    assert first == whole[:3]
    bias = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("expert_bias")}
    assert bias and all(
        b.abs().sum() > 0 for b in bias.values()
    )  # the bias moved: its restore matters
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 3, model, optimizer)

    fresh, fresh_opt = build(seed=1)  # other weights: every one must come from the checkpoint
    assert load_checkpoint(root, fresh, fresh_opt).iteration == 3
    restored = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        rows = (
            slice(0, 100) if name in VOCAB else slice(None)
        )  # padded vocabulary rows are not stored
        assert torch.equal(p[rows], restored[name][rows]), name
    assert train(fresh, fresh_opt, data[3:]) == whole[3:]


def test_experts_are_stored_by_global_id_and_families_some_layers_lack_per_layer(tmp_path):
    model, optimizer = build()
    train(model, optimizer, batches(1))
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 1, model, optimizer)
    assert verify_checkpoint(root, 1) > 0
    arrays = read_manifest(root, 1)["arrays"]
    # every block has attention and norms: one stacked array each
    assert arrays["layers.attention.qkv.weight"]["layer_count"] == 4
    # blocks 1 and 3 hold experts, 0 and 2 dense MLPs: one array per layer,
    # no stacked axis with holes
    for i in (1, 3):
        entry = arrays[f"layers.{i}.mlp.experts.fc1.weight"]
        assert entry["layer_count"] is None and entry["shape"] == [4, 48, 32]
        assert arrays[f"optim.exp_avg.layers.{i}.mlp.experts.fc2.weight"]["shape"] == [4, 32, 24]
        assert arrays[f"layers.{i}.mlp.router.expert_bias"]["shape"] == [4]
        assert (
            f"optim.exp_avg.layers.{i}.mlp.router.expert_bias" not in arrays
        )  # no gradient, no moments
        assert f"layers.{i}.mlp.fc1.weight" not in arrays
    for i in (0, 2):
        assert arrays[f"layers.{i}.mlp.fc1.weight"]["shape"] == [96, 32]
    assert not any(a.startswith("layers.mlp.") for a in arrays)


def test_a_family_held_by_the_first_layers_only_is_stacked_over_them():
    names = [f"layers.{i}.mlp.experts.fc1.weight" for i in (0, 1)] + [
        f"layers.{i}.mlp.fc1.weight" for i in (2, 3)
    ]
    names += [f"layers.{i}.input_norm.weight" for i in range(4)] + ["final_norm.weight"]
    stacks = layer_stacks(names)
    assert stacks == {"layers.mlp.experts.fc1.weight": 2, "layers.input_norm.weight": 4}
    assert save_place("optim.exp_avg.layers.1.mlp.experts.fc1.weight", stacks) == Place(
        "optim.exp_avg.layers.mlp.experts.fc1.weight", 1, 2
    )
    assert save_place("layers.3.mlp.fc1.weight", stacks) == Place("layers.3.mlp.fc1.weight")
    assert save_place("final_norm.weight", stacks) == Place("final_norm.weight")


def test_an_expert_shard_is_its_rows_of_the_global_expert_axis():
    param = torch.nn.Parameter(torch.zeros(2, 6, 5))
    param.expert_shard = (4, 8)  # experts 4 and 5 of 8
    (piece,) = pieces(
        "layers.mlp.experts.fc2.weight",
        (2, 6, 5),
        param,
        Mesh.single(),
        100,
        Place("layers.mlp.experts.fc2.weight", 3, 4),
    )
    assert piece.spec.global_shape == (4, 8, 6, 5)
    assert piece.spec.offsets == (3, 4, 0, 0) and piece.spec.shape == (1, 2, 6, 5)
    param.expert_shard = (7, 8)
    with pytest.raises(
        CheckpointError, match=r"expert_shard \(7, 8\) does not fit its 2 local experts"
    ):
        pieces("x", (2, 6, 5), param, Mesh.single(), 100, Place("x"))


def test_tensor_parallel_expert_and_vocabulary_boxes():
    from meshtrain.services.trainer.parallel.tensor_layers import TPSplit

    fc1 = torch.nn.Parameter(
        torch.zeros(2, 12, 5)
    )  # 2 local experts, [gate; up] halves of 6 rows each
    fc1.expert_shard, fc1.tp_split = (2, 4), TPSplit(1, halves=True)
    got = pieces(
        "layers.3.mlp.experts.fc1.weight",
        (2, 12, 5),
        fc1,
        Mesh(tp=2, ep=2, rank=1),
        100,
        Place("layers.3.mlp.experts.fc1.weight"),
    )
    # tp rank 1 of 2: rows 6..11 of the gate half and 18..23 of the up half, experts 2..3 of 4
    assert [(p.spec.offsets, p.spec.shape) for p in got] == [
        ((2, 6, 0), (2, 6, 5)),
        ((2, 18, 0), (2, 6, 5)),
    ]
    assert all(p.spec.global_shape == (4, 24, 5) for p in got)
    # a vocabulary of 100 within tp rank 0's 128 padded rows: one box, the whole array
    emb = torch.nn.Parameter(torch.zeros(128, 8))
    emb.tp_split = TPSplit(0, vocab=True)
    (box,) = pieces(
        "embedding.word_embeddings.weight",
        (128, 8),
        emb,
        Mesh(tp=2, rank=0),
        100,
        Place("embedding.word_embeddings.weight"),
    )
    assert (box.spec.global_shape, box.spec.shape, box.spec.grid) == ((100, 8), (100, 8), None)
    assert (
        pieces(
            "embedding.word_embeddings.weight",
            (128, 8),
            emb,
            Mesh(tp=2, rank=1),
            100,
            Place("embedding.word_embeddings.weight"),
        )
        == []
    )


def test_restore_refuses_a_model_with_experts_in_other_blocks(tmp_path):
    model, optimizer = build()
    train(model, optimizer, batches(1))
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 1, model, optimizer)
    dense, dense_opt = build(moe_layer_freq=[1, 1, 0, 1])  # block 0 holds experts here
    with pytest.raises(CheckpointError, match="checkpoint lacks parameters"):
        load_checkpoint(root, dense, dense_opt)


def test_convert_lays_experts_out_for_a_target_ep_and_tp_and_the_result_resumes(tmp_path):
    from meshtrain.services.checkpoint.convert import convert, inspect_checkpoint

    data = batches(4)
    model, optimizer = build()
    whole = train(model, optimizer, data)
    model, optimizer = build()
    train(model, optimizer, data[:2])
    src, dst = str(tmp_path / "a"), str(tmp_path / "b")
    save_checkpoint(src, 2, model, optimizer)
    convert(src, dst, target_tp=2, target_ep=2, progress=False)
    arrays = read_manifest(dst, 2)["arrays"]
    # 2 experts per shard; within each, gate and up halves split in 2
    # (12 of 24 rows) / fc2's columns
    assert arrays["layers.1.mlp.experts.fc1.weight"]["shards"] == [2, 12, 32]
    assert arrays["optim.exp_avg_sq.layers.3.mlp.experts.fc2.weight"]["shards"] == [2, 32, 12]
    assert arrays["layers.1.mlp.shared_expert.fc1.weight"]["shards"] == [16, 32]
    assert arrays["layers.3.mlp.router.weight"]["shards"] == [4, 32]  # replicated
    assert arrays["layers.2.mlp.fc1.weight"]["shards"] == [24, 32]
    assert verify_checkpoint(dst, 2) > 0
    shown = inspect_checkpoint(dst)
    assert shown["tensors"]["layers.1.mlp.experts.fc1.weight"]["shape"] == [4, 48, 32]
    assert shown["provenance"]["converted_from"]["target_ep"] == 2
    fresh, fresh_opt = build(seed=1)
    load_checkpoint(dst, fresh, fresh_opt)
    assert train(fresh, fresh_opt, data[2:]) == whole[2:]

    narrow = str(tmp_path / "bf16")
    convert(src, narrow, dtype="bf16", drop_optimizer=True, progress=False)
    assert (
        read_manifest(narrow, 2)["arrays"]["layers.3.mlp.experts.fc2.weight"]["dtype"] == "bfloat16"
    )
    with pytest.raises(CheckpointError, match="target ep=3 does not divide model.num_experts=4"):
        convert(src, str(tmp_path / "c"), target_ep=3, progress=False)
    with pytest.raises(CheckpointError, match=r"target tp=5 does not divide"):
        convert(src, str(tmp_path / "c"), target_tp=5, progress=False)


# ----------------------------------------------------------------------------- expert parallelism
EP_STEPS = 6


def _ep_job(model_settings: dict, distributed_optimizer: bool = False):
    """A data-parallel MoE model on this process's mesh, as the trainer builds it."""
    from meshtrain.services.trainer.config.sections import OptimConfig
    from meshtrain.services.trainer.parallel.ddp import DistributedDataParallel

    def make(mesh: Mesh):
        from meshtrain.services.trainer.parallel.expert import parallelize_experts
        from meshtrain.services.trainer.parallel.tensor import parallelize

        torch.manual_seed(0)
        model = GPT(ModelConfig(**model_settings))
        if mesh.tp > 1:
            parallelize(model, mesh)
        model = parallelize_experts(model, mesh)
        ddp = DistributedDataParallel(
            model,
            mesh,
            OptimConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.0),
            distributed_optimizer=distributed_optimizer,
        )
        return ddp, ddp.optimizer

    return make


def _train_share(ddp, optimizer, mesh: Mesh, data: list[torch.Tensor]) -> list[float]:
    """Steps on this rank's share of each global batch; returns the global batch's mean losses."""
    import torch.distributed as dist

    losses = []
    for sample in data:
        part = sample[mesh.dp_rank :: mesh.dp]  # (global batch / dp, seq + 1)
        optimizer.zero_grad()
        loss = ddp(part[:, :-1], part[:, 1:])
        loss.backward()
        optimizer.step()
        for _, layer in moe_layers(ddp):
            layer.update_expert_bias(layer.stats_group)
            layer.reset_stats()
        loss = loss.detach()
        if mesh.dp > 1:  # tp ranks hold the same loss
            dist.all_reduce(loss, group=mesh.group("dp"))
            loss /= mesh.dp
        losses.append(loss.item())
    return losses


def _ep_segment(rank, world, root, ep, load_step, start, stop, tp=1, distributed_optimizer=False):
    mesh = Mesh.build(tp=tp, ep=ep)
    ddp, optimizer = _ep_job(MOE, distributed_optimizer)(mesh)
    experts = dict(ddp.module.named_parameters())["layers.1.mlp.experts.fc1.weight"]
    assert experts.shape[:2] == (4 // ep, 48 // tp)
    if load_step is not None:
        assert load_checkpoint(root, ddp, optimizer, step=load_step).iteration == load_step
    losses = _train_share(ddp, optimizer, mesh, batches(EP_STEPS, batch=4)[start:stop])
    save_checkpoint(root, stop, ddp, optimizer)
    return losses


@pytest.mark.dist
@pytest.mark.slow
def test_resumes_across_expert_parallel_sizes_with_the_uninterrupted_losses(tmp_path):
    """ep=4 (dp=4: each rank one expert) saves at step 2; one process (ep=1) resumes, saves at
    step 4; ep=2 over dp=4 (each expert on 2 ranks, one writes) resumes to step 6. The losses
    must be the one-process run's: 1e-5 relative covers the different summation order of the
    data-parallel gradient mean (a lost or misplaced expert, or an expert bias not restored,
    changes the loss in the third digit)."""
    from tests.dist_utils import run_ranks

    data = batches(EP_STEPS, batch=4)
    make = _ep_job(MOE)
    ddp, optimizer = make(Mesh.single())
    whole = _train_share(ddp, optimizer, Mesh.single(), data)

    root = str(tmp_path / "ckpt")
    got = run_ranks(_ep_segment, 4, root, 4, None, 0, 2)[0]
    ddp, optimizer = make(Mesh.single())
    assert load_checkpoint(root, ddp, optimizer, step=2).iteration == 2
    got += _train_share(ddp, optimizer, Mesh.single(), data[2:4])
    save_checkpoint(root, 4, ddp, optimizer)
    got += run_ranks(_ep_segment, 4, root, 2, 4, 4, 6)[0]
    assert verify_checkpoint(root, 6) > 0
    torch.testing.assert_close(torch.tensor(got), torch.tensor(whole), rtol=1e-5, atol=0)


@pytest.mark.dist
@pytest.mark.slow
def test_a_tensor_and_expert_parallel_zero1_checkpoint_resumes_on_one_process(tmp_path):
    """tp=2 x dp=2 with ep=2 and the distributed optimizer: each expert weight is written as
    (its ep rank's experts) x (its tp rank's gate and up halves, or fc2 columns), the moments
    gathered over edp; one process resumes from it. Tolerance as above, plus the tensor-parallel
    partial sums."""
    from tests.dist_utils import run_ranks

    data = batches(EP_STEPS, batch=4)
    make = _ep_job(MOE)
    ddp, optimizer = make(Mesh.single())
    whole = _train_share(ddp, optimizer, Mesh.single(), data)

    root = str(tmp_path / "ckpt")
    got = run_ranks(_ep_segment, 4, root, 2, None, 0, 3, 2, True)[0]
    ddp, optimizer = make(Mesh.single())
    assert load_checkpoint(root, ddp, optimizer, step=3).iteration == 3
    got += _train_share(ddp, optimizer, Mesh.single(), data[3:])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(whole), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_a_trainer_moe_run_resumes_with_identical_losses(corpus_cache, tmp_path):
    """`meshtrain train` with a dense block and a MoE block (gated shared expert, expert bias,
    aux and z-loss), stopped at step 3 and resumed: steps 4..6 equal the uninterrupted run's
    exactly, and so does every saved tensor, the expert bias included."""
    from meshtrain.services.checkpoint.reader import load_checkpoint as read_tensors
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import train
    from tests.services.trainer.conftest import small_job_args

    common = {
        "train.train_iters": 6,
        "train.eval_interval": 0,
        "model.num_experts": 4,
        "model.moe_layer_freq": "[0,1]",
        "model.moe_ffn_hidden_size": 32,
        "model.moe_router_topk": 2,
        "model.moe_shared_expert_intermediate_size": 32,
        "model.moe_shared_expert_gate": True,
        "model.moe_router_enable_expert_bias": True,
        "model.moe_router_bias_update_rate": 0.01,
        "model.moe_aux_loss_coeff": 0.01,
        "model.moe_z_loss_coeff": 0.001,
    }
    full = train(
        load_config(
            small_job_args(
                corpus_cache, tmp_path / "full", **common, **{"checkpoint.save_interval": 3}
            )
        )
    )
    ckpt = str(tmp_path / "full" / "checkpoints")
    resumed = train(
        load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "resumed",
                **common,
                **{
                    "checkpoint.load": ckpt,
                    "checkpoint.load_step": 3,
                    "checkpoint.save": str(tmp_path / "ck2"),
                },
            )
        )
    )
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == full.losses[step], step
    a, _ = read_tensors(ckpt, 6)
    b, _ = read_tensors(str(tmp_path / "ck2"), 6)
    assert (
        "layers.1.mlp.router.expert_bias" in a
        and a["layers.1.mlp.router.expert_bias"].abs().sum() > 0
    )
    for name, t in a.items():
        if not name.startswith("rng."):
            assert torch.equal(t, b[name]), name


def test_restore_warns_when_the_routing_differs_from_the_saved_model(tmp_path, caplog):
    model, optimizer = build()
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 0, model, None)
    other, _ = build(moe_router_topk=1)
    with caplog.at_level("WARNING", logger="meshtrain.checkpoint"):
        load_checkpoint(root, other)
    assert "saved with model.moe_router_topk=2, this run has 1" in caplog.text
