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
