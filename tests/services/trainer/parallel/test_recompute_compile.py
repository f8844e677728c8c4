"""Full recompute under train.compile keeps what it keeps in eager: each block's input.

Compiled whole, the model's checkpoints become regions of one graph whose backward the
partitioner and Inductor schedule as they see fit; at long sequence that held far more than the
blocks' inputs (BENCHMARKS.md, 'Long sequences'). `build.compile_model` therefore compiles each
block in place under full recompute, the checkpoint outside. Memory is measured on CPU with
`benchmarks/recompute_compile_memory.py`: the bytes autograd saves, and the allocator's peak over a
step.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.recompute_compile_memory import peak_allocated_bytes, saved_bytes
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.build import compile_model
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.config.sections import TrainConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel import recompute
from tests.services.trainer.conftest import small_job_args

SEQ = 1024  # long enough that activations, not weights, fill the step
CFG = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    seq_length=SEQ,
    vocab_size=128,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
FULL = {"recompute_granularity": "full"}


def _model(plan: dict) -> GPT:
    torch.manual_seed(0)
    return recompute.apply(GPT(ModelConfig(**CFG)), ParallelConfig(**plan))


def test_the_saved_tensor_hook_sees_what_a_compiled_graph_saves():
    """AOTAutograd's compiled function saves through ctx.save_for_backward, which an outer
    saved-tensors hook intercepts: x, w and x @ w, as eager saves them."""
    x, w = (torch.randn(256, 256, requires_grad=True) for _ in range(2))

    def f(x, w):
        return (x @ w).sin().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    compiled(x, w)
    matrix = 256 * 256 * 4
    assert saved_bytes(lambda: f(x, w)) == saved_bytes(lambda: compiled(x, w)) == 3 * matrix


def test_the_peak_counts_what_is_alive_at_once():
    """Two of the three 1 MiB results are alive at once; a few bytes of bookkeeping besides."""
    x = torch.randn(512, 512)

    def f():
        y = x @ x
        z = y.relu()  # y and z alive
        del y
        return z + 1  # z and the sum

    matrix = x.numel() * 4
    assert 2 * matrix <= peak_allocated_bytes(f) < 2 * matrix + 4096


@pytest.mark.parametrize(
    "plan, per_block",
    [({}, False), ({"recompute_granularity": "selective"}, False), (FULL, True)],
    ids=["none", "selective", "full"],
)
def test_full_recompute_compiles_each_block_behind_its_checkpoint(plan, per_block):
    model = _model(plan)
    parallel = ParallelConfig(**plan)
    out = compile_model(model, TrainConfig(compile=True), None, parallel, pipelined=False)
    assert (out is model) == per_block
    if per_block:  # the blocks and the loss head compiled in place; the checkpoint stays eager
        assert all(layer._compiled_call_impl is not None for layer in model.layers)
        assert hasattr(model.head.loss, "_torchdynamo_orig_callable")
    else:
        assert isinstance(out, torch._dynamo.eval_frame.OptimizedModule)
        assert all(layer._compiled_call_impl is None for layer in model.layers)


@pytest.mark.slow  # Inductor on CPU: about a minute
def test_compiled_full_recompute_holds_no_more_than_eager():
    """Inductor (what train.compile runs), fp32: the compiled run's saved bytes and step peak
    within 10% of eager full recompute's, and the same loss
    and gradients to Inductor's reordering of fp32 sums."""
    tokens = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    results = {}
    for name, plan, compiled in [
        ("eager none", {}, False),
        ("eager full", FULL, False),
        ("compiled full", FULL, True),
    ]:
        torch._dynamo.reset()
        model = _model(plan)
        run = (
            compile_model(model, TrainConfig(compile=True), None, ParallelConfig(**plan), False)
            if compiled
            else model
        )
        params = list(model.parameters()) + list(model.buffers())

        def step():
            loss = run(tokens, tokens.roll(-1, 1))
            loss.backward()
            return loss.detach()

        step()  # compile
        kept = saved_bytes(lambda: run(tokens, tokens.roll(-1, 1)), exclude=params)
        model.zero_grad(set_to_none=True)  # before the profiler, which misses older blocks' frees
        losses = []
        peak = peak_allocated_bytes(lambda: losses.append(step()))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[name] = (kept, peak, losses[0], grads)
    (kept_none, peak_none, *_), (kept, peak, loss, grads) = (
        results["eager none"],
        results["eager full"],
    )
    assert kept_none > 5 * kept and peak_none > 2 * peak  # the measurement sees the recompute
    c_kept, c_peak, c_loss, c_grads = results["compiled full"]
    assert c_kept <= 1.1 * kept, (c_kept, kept)
    assert c_peak <= 1.1 * peak, (c_peak, peak)
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(c_grads[n], g, rtol=1e-4, atol=1e-5, msg=n)


LLAMA = {
    "model.normalization": "rmsnorm",
    "model.activation": "swiglu",
    "model.position_embedding_type": "rope",
    "model.num_query_groups": 2,
    "model.add_bias_linear": False,
    "model.untie_embeddings_and_output_weights": True,
}


@pytest.mark.slow  # Inductor on CPU, through the Trainer
@pytest.mark.parametrize(
    "extra", [{}, {"train.fp8": "hybrid", "train.fp8_recipe": "delayed"}], ids=["bf16", "fp8"]
)
def test_compiled_full_recompute_trains_as_eager_on_the_weight_copies(
    extra, corpus_cache, tmp_path
):
    """bf16 with the weight copies (on by default in one process), and FP8 cast from them: the
    blocks compiled on the copies, which stay swapped in over the backward so each recomputed
    block reruns the forward's graph (on the fp32 parameters it would trace another, and the
    checkpoint would refuse its saved tensors). Three steps of two micro-batches follow eager
    to bf16 rounding (measured: within 1.2e-4 relative)."""
    from meshtrain.services.trainer.train import Trainer

    losses = {}
    for compiled in (False, True):
        args = small_job_args(
            corpus_cache,
            tmp_path / str(compiled),
            **LLAMA,
            **{
                "train.bf16": True,
                "train.compile": compiled,
                "parallel.recompute_granularity": "full",
                "train.eval_interval": 0,
                "train.train_iters": 3,
                **extra,
            },
        )
        torch._dynamo.reset()
        trainer = Trainer(load_config(args))
        try:
            assert trainer.weight_copies is not None
            losses[compiled] = [trainer.train_step(step)[0].item() for step in range(3)]
        finally:
            trainer.checkpointer.close()
    torch.testing.assert_close(losses[True], losses[False], rtol=2e-3, atol=0)
