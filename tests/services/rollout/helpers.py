"""A tiny policy, a checkpoint of it, and rollout servers in this process or in a child one."""

from __future__ import annotations

import torch

from meshtrain.services.common.model_config import ModelConfig

VOCAB = 61
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16], [17, 18, 19, 20]]


def tiny_config(position: str = "rope") -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=48,
        vocab_size=VOCAB,
        position_embedding_type=position,
    )


def tiny_model(seed: int = 0, position: str = "rope"):
    from meshtrain.services.trainer.model import GPT

    torch.manual_seed(seed)
    return GPT(tiny_config(position))


def save_policy(root: str, step: int, seed: int) -> None:
    """Commit checkpoint `step` of the tiny model of `seed` under `root`, as training does."""
    from meshtrain.services.trainer.checkpointing import save_checkpoint

    save_checkpoint(root, step, tiny_model(seed), None)


def serve_child(root: str, port: int) -> None:
    """A rollout worker process on 127.0.0.1:port serving `root`'s newest step until killed."""
    import threading

    from meshtrain.services.rollout.engine import engine_from_checkpoint
    from meshtrain.services.rollout.rpc.server import start_server

    torch.set_num_threads(1)
    engine = engine_from_checkpoint(root, device="cpu", eod_id=0)
    server, _, _ = start_server(engine, port=port, checkpoint_root=root)
    threading.Event().wait()
    server.stop(0)


def assert_same(got, want, atol: float = 1e-5) -> None:
    """Same completions: prompts, tokens, versions and ends exactly; log-probs within `atol`
    (fp32 on CPU: a batch of other rows changes only the order of summation)."""
    assert [(c.prompt_index, c.tokens, c.policy_version, c.finished) for c in got] == [
        (c.prompt_index, c.tokens, c.policy_version, c.finished) for c in want
    ]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=atol)
