"""Vision-language training through the trainer: synthetic batches (random images, tokens with
the placeholders expanded) handed to `Trainer.train_step` in place of the data source's; one
process first (freezing, errors), then tp, dp with ZeRO-1, pp on 2 gloo ranks each, whose losses
match the single-process run's to 1e-6 relative."""

import pytest
import torch

from meshtrain.services.common.errors import ConfigError, DataError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import Trainer
from tests.dist_utils import run_ranks
from tests.services.trainer.conftest import small_job_args
from tests.services.trainer.vision_batches import VISION, ImageBatches

STEPS = 3
JOB = {
    **VISION,
    "model.num_layers": 2,
    "model.hidden_size": 32,
    "model.seq_length": 32,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 8,
    "train.train_iters": STEPS,
    "train.eval_interval": 0,
    "optim.lr": 3e-3,
    "optim.lr_warmup_iters": 0,
    "parallel.ddp_bucket_size": 5000,
}
LLAMA = {
    "model.normalization": "rmsnorm",
    "model.activation": "swiglu",
    "model.ffn_hidden_size": 64,
    "model.position_embedding_type": "rope",
    "model.add_bias_linear": False,
    "model.untie_embeddings_and_output_weights": True,
}


def run_steps(args, steps=STEPS):
    """(losses, then gradient norms) of `steps` steps (on this rank: the last pipeline stage's
    are the loss), the trainer. The norms see what Adam's updates do not: a gradient off by a
    constant factor."""
    trainer = Trainer(load_config(args))
    try:
        m = trainer.mesh
        trainer.data.train = ImageBatches(trainer.job, m.dp_rank, m.dp, per_image=4)
        losses, norms = [], []
        for step in range(steps):
            loss, norm = trainer.train_step(step)
            norms.append(norm.item())
            if m.dp > 1:  # each dp rank's mean over its micro-batches: the step's is their mean
                loss = loss.clone()
                torch.distributed.all_reduce(loss, group=m.group("dp"))
                loss /= m.dp
            losses.append(loss.item())
        return losses + norms, trainer  # the losses, then the gradient norms
    finally:
        trainer.release_run_dir()


def _job(corpus_cache, tmp_path, **extra):
    return small_job_args(corpus_cache, tmp_path, **{**JOB, **extra})


def test_trains_and_freezes(corpus_cache, tmp_path):
    losses, t = run_steps(_job(corpus_cache, tmp_path / "a", **LLAMA))
    assert all(torch.isfinite(torch.tensor(losses)))
    trained = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert "vision.layers.2.mlp.fc1.weight" not in trained  # past select_layer -2: never run
    assert "vision.layers.1.mlp.fc1.weight" in trained and "projector.fc2.weight" in trained

    # bf16 autocast (with the bf16 weight copies of one process): the same curve, rounded
    bf16, _ = run_steps(_job(corpus_cache, tmp_path / "bf16", **LLAMA, **{"train.bf16": True}))
    assert bf16[:STEPS] == pytest.approx(losses[:STEPS], rel=2e-2)

    # LLaVA stage 1: the projector alone; the frozen parts keep their weights
    args = _job(
        corpus_cache,
        tmp_path / "b",
        **LLAMA,
        **{"train.freeze_vision": True},
        **{"train.freeze_language_model": True},
    )
    trainer = Trainer(load_config(args))
    try:
        trainer.data.train = ImageBatches(trainer.job, 0, 1, per_image=4)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train_step(0)
        opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        for n, p in trainer.model.named_parameters():
            moved = not torch.equal(before[n], p)
            assert moved == n.startswith("projector."), n
            assert (id(p) in opt) == n.startswith("projector."), n
    finally:
        trainer.release_run_dir()


def test_refusals(corpus_cache, tmp_path):
    with pytest.raises(ConfigError, match="model.vision, which is unset"):
        load_config(small_job_args(corpus_cache, tmp_path, **{"train.freeze_vision": True}))
    with pytest.raises(ConfigError, match="whole model"):
        load_config(
            _job(
                corpus_cache,
                tmp_path,
                **{
                    "train.freeze_vision": True,
                    "train.freeze_projector": True,
                    "train.freeze_language_model": True,
                },
            )
        )
    with pytest.raises(ConfigError, match="did you mean --model.vision.hidden_size"):
        load_config(_job(corpus_cache, tmp_path, **{"model.vision.hiden_size": 3}))
    trainer = Trainer(load_config(_job(corpus_cache, tmp_path / "c")))
    try:
        src = ImageBatches(trainer.job, 0, 1, per_image=4)
        bad = src.micro_batches(0)
        bad[1].images = bad[1].images[:1]  # one image fewer than the placeholders say

        class Bad:
            def micro_batches(self, step):
                return bad

        trainer.data.train = Bad()
        with pytest.raises(DataError, match="placeholder tokens"):
            trainer.train_step(0)
    finally:
        trainer.release_run_dir()


def _rank(rank, world, args):
    losses, trainer = run_steps(args)
    m = trainer.mesh
    last = m.pp == 1 or m.pp_rank == m.pp - 1
    return losses if last else None


_reference: dict = {}


CASES = {
    "tp2-sp": ({**LLAMA, "parallel.tp": 2, "parallel.sequence_parallel": True}, LLAMA),
    "tp2-frozen-encoder": (
        {"parallel.tp": 2, "train.freeze_vision": True},
        {"train.freeze_vision": True},
    ),
    "dp2-zero1-recompute": (
        {
            **LLAMA,
            "parallel.use_distributed_optimizer": True,
            "parallel.overlap_grad_reduce": True,
            "parallel.overlap_param_gather": True,
            "parallel.recompute_granularity": "full",
            "parallel.recompute_method": "uniform",
            "parallel.recompute_num_layers": 1,
        },
        LLAMA,
    ),
    "dp2-frozen-lm": ({"train.freeze_language_model": True}, {"train.freeze_language_model": True}),
    "pp2": ({**LLAMA, "parallel.pp": 2}, LLAMA),
    "pp2-frozen-encoder": (
        {"parallel.pp": 2, "train.freeze_vision": True},
        {"train.freeze_vision": True},
    ),
}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_matches_one_process(corpus_cache, tmp_path, case):
    extra, ref_extra = CASES[case]
    key = tuple(sorted(ref_extra.items()))
    if key not in _reference:
        _reference[key], _ = run_steps(_job(corpus_cache, tmp_path / "ref", **ref_extra))
    args = _job(corpus_cache, tmp_path / "run", **extra)
    results = run_ranks(_rank, 2, args)
    losses = [r for r in results if r is not None][0]
    ref = _reference[key]
    assert losses[:STEPS] == pytest.approx(ref[:STEPS], rel=1e-6), (case, losses, ref)
    assert losses[STEPS:] == pytest.approx(ref[STEPS:], rel=1e-5), (case, losses, ref)
    assert len(set(ref[:STEPS])) == STEPS  # it trains: the loss moves


def _eval_loss(trainer) -> float:
    """The loss of step 100's first micro-batch (not trained on), forward only."""
    m = trainer.mesh
    b = ImageBatches(trainer.job, m.dp_rank, m.dp, per_image=4).micro_batches(100)[0]
    with torch.no_grad():
        return trainer.forward(b.tokens, b.labels, b.loss_mask, None, None, b.images).item()


def _train_and_save(rank, world, args):
    _, trainer = run_steps(args)
    trainer.state.iteration = STEPS
    trainer.state.consumed_samples = STEPS * trainer.job.train.global_batch_size
    url = trainer.save()
    trainer.checkpointer.close()
    return {"url": url, "eval": _eval_loss(trainer)}


@pytest.mark.dist
@pytest.mark.slow
def test_a_tp2_checkpoint_loads_at_tp1(corpus_cache, tmp_path):
    """The vision arrays are stored in global coordinates: a tp=2 (sequence parallel) save loads
    into one process, which computes the same loss."""
    extra = {**LLAMA, "checkpoint.async_save": False}
    args = _job(
        corpus_cache,
        tmp_path / "tp2",
        **extra,
        **{"parallel.tp": 2},
        **{"parallel.sequence_parallel": True},
    )
    results = run_ranks(_train_and_save, 2, args)
    root = results[0]["url"].rsplit("/", 1)[0]
    load = {**extra, "checkpoint.load": root}
    trainer = Trainer(load_config(_job(corpus_cache, tmp_path / "tp1", **load)))
    try:
        assert trainer.state.iteration == STEPS
        assert _eval_loss(trainer) == pytest.approx(results[0]["eval"], rel=1e-6)
        names = {n for n, _ in trainer.model.named_parameters()}
        assert "vision.layers.0.attention.qkv.weight" in names
    finally:
        trainer.release_run_dir()


def test_megatron_multimodal_freeze_flags(corpus_cache, tmp_path):
    job = load_config(_job(corpus_cache, tmp_path) + ["--freeze-ViT", "--freeze-LM"])
    assert (job.train.freeze_vision, job.train.freeze_language_model) == (True, True)
    assert not job.train.freeze_projector
    with pytest.raises(ConfigError, match="context parallelism"):
        load_config(_job(corpus_cache, tmp_path, **{"parallel.cp": 2}))
    with pytest.raises(ConfigError, match="train.cuda_graph"):
        load_config(_job(corpus_cache, tmp_path, **{"train.cuda_graph": True}))
    with pytest.raises(ConfigError, match="must divide model.vision.num_attention_heads=2"):
        narrow = {"parallel.tp": 4, "model.vision.num_attention_heads": 2}
        load_config(_job(corpus_cache, tmp_path, **narrow))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_takes_the_language_models_blocks_only_on_gpu(corpus_cache, tmp_path):
    extra = {**LLAMA, "train.device": "cuda", "train.bf16": True}
    ref, _ = run_steps(_job(corpus_cache, tmp_path / "bf16", **extra))
    losses, trainer = run_steps(
        _job(corpus_cache, tmp_path / "fp8", **extra, **{"train.fp8": "e4m3"})
    )
    assert trainer.fp8 is not None and trainer.fp8.layers
    assert all(name.startswith("layers.") for name in trainer.fp8.layers)
    assert losses[:STEPS] == pytest.approx(ref[:STEPS], rel=5e-2)
