"""Pipeline pieces on one process: the block split, the stage's chunks,
deferred weight gradients."""

import pytest
import torch
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.parallel.pipeline.engine import _defer_weight_grads
from meshtrain.services.trainer.parallel.pipeline.stage import PipelineStage, stage_layers
from meshtrain.services.trainer.parallel.pipeline.zero_bubble import (
    DeferrableLinear,
    WeightGradStore,
)

CONFIG = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=50,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def test_stage_layers_even_uneven_and_explicit():
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(7, 3, first=1) == [range(0, 1), range(1, 4), range(4, 7)]
    assert stage_layers(7, 3, first=3, last=2) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(5, 2, explicit=[0, 5]) == [range(0, 0), range(0, 5)]
    with pytest.raises(ConfigError, match="does not split evenly over 3 pipeline stages"):
        stage_layers(7, 3)
    with pytest.raises(ConfigError, match="adding up to model.num_layers=5"):
        stage_layers(5, 2, explicit=[2, 2])


def test_pipeline_settings_are_checked():
    with pytest.raises(ConfigError, match="applies to pipeline parallelism; parallel.pp is 1"):
        ParallelConfig(virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="not both"):
        ParallelConfig(
            pp=2, virtual_pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1
        )
    assert ParallelConfig(pp=2, num_layers_per_virtual_pipeline_stage=2).pipeline_chunks(8) == 2
    assert (
        ParallelConfig(pp=2, virtual_pipeline_model_parallel_size=2).resolved_pipeline_schedule(8)
        == "interleaved"
    )
    assert ParallelConfig(pp=2).resolved_pipeline_schedule(8) == "1f1b"
    job = load_config(
        [
            "--pipeline-model-parallel-size=2",
            "--num-layers-per-virtual-pipeline-stage=1",
            "--decoder-first-pipeline-num-layers=1",
            "--model.num_layers=3",
        ]
    )
    assert (
        job.parallel.pp,
        job.parallel.num_layers_per_virtual_pipeline_stage,
        job.parallel.decoder_first_pipeline_num_layers,
    ) == (2, 1, 1)


@pytest.mark.parametrize("untie", [False, True])
def test_chunks_chained_compute_the_whole_model(untie):
    """Every rank's chunks, run in virtual-stage order, give the full model's loss and gradients;
    parameter names keep their global layer numbers."""
    config = ModelConfig(**{**CONFIG.__dict__, "untie_embeddings_and_output_weights": untie})
    torch.manual_seed(0)
    full = GPT(config)
    tokens, labels = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    full(tokens, labels).backward()
    pp, v = 2, 2
    stages = stage_layers(4, pp, v)
    ranks = []
    for r in range(pp):
        torch.manual_seed(0)
        ranks.append(PipelineStage(GPT(config), r, pp, stages, ParallelConfig(pp=pp)))
    assert sorted(ranks[1].layers) == ["1", "3"]
    assert "layers.3.attention.qkv.weight" in dict(ranks[1].named_parameters())
    ins, outs, x = [], [], tokens
    for s in range(
        pp * v
    ):  # forward through the virtual stages, as the runtime's transfers chain them
        ins.append(x)
        y = ranks[s % pp].forward_chunk(s // pp, x, labels if s == pp * v - 1 else None)
        outs.append(y)
        x = y.detach().requires_grad_()
    torch.testing.assert_close(outs[-1], full(tokens, labels), rtol=1e-6, atol=1e-6)
    outs[-1].backward()
    for s in range(pp * v - 2, -1, -1):
        outs[s].backward(ins[s + 1].grad)
    grads = {n: p.grad for n, p in full.named_parameters()}
    summed = {}
    for stage in ranks:
        for name, p in stage.named_parameters():
            summed[name] = summed.get(name, 0) + p.grad  # a tied embedding: both uses
    assert set(summed) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(summed[name], g, rtol=1e-5, atol=1e-7, msg=name)
    if untie:
        assert ranks[1].embedding is None
    else:
        assert ranks[1].embedding.word_embeddings.weight.pipeline_copy


def test_zero_bubble_defers_linear_weight_gradients_until_run():
    """I computes input gradients and the small parameters' now, the linears' weight gradients
    only when W runs them; the sum equals a plain backward."""
    torch.manual_seed(0)
    plain = GPT(CONFIG)
    torch.manual_seed(0)
    split = GPT(CONFIG)
    store = WeightGradStore()
    stage = PipelineStage(split, 0, 1, stage_layers(4, 1), ParallelConfig())
    _defer_weight_grads(stage, store)
    assert isinstance(stage.layers["0"].attention.qkv, DeferrableLinear)
    tokens, labels = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
    plain(tokens, labels).backward()
    store.begin((0, 0))
    stage.forward_chunk(0, tokens, labels).backward()
    store.end()
    qkv = stage.layers["0"].attention.qkv.weight
    assert qkv.grad is None and stage.layers["0"].input_norm.weight.grad is not None
    ready = []
    store.on_ready = ready.append
    store.run((0, 0), final=True)
    assert any(p is qkv for p in ready) and len(ready) == 4 * 4  # four linears per block
    grads = dict(plain.named_parameters())
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_zero_bubble_under_autocast_adds_into_fp32_gradients():
    lin = nn.Linear(8, 4)
    store = WeightGradStore()
    layer = DeferrableLinear(lin, store)
    x = torch.randn(3, 8, requires_grad=True)
    store.begin((0, 0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    store.end()
    assert lin.weight.grad is None and x.grad is not None
    store.run((0, 0), final=False)
    assert lin.weight.grad.dtype == torch.float32
    expected = torch.ones(3, 4).t() @ x.detach()
    torch.testing.assert_close(lin.weight.grad, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_zero_bubble_deferral_on_cuda_bf16_equals_plain_backward():
    """On CUDA, autograd runs backward on its device thread; under bf16 autocast the deferred
    dW (W action) adds into the fp32 gradients what a plain backward would."""
    torch.manual_seed(0)
    plain = GPT(CONFIG).cuda()
    torch.manual_seed(0)
    store = WeightGradStore()
    stage = PipelineStage(GPT(CONFIG).cuda(), 0, 1, stage_layers(4, 1), ParallelConfig())
    _defer_weight_grads(stage, store)
    tokens, labels = (
        torch.randint(0, 50, (2, 16), device="cuda"),
        torch.randint(0, 50, (2, 16), device="cuda"),
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain_loss = plain(tokens, labels)
    plain_loss.backward()
    store.begin((0, 0))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = stage.forward_chunk(0, tokens, labels)
    loss.backward()
    store.end()
    assert stage.layers["0"].mlp.fc1.weight.grad is None
    store.run((0, 0), final=True)
    grads = dict(plain.named_parameters())
    for name, p in stage.named_parameters():
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=2e-2, atol=1e-4, msg=name)


def test_a_middle_rank_without_blocks_is_refused_on_every_rank():
    """An explicit layout may leave a stage empty, but a middle rank with no block would hold no
    parameter at all: every rank refuses it the same way (none waits for it in a collective)."""
    from meshtrain.services.trainer.parallel.mesh import Mesh
    from meshtrain.services.trainer.parallel.pipeline.engine import build_pipeline

    job = load_config(
        [
            "--pipeline-model-parallel-size=3",
            "--model.num_layers=4",
            "--model.vocab_size=50",
            "--parallel.pipeline_layout=[2, 0, 2]",
            "--train.micro_batch_size=1",
            "--train.global_batch_size=3",
        ]
    )
    for rank in range(3):
        mesh = Mesh(pp=3, rank=rank, ranks={"pp": [0, 1, 2]})
        with pytest.raises(ConfigError, match="leaves pipeline rank 1 without blocks"):
            build_pipeline(GPT(job.model), mesh, job, torch.device("cpu"))
