"""The pieces the GRPO-from-SFT tests share: a "Q: ...\\nA: " chat template, a tiny byte-level
model's settings, the command line they make, and a short SFT run on chats (through the real
path: `preprocess_chat`, `data.format = "sft"`) whose checkpoint GRPO then starts from."""

from __future__ import annotations

import json
from pathlib import Path

from meshtrain.services.dataloader.sft_data import preprocess_chat
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'A: ' + m['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)
MODEL = {
    "model.num_layers": 2,
    "model.hidden_size": 64,
    "model.num_attention_heads": 4,
    "model.seq_length": 32,
    "data.tokenizer": "byte",
    "train.device": "cpu",
    "train.eval_interval": 0,
    "optim.lr_warmup_iters": 0,
    "log.plot": False,
}


def cli_args(**settings) -> list[str]:
    """`--key=value` arguments of the settings (booleans as true/false)."""
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]


def write_template(folder: Path) -> Path:
    """The chat template as a .jinja file under `folder`."""
    template = folder / "qa.jinja"
    template.write_text(TEMPLATE)
    return template


def train_sft(folder: Path, chats: Path, template: Path, iters: int, **overrides) -> Path:
    """The checkpoint root of a short SFT run of MODEL (with `overrides`) on the chats (JSONL of
    `messages`), saved at its last step."""
    model = {**MODEL, **overrides}
    lines = len(chats.read_text().splitlines())
    data = folder / "data" / "chats"
    tok = build_tokenizer("byte")
    max_tokens = model["model.seq_length"] + 1
    stats = preprocess_chat([chats], data, tok, str(template), max_tokens=max_tokens)
    assert stats.conversations == lines and not stats.dropped
    ckpt = folder / "sft"
    settings = {
        **model,
        "data.format": "sft",
        "data.data_path": json.dumps([str(data)]),
        "train.micro_batch_size": 32,
        "train.global_batch_size": 32,
        "train.train_iters": iters,
        "train.seed": 1,
        "optim.lr": 3e-3,
        "optim.min_lr": 3e-3,
        "log.run_dir": str(folder / "sft-run"),
        "log.log_interval": 10,
        "checkpoint.save": str(ckpt),
        "checkpoint.save_interval": iters,
    }
    train(load_config(cli_args(**settings)))
    return ckpt


def metric_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
