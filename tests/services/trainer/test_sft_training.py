"""Supervised fine-tuning end to end: `deploy/configs/sft-tiny.toml` on the data of
`examples/sft_upper.py` teaches a tiny model a chat format it could not follow before."""

import importlib.util
from pathlib import Path

import pytest
import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.dataloader.chat import load_chat_template
from meshtrain.services.dataloader.tokenizers.base import ByteTokenizer, build_tokenizer
from meshtrain.services.trainer.config.load import load_config

REPO = Path(__file__).resolve().parents[3]


def _example():
    spec = importlib.util.spec_from_file_location("sft_upper", REPO / "examples/sft_upper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job(data: dict, run_dir: Path, *extra: str):
    return load_config(
        [
            "--config",
            str(REPO / "deploy/configs/sft-tiny.toml"),
            f'--data.data_path=["{data["prefix"]}"]',
            f"--data.tokenizer={data['tokenizer']}",
            f"--log.run_dir={run_dir}",
            "--log.plot=false",
            *extra,
        ]
    )


def _answers(model, tok, words: list[str]) -> list[str]:
    """Greedy answers to `upper WORD` prompts that end with the assistant header."""
    template = load_chat_template("auto", tok)
    end = tok.encode_with_special_tokens("<|im_end|>")[0]
    out = []
    model.eval()
    with torch.no_grad():
        for word in words:
            prompt = [{"role": "user", "content": f"upper {word}"}]
            ids = tok.encode_with_special_tokens(template.render(prompt, True))
            answer: list[int] = []
            for _ in range(len(word) + 1):
                logits = model(torch.tensor([ids + answer]))  # (1, seq, vocab)
                nxt = int(logits[0, -1, : tok.vocab_size].argmax())
                if nxt == end:
                    break
                answer.append(nxt)
            out.append(tok.decode(answer))
    return out


@pytest.mark.e2e  # about 20 s on 2 idle cores: a real training run, kept in `make test`
def test_sft_tiny_learns_to_answer_held_out_prompts(tmp_path):
    """Exact answers to words never trained on: a mask shifted by one never trains the first
    letter, a mask on the prompts trains no answer, and cut conversations break the format."""
    from meshtrain.services.trainer.train import Trainer

    example = _example()
    data = example.make_data(tmp_path / "data")
    trainer = Trainer(_job(data, tmp_path / "run"))
    tok = build_tokenizer(data["tokenizer"])
    held_out = example.words(held_out=True)[::2][:40]
    assert all(w not in open(data["chats"]).read() for w in held_out)
    before_loss = trainer.evaluate()
    before = _answers(trainer.model, tok, held_out)
    result = trainer.run()
    after = _answers(trainer.model, tok, held_out)
    right = sum(a == example.answer(w) for a, w in zip(after, held_out))
    assert sum(a == example.answer(w) for a, w in zip(before, held_out)) == 0
    assert right >= 0.8 * len(held_out), list(zip(held_out, after))
    # the eval loss is over the held-out conversations' assistant tokens only
    assert result.eval_losses[max(result.eval_losses)] < 0.2 * before_loss


def test_format_sft_checks_the_datasets_tokenizer(tmp_path):
    from meshtrain.services.trainer.data import build_data

    example = _example()
    data = example.make_data(tmp_path / "data", conversations=200)
    job = _job(data, tmp_path / "run", "--data.tokenizer=byte")
    with pytest.raises(ConfigError, match="made with tokenizer"):
        build_data(job)
    job = _job(data, tmp_path / "run", "--train.eval_interval=0")
    built = build_data(job)
    batch = built.train.micro_batches(0)[0]
    assert batch.document_ids is not None and 0 < batch.loss_mask.mean() < 0.5
    assert ByteTokenizer().vocab_size != built.vocab_size


def test_format_sft_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.format='sft'.*data_path"):
        load_config(["--data.format=sft", f"--log.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="data.format="):
        load_config(["--data.format=chat", f"--log.run_dir={tmp_path}"])
    job = load_config(["--sft", '--data.data_path=["x"]', "--data.tokenizer=byte"])
    assert job.data.format == "sft"
