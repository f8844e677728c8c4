"""A small real corpus (a slice of the Python stdlib, byte-level) shared by the training tests."""

import pytest

from meshtrain.services.dataloader.preprocess import prepare_default_dataset


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("corpus")
    prepare_default_dataset(cache, tokenizer="byte", max_bytes=400_000)
    return cache


def small_job_args(cache, run_dir, **extra):
    """Overrides for a ~0.2M-parameter model that trains in seconds on 2 cores."""
    args = {
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.num_attention_heads": 4,
        "model.seq_length": 64,
        "data.tokenizer": "byte",
        "data.default_corpus_bytes": 400_000,
        "data.cache_dir": str(cache),
        "data.split": "80,20,0",
        "train.micro_batch_size": 8,
        "train.global_batch_size": 16,
        "train.train_iters": 40,
        "train.eval_interval": 20,
        "train.eval_iters": 4,
        "train.device": "cpu",
        "optim.lr": 3e-3,
        "optim.min_lr": 3e-4,
        "optim.lr_warmup_iters": 5,
        "log.log_interval": 1,
        "log.run_dir": str(run_dir),
        "log.plot": False,
    }
    args.update(extra)
    out = []
    for key, value in args.items():
        if isinstance(value, bool):
            value = str(value).lower()
        out.append(f"--{key}={value}")
    return out


ON_CPU_ENV = "MESHTRAIN_GPU_TESTS_ON_CPU"
"""Set to 1 to run the `gpu_device` tests' bodies on the CPU as well (their CUDA case skips
without a GPU): how those bodies are checked on a machine without one. Unset, they run on CUDA
only, so the suite holds no CPU duplicates of the CPU tests they extend."""


def _gpu_devices():
    import os

    import torch

    cuda = pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    )
    return [cuda, "cpu"] if os.environ.get(ON_CPU_ENV) == "1" else [cuda]


@pytest.fixture(params=_gpu_devices())
def gpu_device(request) -> str:
    """The device a GPU test runs its body on: "cuda" (and "cpu" under ON_CPU_ENV=1)."""
    return request.param


def losses_in_order(result) -> list[float]:
    """A run's logged training losses, step by step."""
    return [result.losses[s] for s in sorted(result.losses)]


def first_step_loss(args: list[str]) -> float:
    """The loss of step 1 of the job `args` (its own data order: the samples' shuffle depends on
    train.train_iters), without running the rest."""
    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer

    trainer = Trainer(load_config(args))
    try:
        return trainer.train_step(0)[0].item()
    finally:
        trainer.release_run_dir()
