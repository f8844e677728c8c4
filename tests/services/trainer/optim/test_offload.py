"""Optimizer CPU offload (services/trainer/optim/offload.py): the offloaded update equals fused
CPU AdamW's bit for bit, alone, in the trainer, under dp2 + ZeRO-1, and across a resume that
turns offload on or off; on CUDA it matches the device optimizer to bf16 tolerance.

The trainer's non-offloaded optimizer on CPU is PyTorch's for-loop AdamW, which rounds
differently from the fused one the offload runs; the baselines here are built with fused=True
(`fused_cpu_adamw`) so that every comparison is exact.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.optim.offload import OffloadedAdamW
from meshtrain.services.trainer.optim.optimizer import build_optimizer, clip_grad_norm


class _FusedAdamW(torch.optim.AdamW):
    def __init__(self, *args, **kwargs):
        kwargs["fused"] = True
        super().__init__(*args, **kwargs)


def fused_cpu_adamw(monkeypatch) -> None:
    """The trainer's own (non-offloaded) AdamW made fused on CPU too, as the offload's is."""
    import meshtrain.services.trainer.optim.optimizer as optimizer

    monkeypatch.setattr(optimizer.torch.optim, "AdamW", _FusedAdamW)


def _tiny_run(config: OptimConfig, steps: int = 4):
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(
            vocab_size=97, num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16
        )
    )
    opt = build_optimizer(model, config)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 97, (4, 17), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:], None)
        loss.backward()
        clip_grad_norm(model, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model, opt


@pytest.mark.parametrize("overlap", [False, True])
def test_offloaded_steps_equal_fused_cpu_adamw(monkeypatch, overlap):
    offloaded = OptimConfig(
        lr=1e-2,
        optimizer_cpu_offload=True,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        cpu_offload_chunk_numel=3000,
    )
    losses, model, opt = _tiny_run(offloaded)
    assert isinstance(opt, OffloadedAdamW)
    assert len(opt.chunks) > 3 if overlap else len(opt.chunks) == 1
    # a separate master copy per parameter, in its own storage, equal to the parameter
    for p, m in opt.master_of.items():
        assert m.device.type == "cpu" and m.data_ptr() != p.data_ptr()
        assert torch.equal(m, p.detach())
    plain_losses, plain, plain_opt = _tiny_run(OptimConfig(lr=1e-2))
    fused_cpu_adamw(monkeypatch)
    fused_losses, fused, fused_opt = _tiny_run(OptimConfig(lr=1e-2))
    assert losses == fused_losses
    for a, b in zip(model.parameters(), fused.parameters(), strict=True):
        assert torch.equal(a, b)
    # the moments and step counts, keyed by the device parameters as AdamW's are
    names = {p: n for n, p in model.named_parameters()}
    fused_names = {p: n for n, p in fused.named_parameters()}
    ours = {names[p]: st for p, st in opt.state.items()}
    theirs = {fused_names[p]: st for p, st in fused_opt.state.items()}
    assert ours.keys() == theirs.keys() and len(ours) == len(list(model.parameters()))
    for name, st in theirs.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours[name][key], st[key]), (name, key)
    # and within rounding of the for-loop AdamW the trainer runs on CPU without offload
    assert losses == pytest.approx(plain_losses, rel=1e-5)


def test_parameters_without_gradients_are_skipped_and_reloads_are_read():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = OffloadedAdamW([a, b], lr=0.1, weight_decay=0.0)
    a.grad = torch.ones(3)
    opt.step()
    assert torch.all(a < 1) and torch.equal(b.detach(), torch.ones(2))
    assert set(opt.state) == {a}  # AdamW keeps no state for a parameter it never updated
    opt.zero_grad()
    assert a.grad is None
    with torch.no_grad():  # a load of the weights alone writes the device parameters
        a.fill_(5.0)
    opt.reload_parameters()
    a.grad = torch.zeros(3)
    opt.step()
    assert torch.all((a - 5.0).abs() < 0.2)
    sd = opt.state_dict()
    again = OffloadedAdamW([a, b], lr=0.1, weight_decay=0.0)
    again.load_state_dict(sd)
    assert torch.equal(again.state[a]["exp_avg"], opt.state[a]["exp_avg"])
    assert again.state[a]["exp_avg"].device.type == "cpu"


def test_what_offload_does_not_compose_with_is_refused_by_name():
    from meshtrain.services.trainer.config.load import load_config

    base = ["--optim.optimizer_cpu_offload=true"]
    with pytest.raises(ConfigError, match="does not compose with train.fp8"):
        load_config([*base, "--train.fp8=e4m3", "--train.bf16=true"])
    with pytest.raises(ConfigError, match="does not compose with train.cuda_graph"):
        load_config([*base, "--train.cuda_graph=true", "--train.device=cuda"])
    with pytest.raises(ConfigError, match="FSDP2"):
        load_config([*base, "--parallel.use_torch_fsdp2=true"])
    with pytest.raises(ConfigError, match="needs optim.optimizer_cpu_offload"):
        load_config(["--optim.overlap_cpu_optimizer_d2h_h2d=true"])
    job = load_config(["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"])
    assert job.optim.optimizer_cpu_offload and job.optim.overlap_cpu_optimizer_d2h_h2d


def _train(corpus_cache, run_dir, **extra):
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import train
    from tests.services.trainer.conftest import small_job_args

    args = {"train.eval_interval": 0, "train.train_iters": 4, **extra}
    return train(load_config(small_job_args(corpus_cache, run_dir, **args)))


def test_an_offloaded_run_equals_the_plain_run(corpus_cache, tmp_path, monkeypatch):
    from meshtrain.services.checkpoint.reader import load_checkpoint

    offloaded = _train(
        corpus_cache,
        tmp_path / "off",
        **{
            "checkpoint.save": str(tmp_path / "ckpt_off"),
            "optim.optimizer_cpu_offload": True,
            "optim.overlap_cpu_optimizer_d2h_h2d": True,
            "optim.cpu_offload_chunk_numel": 20_000,
        },
    )
    fused_cpu_adamw(monkeypatch)
    plain = _train(corpus_cache, tmp_path / "plain", **{"checkpoint.save": str(tmp_path / "ckpt")})
    assert offloaded.losses == plain.losses and len(plain.losses) == 4
    # the parameters and the moments the offloaded run saved are the plain run's
    ours, _ = load_checkpoint(str(tmp_path / "ckpt_off"))
    theirs, _ = load_checkpoint(str(tmp_path / "ckpt"))
    assert ours.keys() == theirs.keys() and any(k.startswith("optim.exp_avg_sq.") for k in ours)
    for name, t in theirs.items():
        if not name.startswith("rng."):
            assert torch.equal(ours[name], t), name


@pytest.mark.parametrize("first_offloaded", [True, False])
@pytest.mark.e2e
def test_resume_turns_offload_on_or_off(corpus_cache, tmp_path, monkeypatch, first_offloaded):
    fused_cpu_adamw(monkeypatch)  # so that both sides round alike: the comparison is exact
    on = {"optim.optimizer_cpu_offload": True}
    root = str(tmp_path / "ckpt")
    first = _train(
        corpus_cache,
        tmp_path / "first",
        **{"checkpoint.save": root, "checkpoint.save_interval": 2},
        **(on if first_offloaded else {}),
    )
    second = _train(
        corpus_cache,
        tmp_path / "second",
        **{"checkpoint.load": root, "checkpoint.load_step": 2},
        **{"checkpoint.save": str(tmp_path / "ckpt2")},
        **({} if first_offloaded else on),
    )
    assert second.losses == {k: first.losses[k] for k in (3, 4)}


def _zero1_runs(rank, world, args_by_run, patch):
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer

    if patch:
        import meshtrain.services.trainer.optim.optimizer as optimizer

        optimizer.torch.optim.AdamW = _FusedAdamW
    out = []
    for args in args_by_run:
        trainer = Trainer(load_config(args))
        out.append(trainer.run().losses)
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_zero1_dp2_offloaded_equals_plain_and_resumes(corpus_cache, tmp_path):
    from tests.dist_utils import run_ranks
    from tests.services.trainer.conftest import small_job_args

    root = str(tmp_path / "ckpt")
    common = {
        "train.eval_interval": 0,
        "train.train_iters": 3,
        "parallel.use_distributed_optimizer": True,
        "parallel.overlap_grad_reduce": True,
    }
    on = {"optim.optimizer_cpu_offload": True, "optim.overlap_cpu_optimizer_d2h_h2d": True}
    plain = small_job_args(
        corpus_cache,
        tmp_path / "plain",
        **common,
        **{"checkpoint.save": root, "checkpoint.save_interval": 2},
    )
    offloaded = small_job_args(
        corpus_cache, tmp_path / "off", **common, **on, **{"optim.cpu_offload_chunk_numel": 20_000}
    )
    resumed = small_job_args(
        corpus_cache,
        tmp_path / "resumed",
        **common,
        **on,
        **{"checkpoint.load": root, "checkpoint.load_step": 2, "checkpoint.save": None},
    )
    resumed = [a for a in resumed if not a.startswith("--checkpoint.save=")]
    results = run_ranks(_zero1_runs, 2, [plain, offloaded, resumed], True, timeout=200)
    for losses_plain, losses_off, losses_resumed in results:
        assert losses_off == losses_plain and len(losses_plain) == 3
        assert losses_resumed == {3: losses_plain[3]}


@pytest.mark.gpu
def test_offloaded_training_on_cuda_matches_the_device_optimizer(corpus_cache, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = {"train.device": "cuda", "train.bf16": True, "train.train_iters": 6}
    plain = _train(corpus_cache, tmp_path / "plain", **cuda)
    offloaded = _train(
        corpus_cache,
        tmp_path / "off",
        **cuda,
        **{
            "optim.optimizer_cpu_offload": True,
            "optim.overlap_cpu_optimizer_d2h_h2d": True,
            "optim.cpu_offload_chunk_numel": 20_000,
        },
    )
    assert sorted(offloaded.losses) == sorted(plain.losses)
    for step, loss in plain.losses.items():
        assert offloaded.losses[step] == pytest.approx(loss, rel=2e-2), step
