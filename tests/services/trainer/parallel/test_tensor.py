"""Tensor-parallel layers against the unsharded model: outputs and every gradient, directly.

One forward/backward of a tp-sharded GPT (with and without sequence parallelism) on the same
tokens as the unsharded one; the sharded gradients, gathered over tp into global coordinates,
equal the unsharded gradients. fp64 so that only reduction order
differs (tolerance 1e-10). Also checks the parts of parallelize a user can get wrong.
"""

import pytest
import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor import parallelize
from meshtrain.services.trainer.parallel.tensor_layers import TPSplit, gather_tp
from tests.dist_utils import run_ranks

CFG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    seq_length=16,
    vocab_size=203,
    make_vocab_size_divisible_by=8,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
GPT2 = dict(
    CFG,
    num_query_groups=None,
    normalization="layernorm",
    activation="gelu",
    position_embedding_type="learned",
    add_bias_linear=True,
    untie_embeddings_and_output_weights=False,
)
# Qwen3-like: q/k/v bias split with the qkv rows, q/k norms replicated (their gradients are
# per-rank shares: summed over tp), a head width other than hidden/heads, Llama 3 RoPE scaling.
QWEN3 = dict(
    CFG,
    qkv_bias=True,
    qk_norm=True,
    kv_channels=24,
    rope_scaling_factor=4.0,
    rope_scaling_original_max_positions=8,
)


def _model(cfg) -> GPT:
    """fp64; biases and norm weights random too, so the split of each one is exercised."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**cfg)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                p.copy_(torch.randn_like(p) * 0.3 + (name.endswith(".weight")))
    return model


def _grads(rank, world, cfg, sequence_parallel, async_grad=False):
    model = _model(cfg)
    tokens = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(2))
    mesh = Mesh.build(tp=world)
    parallelize(model, mesh, sequence_parallel, async_grad_reduce=async_grad)
    loss = model(tokens, labels)
    loss.backward()
    logits = model(tokens)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if getattr(p, "sequence_parallel", False):  # what DataParallel does for SP params
            torch.distributed.all_reduce(g)
        full = gather_tp(g, p, mesh)
        grads[name] = (
            full[:203]
            if name in ("embedding.word_embeddings.weight", "output_layer.weight")
            else full
        )
    return loss.item(), logits.detach(), grads


@pytest.mark.dist
@pytest.mark.parametrize(
    "cfg,sp,async_grad",
    [
        (CFG, False, False),
        (CFG, True, False),
        (GPT2, True, False),
        # column-parallel input gradients reduced during the weight-gradient GEMM
        (CFG, False, True),
        (CFG, True, True),
        (GPT2, False, True),
        (GPT2, True, True),
        (QWEN3, False, False),
        (QWEN3, True, False),
        (dict(QWEN3, normalization="layernorm"), False, False),
    ],
    ids=[
        "llama",
        "llama-sp",
        "gpt2-sp",
        "llama-async-grad",
        "llama-sp-async-grad",
        "gpt2-async-grad",
        "gpt2-sp-async-grad",
        "qwen3",
        "qwen3-sp",
        "qk-layernorm",
    ],
)
def test_sharded_gradients_equal_unsharded(cfg, sp, async_grad):
    ref = _model(cfg)
    tokens = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(2))
    ref_loss = ref(tokens, labels)
    ref_loss.backward()
    ref_logits = ref(tokens).detach()
    for loss, logits, grads in run_ranks(_grads, 2, cfg, sp, async_grad):
        assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
        for name, p in ref.named_parameters():
            g = (
                p.grad[:203]
                if name in ("embedding.word_embeddings.weight", "output_layer.weight")
                else p.grad
            )
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-10, msg=name)


def test_tpsplit_shard_and_unshard_round_trip():
    full = torch.arange(8 * 6).view(8, 6)
    halves = TPSplit(0, halves=True)
    parts = [halves.shard(full, r, 2) for r in range(2)]
    assert parts[0].tolist() == full[[0, 1, 4, 5]].tolist()  # [gate_0; up_0]
    assert torch.equal(halves.unshard(parts), full)
    cols = TPSplit(1)
    assert torch.equal(cols.unshard([cols.shard(full, r, 3) for r in range(3)]), full)


def test_parallelize_rejects_what_it_cannot_shard():
    mesh = Mesh(tp=4, rank=0, ranks={"tp": [0, 1, 2, 3]})
    with pytest.raises(ConfigError, match="query groups"):
        parallelize(GPT(ModelConfig(**CFG)), mesh)  # 2 KV groups over tp=4
    with pytest.raises(ConfigError, match="dropout"):
        parallelize(
            GPT(ModelConfig(**dict(GPT2, attention_dropout=0.1))),
            Mesh(tp=2, rank=0, ranks={"tp": [0, 1]}),
        )


def test_an_expert_degree_that_does_not_fit_the_world_is_refused():
    """Expert parallelism is built (parallel/expert.py, tested in test_expert.py); one process
    has no dp x cp ranks to split the experts over."""
    from meshtrain.services.trainer.parallel.mesh import initialize_model_parallel

    with pytest.raises(ConfigError, match=r"parallel.ep=2 must divide dp\*cp = 1"):
        initialize_model_parallel(expert_model_parallel_size=2)


def test_a_context_parallel_mesh_needs_a_context_parallel_model():
    """cp is built, but by parallelize_context: a plain model on a cp mesh would attend only
    within each rank's own tokens, so tensor.parallelize refuses it."""
    with pytest.raises(ConfigError, match="cp=2: make the model context parallel first"):
        parallelize(GPT(ModelConfig(**CFG)), Mesh(cp=2, rank=0))


def test_tp_comm_overlap_is_refused_where_it_cannot_run():
    mesh = Mesh(tp=2, rank=0, ranks={"tp": [0, 1]})
    with pytest.raises(ConfigError, match="needs parallel.sequence_parallel"):
        parallelize(GPT(ModelConfig(**GPT2)), mesh, sequence_parallel=False, comm_overlap=True)
    with pytest.raises(ConfigError, match="tp_comm_overlap: it needs CUDA devices"):
        parallelize(
            GPT(ModelConfig(**GPT2)),
            mesh,
            sequence_parallel=True,
            comm_overlap=True,
            device=torch.device("cpu"),
        )
    with pytest.raises(ConfigError, match="tp_comm_overlap needs parallel.sequence_parallel"):
        load_config(["--tensor-model-parallel-size", "2", "--tp-comm-overlap"])


def test_tp_async_grad_reduce_is_on_by_default_and_comm_overlap_takes_precedence():
    assert load_config([]).parallel.tp_async_grad_reduce  # nothing to overlap at tp=1: not an error
    assert not load_config(["--parallel.tp_async_grad_reduce=false"]).parallel.tp_async_grad_reduce
    # tp_comm_overlap fuses these collectives itself; the default must not make it an error.
    job = load_config(
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"]
    )
    assert job.parallel.tp_comm_overlap and job.parallel.tp_async_grad_reduce


def _ignore_index_grads(rank, world):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG)).double()
    parallelize(model, Mesh.build(tp=world), True)
    tokens, labels = _ignored_batch()
    loss = model(tokens, labels)
    loss.backward()
    qkv = gather_tp(
        model.layers[0].attention.qkv.weight.grad,
        model.layers[0].attention.qkv.weight,
        Mesh.build(tp=world),
    )
    bad = labels.clone()
    bad[0, 0] = 205  # in the padded rows (vocab 203 padded to 208 here): an error, not an inf
    try:
        model(tokens, bad)
        error = None
    except RuntimeError as e:
        error = str(e)
    return loss.item(), qkv, error


def _ignored_batch():
    tokens = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(2))
    labels[:, ::3] = -100  # e.g. prompt tokens of a fine-tuning batch, no loss mask given
    return tokens, labels


@pytest.mark.dist
def test_label_minus_100_counts_nothing_and_labels_outside_the_vocabulary_are_errors():
    torch.manual_seed(0)
    ref = GPT(ModelConfig(**CFG)).double()
    tokens, labels = _ignored_batch()
    ref_loss = ref(tokens, labels)
    ref_loss.backward()
    for loss, qkv, error in run_ranks(_ignore_index_grads, 2):
        assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
        torch.testing.assert_close(
            qkv, ref.layers[0].attention.qkv.weight.grad, rtol=1e-10, atol=1e-10
        )
        assert error is not None and "outside the vocabulary" in error


def _autocast_run(rank, world, sequence_parallel, async_grad=False, fp32_residual=True):
    """A tp-sharded step under bf16 autocast; records the dtype every collective moved."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG, fp32_residual_connection=fp32_residual))
    tokens = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(2))
    mesh = Mesh.build(tp=world)
    parallelize(model, mesh, sequence_parallel, async_grad_reduce=async_grad)
    from torch.distributed import _functional_collectives as funcol

    moved = []
    originals = {
        (mod, name): getattr(mod, name)
        for mod, name in (
            (dist, "all_gather_single"),
            (dist, "all_reduce"),
            (funcol, "all_reduce"),
        )
    }

    def recording(mod, name):
        def call(*args, **kwargs):
            t = args[1] if name == "all_gather_single" else args[0]
            moved.append((name, t.dtype, tuple(t.shape)))
            return originals[mod, name](*args, **kwargs)

        return call

    for mod, name in originals:
        setattr(mod, name, recording(mod, name))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, labels)
        loss.backward()
    finally:
        for (mod, name), fn in originals.items():
            setattr(mod, name, fn)
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, name  # fp32 weights get fp32 gradients
        g = p.grad
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(g)
        full = gather_tp(g, p, mesh)
        grads[name] = (
            full[:203]
            if name in ("embedding.word_embeddings.weight", "output_layer.weight")
            else full
        )
    return loss.item(), grads, moved


@pytest.mark.dist
@pytest.mark.parametrize(
    "sp,async_grad,fp32_residual",
    [
        (False, False, True),
        (True, False, True),
        (False, True, True),
        (True, True, True),
        (False, False, False),
        (True, True, False),
    ],
    ids=[
        "tp",
        "tp-sp",
        "tp-async-grad",
        "tp-sp-async-grad",
        "tp-bf16-residual",
        "tp-sp-async-grad-bf16-residual",
    ],
)
def test_activation_collectives_move_bf16_under_autocast(sp, async_grad, fp32_residual):
    """Under autocast the linears' inputs are gathered (and their gradients reduced) in bf16, not
    as the fp32 residual stream: half the bytes (an H200 profile of tp=2 showed fp32 all-gathers
    and fp32 reduce-scatters taking a third of the step). The loss still matches one process.
    With model.fp32_residual_connection off, the stream's own collectives move bf16 too."""
    torch.manual_seed(0)
    ref = GPT(ModelConfig(**CFG, fp32_residual_connection=fp32_residual))
    tokens = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = ref(tokens, labels)
    ref_loss.backward()
    for loss, grads, moved in run_ranks(_autocast_run, 2, sp, async_grad, fp32_residual):
        assert loss == pytest.approx(ref_loss.item(), rel=2e-2)
        for name, p in ref.named_parameters():  # bf16 matmuls and bf16 sums over tp: bf16 tolerance
            g = (
                p.grad[:203]
                if name in ("embedding.word_embeddings.weight", "output_layer.weight")
                else p.grad
            )
            torch.testing.assert_close(grads[name], g, rtol=5e-2, atol=2e-3, msg=name)
        hidden = [(n, d) for n, d, shape in moved if shape[-1] == 64 and len(shape) == 3]
        # The embedding's own all-reduce (its lookups, before the stream's cast) and, with sp and
        # an fp32 stream, its scatter's all-gather in backward carry fp32; every other one is a
        # linear's input, output or gradient, or the bf16 stream's.
        assert hidden[0][1] == torch.float32, moved
        activation = hidden[1:-1] if sp and fp32_residual else hidden[1:]
        assert activation and all(d == torch.bfloat16 for _, d in activation), moved


def _stream_dtype(model, tokens):
    """The residual stream's dtype where it reaches the final norm, in one bf16-autocast forward."""
    seen = []
    hook = model.final_norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(tokens, tokens)
    finally:
        hook.remove()
    return seen


def _sharded_stream_dtype(rank, world, sequence_parallel):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**GPT2, fp32_residual_connection=False))
    parallelize(model, Mesh.build(tp=world), sequence_parallel)
    return _stream_dtype(
        model, torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))
    )


@pytest.mark.dist
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_row_parallel_bias_keeps_the_bf16_stream(sp):
    """The row-parallel bias (fp32, added once after the sum over tp) is added in the output's
    dtype: with model.fp32_residual_connection off the stream stays bf16 under tp, as it does in
    one process, where autocast adds the bias inside the linear. Added as fp32, it promoted
    the stream to fp32 from the first block on (twice the activation memory and traffic)."""
    torch.manual_seed(0)
    ref = GPT(ModelConfig(**GPT2, fp32_residual_connection=False))
    expected = _stream_dtype(
        ref, torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(1))
    )
    assert expected == [torch.bfloat16]
    for got in run_ranks(_sharded_stream_dtype, 2, sp):
        assert got == expected
