"""Packed documents on CUDA: FlexAttention's document-masked model equals the dense reference,
and a bf16 run with data.reset_attention_mask + data.reset_position_ids trains through the real
loop (eager and under train.compile, where the block mask is built inside the compiled graph).

The bodies take their device from `gpu_device` (tests/services/trainer/conftest.py): on CUDA
here; with MESHTRAIN_GPU_TESTS_ON_CPU=1 also on the CPU, where the reference runs, which is how
they are checked without a GPU. About 25 s together on one H100, most of it compiling.
"""

import pytest
import torch

from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.train import train
from tests.services.trainer.conftest import first_step_loss, losses_in_order, small_job_args
from tests.services.trainer.model import test_packed_documents as packed

pytestmark = pytest.mark.gpu

LLAMA_ARGS = {
    "model.normalization": "rmsnorm",
    "model.activation": "swiglu",
    "model.position_embedding_type": "rope",
    "model.add_bias_linear": False,
    "model.num_query_groups": 2,
}
PACKED = {"data.reset_attention_mask": True, "data.reset_position_ids": True}


@pytest.mark.parametrize("kw", [packed.GPT2, packed.LLAMA], ids=["gpt2", "llama-rope-gqa"])
def test_document_masked_logits_equal_the_dense_reference(kw, gpu_device):
    """fp32: the packed forward on the device (FlexAttention with a block mask on CUDA) equals
    each document run alone there (plain causal SDPA) and the CPU's dense-mask reference."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**kw))
    docs = packed._documents()
    tokens, _, ids, positions = packed._packed(docs)
    two = [torch.cat([t, t.flip(1)]) for t in (tokens, ids, positions)]  # (2, s): two layouts
    tokens, ids, positions = two
    ids[1] = ids[1].flip(0).max() - ids[1].flip(0)  # the flipped row's ids, non-decreasing again
    ids[1] = ids[1] - ids[1][0]
    positions[1] = _positions(ids[1])
    want = model(tokens, document_ids=ids, position_ids=positions)  # the CPU reference
    model.to(gpu_device)
    on = [t.to(gpu_device) for t in (tokens, ids, positions)]
    got = model(on[0], document_ids=on[1], position_ids=on[2])  # (2, s, vocab)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    for row in range(2):
        for d in ids[row].unique():
            cols = (ids[row] == d).nonzero().flatten()
            a, e = int(cols[0]), int(cols[-1]) + 1
            alone = model(on[0][row : row + 1, a:e])
            torch.testing.assert_close(got[row : row + 1, a:e], alone, rtol=1e-4, atol=1e-4)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document, for (seq,) non-decreasing ids."""
    starts = torch.cat([torch.tensor([True]), ids[1:] != ids[:-1]])
    index = torch.arange(len(ids))
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    return index - first


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "train.compile"])
def test_packed_bf16_training(compiled, gpu_device, corpus_cache, tmp_path):
    """A Llama-style model on packed documents in bf16: finite losses that fall, a first step
    that is the fp32 CPU run's within bf16 rounding, and (compiled) the eager run's curve."""
    if compiled and gpu_device == "cpu":
        pytest.skip("Inductor's CPU compile of the model takes minutes; CUDA is the case")
    common = {**LLAMA_ARGS, **PACKED, "train.train_iters": 12, "train.eval_interval": 12}
    cpu = first_step_loss(small_job_args(corpus_cache, tmp_path / "cpu", **common))
    runs = {}
    for name, compile_ in (("eager", False), ("compiled", True))[: 1 + compiled]:
        args = {"train.device": gpu_device, "train.bf16": True, "train.compile": compile_}
        runs[name] = train(
            load_config(small_job_args(corpus_cache, tmp_path / name, **common, **args))
        )
    run = runs["compiled" if compiled else "eager"]
    losses = losses_in_order(run)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert losses[0] == pytest.approx(cpu, rel=1e-2)
    assert torch.isfinite(torch.tensor(run.eval_losses[12]))
    if compiled:
        eager = losses_in_order(runs["eager"])
        assert losses == pytest.approx(eager, rel=3e-2), (losses, eager)
