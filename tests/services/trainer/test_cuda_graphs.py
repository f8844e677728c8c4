"""The captured micro-batch (services/trainer/cuda_graphs.py): refusals here, on CPU; on CUDA, that
replays accumulate the same gradients as eager micro-batches and that training with the graph
follows training without it step for step."""

import pytest
import torch
from torch import nn

from meshtrain.services.common.errors import ConfigError, MeshtrainError
from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.cuda_graphs import MicroBatchGraph
from tests.services.trainer.conftest import small_job_args

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LLAMA = [
    "--model.normalization=rmsnorm",
    "--model.activation=swiglu",
    "--model.position_embedding_type=rope",
    "--model.num_query_groups=2",
    "--model.add_bias_linear=false",
]


def test_config_refuses_a_graph_on_the_cpu(corpus_cache, tmp_path):
    args = small_job_args(corpus_cache, tmp_path / "run", **{"train.cuda_graph": True})
    with pytest.raises(
        ConfigError, match="train.cuda_graph .* needs a CUDA device, but train.device='cpu'"
    ):
        load_config(args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is present")
def test_trainer_refuses_a_graph_without_a_gpu(corpus_cache, tmp_path):
    from meshtrain.services.trainer.train import Trainer

    args = small_job_args(
        corpus_cache, tmp_path / "run", **{"train.cuda_graph": True, "train.device": "auto"}
    )
    with pytest.raises(
        ConfigError, match="train.cuda_graph needs a CUDA device; this run is on cpu"
    ):
        Trainer(load_config(args))


def test_graph_refuses_a_cpu_device():
    with pytest.raises(MeshtrainError, match="needs a CUDA device, got cpu"):
        MicroBatchGraph(lambda x: x, [], torch.device("cpu"))


def _tiny(device, dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(dropout), nn.Linear(64, 8)).to(
        device
    )


def _run(model):
    def run(x, y):
        loss = nn.functional.cross_entropy(model(x), y) / 2
        loss.backward()
        return loss.detach()

    return run


@pytest.mark.gpu
@cuda
def test_replays_accumulate_the_eager_gradients():
    device = torch.device("cuda", torch.cuda.current_device())
    eager, graphed = _tiny(device), _tiny(device)
    batches = [
        (torch.randn(16, 32, device=device), torch.randint(0, 8, (16,), device=device))
        for _ in range(4)
    ]
    graph = MicroBatchGraph(_run(graphed), list(graphed.parameters()), device)
    graph.capture(*batches[0])
    assert all(
        float(p.grad.abs().max()) == 0 for p in graphed.parameters()
    )  # the warm-up left nothing behind
    for step in range(2):  # two steps of two micro-batches, gradients zeroed in place between them
        mine, theirs = [], []
        for x, y in batches[2 * step : 2 * step + 2]:
            theirs.append(_run(eager)(x, y))
            mine.append(graph.replay(x, y).clone())
        torch.testing.assert_close(torch.stack(mine), torch.stack(theirs))
        for p, q in zip(graphed.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for p, q in zip(graphed.parameters(), eager.parameters()):
            p.grad.zero_()
            q.grad = None


@pytest.mark.gpu
@cuda
def test_replay_refuses_other_shapes_and_replaced_gradients():
    device = torch.device("cuda", torch.cuda.current_device())
    model = _tiny(device)
    graph = MicroBatchGraph(_run(model), list(model.parameters()), device)
    x, y = torch.randn(16, 32, device=device), torch.randint(0, 8, (16,), device=device)
    with pytest.raises(MeshtrainError, match="replay before capture"):
        graph.replay(x, y)
    graph.capture(x, y)
    with pytest.raises(MeshtrainError, match=r"input 0 is \(8, 32\).*captured for \(16, 32\)"):
        graph.replay(x[:8], y[:8])
    model[0].weight.grad = None
    with pytest.raises(MeshtrainError, match=r"shape \(64, 32\) had its .grad dropped"):
        graph.replay(x, y)


@pytest.mark.gpu
@cuda
def test_each_replay_draws_new_dropout_masks():
    """A graph that froze the RNG would drop the same units in every micro-batch."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = _tiny(device, dropout=0.5)
    graph = MicroBatchGraph(_run(model), list(model.parameters()), device)
    x, y = torch.randn(16, 32, device=device), torch.randint(0, 8, (16,), device=device)
    graph.capture(x, y)
    losses = {float(graph.replay(x, y)) for _ in range(4)}
    assert len(losses) == 4


def _steps(args, n):
    from meshtrain.services.trainer.train import Trainer

    trainer = Trainer(load_config(args))
    try:
        out = [tuple(float(v) for v in trainer.train_step(step)) for step in range(n)]
        return out, {k: v.detach().float().cpu() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.checkpointer.close()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "extra,rel",
    [
        (
            ["--train.bf16=true", "--train.compile=true"],
            1e-3,
        ),  # GPT-2 style, Inductor's fusions, weight copies
        (
            ["--train.bf16=true", "--train.compile=true"] + LLAMA,
            1e-3,
        ),  # RoPE and SwiGLU on Triton inside the graph
        (
            [
                "--train.bf16=true",
                "--train.compile=true",
                "--parallel.recompute_granularity=selective",
            ],
            1e-3,
        ),
        (
            ["--train.bf16=true", "--train.compile=true", "--parallel.recompute_granularity=full"],
            1e-3,
        ),
        (
            ["--train.bf16=true", "--train.compile=true", "--train.bf16_weight_copies=false"],
            1e-3,
        ),  # autocast casts
        # the default on CUDA: wgrad GEMMs adding into the .grads the graph was captured with;
        # and without
        (
            ["--train.bf16=true", "--train.compile=true", "--no-gradient-accumulation-fusion"]
            + LLAMA,
            1e-3,
        ),
        ([], 1e-5),  # eager fp32: the Triton kernels launched from Python, captured
    ],
    ids=[
        "gpt2-compiled-bf16",
        "llama-compiled-bf16",
        "selective-recompute",
        "full-recompute",
        "autocast",
        "copies-hooks",
        "eager-fp32-triton",
    ],
)
def test_training_with_the_graph_follows_training_without(extra, rel, corpus_cache, tmp_path):
    args = (
        small_job_args(
            corpus_cache, tmp_path / "run", **{"train.device": "cuda", "train.eval_interval": 0}
        )
        + extra
    )
    torch._dynamo.reset()
    plain, plain_state = _steps(args, 8)
    torch._dynamo.reset()
    graphed, graphed_state = _steps(args + ["--train.cuda_graph=true"], 8)
    assert graphed[-1][0] < graphed[0][0] - 0.5
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(graphed, plain)):
        assert loss == pytest.approx(want_loss, rel=rel), step
        assert norm == pytest.approx(want_norm, rel=10 * rel), step
    for name, value in plain_state.items():
        torch.testing.assert_close(
            graphed_state[name], value, rtol=10 * rel, atol=10 * rel, msg=name
        )


@pytest.mark.gpu
@cuda
def test_a_run_with_the_graph_resumes_where_it_stopped(corpus_cache, tmp_path):
    """The whole loop with the graph: evaluation and checkpoints between replays, dropout on
    (the RNG state a checkpoint restores must give the masks the uninterrupted run drew), and
    a resume that captures afresh continues the uninterrupted run. fp32, compiled; 1e-5
    relative, not exact: SDPA's backward on the GPU may add in another order run to run."""
    from meshtrain.services.trainer.train import train

    common = {
        "train.device": "cuda",
        "train.compile": True,
        "train.cuda_graph": True,
        "train.train_iters": 10,
        "train.eval_interval": 4,
        "model.hidden_dropout": 0.2,
    }
    full = train(
        load_config(
            small_job_args(
                corpus_cache, tmp_path / "full", **common, **{"checkpoint.save_interval": 5}
            )
        )
    )
    torch._dynamo.reset()
    resumed = train(
        load_config(
            small_job_args(
                corpus_cache,
                tmp_path / "resumed",
                **common,
                **{
                    "checkpoint.load": str(tmp_path / "full" / "checkpoints"),
                    "checkpoint.load_step": 5,
                    "checkpoint.save": str(tmp_path / "ck2"),
                },
            )
        )
    )
    assert sorted(resumed.losses) == list(range(6, 11))
    for step in range(6, 11):
        assert resumed.losses[step] == pytest.approx(full.losses[step], rel=1e-5), step
    assert resumed.eval_losses[8] == pytest.approx(full.eval_losses[8], rel=1e-5)
    assert full.losses[10] < full.losses[1] - 0.5


MOE = [
    "--model.num_experts=4",
    "--model.moe_router_topk=2",
    "--model.moe_ffn_hidden_size=64",
    "--model.moe_aux_loss_coeff=0.01",
    "--model.moe_z_loss_coeff=0.001",
]


def _moe_steps(args, n):
    """(loss, grad norm) per step and the routed counts of each step (what `train_step` put
    aside at its end), summed over the layers."""
    from meshtrain.services.trainer.train import Trainer

    trainer = Trainer(load_config(args))
    try:
        out, routed = [], []
        for step in range(n):
            out.append(tuple(float(v) for v in trainer.train_step(step)))
            routed.append(sum(st.routed_per_expert.cpu() for _, st, _ in trainer.router_stats.last))
        return out, routed
    finally:
        trainer.checkpointer.close()


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="the grouped expert GEMM (what the graph captures) needs compute capability 9.0",
)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_mixture_of_experts_trains_alike_with_the_graph(compiled, corpus_cache, tmp_path):
    """Dropless routing with the grouped GEMMs keeps the per-expert counts on the GPU, so the
    block is captured: the same losses as without the graph, and the same routing statistics
    (the capture's warm-up forwards not counted, the statistics' tensors reused every step)."""
    args = (
        small_job_args(
            corpus_cache, tmp_path / "run", **{"train.device": "cuda", "train.eval_interval": 0}
        )
        + ["--train.bf16=true", f"--train.compile={str(compiled).lower()}"]
        + LLAMA
        + MOE
    )
    torch._dynamo.reset()
    plain, plain_routed = _moe_steps(args, 6)
    torch._dynamo.reset()
    graphed, graphed_routed = _moe_steps(args + ["--train.cuda_graph=true"], 6)
    assert graphed[-1][0] < graphed[0][0] - 0.5
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(graphed, plain)):
        assert loss == pytest.approx(want_loss, rel=1e-3), step
        assert norm == pytest.approx(want_norm, rel=1e-2), step
    for step, (got, want) in enumerate(zip(graphed_routed, plain_routed)):
        assert int(got.sum()) == int(want.sum()), step  # every choice once, no warm-up extra
    # early steps route alike; later ones may part by a tie broken differently in bf16
    assert torch.equal(graphed_routed[0], plain_routed[0])
