"""FP8 on CUDA: cuBLAS's FP8 GEMMs against the same FP8 values multiplied in fp32, each layer
type of llama-1b against bf16 within stated bounds, and compiled FP8 training against bf16.

Skipped without a GPU that has FP8 tensor cores (compute capability 8.9 or newer).
"""

import pytest
import torch
import torch.nn.functional as F

from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.fp8 import Fp8Gemm, Recipe
from meshtrain.services.trainer.fp8.scaling import FORMATS, amax, amax_to_scale, cast_to_fp8
from meshtrain.services.trainer.train import Trainer, train
from tests.services.trainer.conftest import small_job_args

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU with FP8 (sm_89+)"),
]

# llama-1b's four block linears: (name, in, out); 4096 tokens (micro-batch 2 x 2048)
LAYERS = [("qkv", 2048, 4096), ("proj", 2048, 2048), ("fc1", 2048, 11264), ("fc2", 5632, 2048)]
TOKENS = 4096


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _operands(k: int, n: int):
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    x = torch.randn(TOKENS, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).requires_grad_()
    dy = (
        torch.randn(TOKENS, n, device="cuda", generator=g, dtype=torch.bfloat16) * 1e-3
    )  # gradient-sized
    return x.requires_grad_(), w, dy


def _dequantized(t: torch.Tensor, dtype, dim=None) -> torch.Tensor:
    """t cast to FP8 as the layer casts it, back in fp32 (the exact values its GEMM sees)."""
    s = amax_to_scale(amax(t, dim), torch.finfo(dtype).max)
    return cast_to_fp8(t, s, dtype).float() / s


@pytest.mark.parametrize("name,k,n", LAYERS, ids=[x[0] for x in LAYERS])
def test_tensorwise_gemms_equal_fp32_products_of_the_same_fp8_values(name, k, n):
    """Forward (fast accumulation) within 1%, dx and dW within 0.5% of fp32 products of the
    very FP8 values the layer computed with: the scales and layouts reach cuBLAS correctly."""
    x, w, dy = _operands(k, n)
    y = Fp8Gemm(Recipe("hybrid", "tensorwise"))(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    xd, wd, dyd = _dequantized(x, e4), _dequantized(w.detach().bfloat16(), e4), _dequantized(dy, e5)
    assert _rel(y, xd @ wd.t()) < 1e-2
    assert _rel(dx, dyd @ wd) < 5e-3
    assert _rel(dw, dyd.t() @ xd) < 5e-3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("name,k,n", LAYERS, ids=[x[0] for x in LAYERS])
def test_each_layer_type_is_close_to_bf16(name, k, n, recipe):
    """Against the bf16 linear: e4m3 forward within 4% (relative Frobenius norm), gradients within
    8% (e5m2, hybrid) or 4% (e4m3, rowwise) -- the formats' rounding (2^-4 and 2^-3 relative per
    element, partly averaged by the sums), not a scaling or layout error, which shows as O(1)."""
    fmt = "e4m3" if recipe == "rowwise" else "hybrid"
    x, w, dy = _operands(k, n)
    y = Fp8Gemm(Recipe(fmt, recipe))(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    ref = F.linear(x, w.bfloat16())
    rdx, rdw = torch.autograd.grad(ref, (x, w), dy)
    assert _rel(y, ref) < 0.04
    bound = 0.04 if fmt == "e4m3" else 0.08
    assert _rel(dx, rdx) < bound
    assert _rel(dw, rdw) < bound


def _llama_job(corpus_cache, run_dir, **extra):
    args = small_job_args(
        corpus_cache,
        run_dir,
        **{
            "train.device": "cuda",
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 30,
            "train.compile": True,
            "model.hidden_size": 128,
            "model.normalization": "rmsnorm",
            "model.activation": "swiglu",
            "model.position_embedding_type": "rope",
            "model.add_bias_linear": False,
            **extra,
        },
    )
    return load_config(args)


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_compiled_delayed_scaling_records_every_amax_and_scales_from_it(
    algo, corpus_cache, tmp_path
):
    """The compiled model on CUDA (weight copies, fused accumulation): after each step every FP8
    layer's history holds the step's input, weight and output-gradient amaxes (the last recorded
    in the compiled backward), and the next scales are fp8_max over them."""
    job = _llama_job(
        corpus_cache,
        tmp_path / "run",
        **{
            "train.fp8": "hybrid",
            "train.fp8_recipe": "delayed",
            "train.fp8_amax_history_len": 4,
            "train.fp8_amax_compute_algo": algo,
        },
    )
    trainer = Trainer(job)
    state = trainer.fp8.delayed
    maxes = torch.tensor(
        FORMATS["hybrid"].role_max(), device="cuda"
    )  # fp8_max of input, weight, gradient
    try:
        for step in range(3):
            trainer.train_step(step)
            newest = state.history[
                :, :, 1
            ]  # the step just ended (entry 0 is the next one's, zeroed)
            assert (newest > 0).all(), (step, newest)
            assert (state.history[:, :, 0] == 0).all()
            seen = state.history.amax(dim=-1) if algo == "max" else newest
            torch.testing.assert_close(state.scale, maxes / seen)
    finally:
        trainer.release_run_dir()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_compiled_fp8_training_follows_bf16(recipe, corpus_cache, tmp_path):
    """A Llama-style model compiled on CUDA with bf16 weight copies and fused gradient
    accumulation (delayed at its defaults, Megatron's: the previous step's amax): FP8 losses
    falling, within 5% of bf16's at every step, and the mean of the last 10 steps within 3%.

    The per-step band is wide because this small model's loss falls by a third within a few
    steps, and FP8's rounding moves the trajectory a step ahead or behind: single steps 2-4% apart
    (-3.8% at step 7 on CPU; -2.1% at step 21 and +2.2% at step 18 on an H100), while the runs end
    level. A scaling or layout error shows as O(1) and training that does not fall.

    The tail bound is 3%: over seeds the tail mean moves more than 1% (H100, 30 steps: delayed
    +2.2% and +2.1% for seeds 1 and 2, tensorwise -1.0% and +1.8%; at commit 43aba95, where the
    default seed gave -0.1%, seeds 1 and 2 gave +1.5% each). How close FP8 ends to bf16 over a
    real run is measured by benchmarks/fp8_loss_curve.py (1,000 steps: +0.03%)."""
    fmt = "e4m3" if recipe == "rowwise" else "hybrid"
    bf16 = train(_llama_job(corpus_cache, tmp_path / "bf16"))
    fp8 = train(
        _llama_job(corpus_cache, tmp_path / "fp8", **{"train.fp8": fmt, "train.fp8_recipe": recipe})
    )
    assert fp8.losses[30] < fp8.losses[1] - 1.0
    for step, loss in bf16.losses.items():
        assert fp8.losses[step] == pytest.approx(loss, rel=0.05), step
    tail = range(21, 31)
    mean_fp8, mean_bf16 = (sum(run.losses[s] for s in tail) / len(tail) for run in (fp8, bf16))
    assert mean_fp8 == pytest.approx(mean_bf16, rel=0.03)


def test_a_token_count_off_the_multiple_of_16_is_padded():
    """cuBLAS refuses FP8 GEMMs whose dimensions are not multiples of 16; 100 tokens are padded
    with zero rows, which leave the result and the gradients those of the 100 rows."""
    x, w, dy = _operands(2048, 2048)
    x, dy = x.detach()[:100].requires_grad_(), dy[:100]
    gemm = Fp8Gemm(Recipe("hybrid", "tensorwise"))
    y = gemm(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y.shape == (100, 2048) and dx.shape == x.shape
    ref = F.linear(x, w.bfloat16())
    rdx, rdw = torch.autograd.grad(ref, (x, w), dy)
    assert _rel(y, ref) < 0.04 and _rel(dx, rdx) < 0.08 and _rel(dw, rdw) < 0.08


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("name,k,n", LAYERS, ids=[x[0] for x in LAYERS])
def test_fused_casts_give_each_layer_type_bit_for_bit(name, k, n, recipe):
    """The Triton casts (one pass: FP8 copy, transpose, delayed amax) against the separate torch
    casts at llama-1b's layer shapes: output and gradients equal, not close."""
    from meshtrain.services.trainer.fp8 import DelayedState
    from meshtrain.services.trainer.fp8.convert import Fp8Model

    results = []
    for fused in (False, True):
        r = Recipe("hybrid", recipe, fused_casts=fused)
        state = DelayedState(1, 1, torch.device("cuda")) if recipe == "delayed" else None
        gemm = Fp8Gemm(r, delayed=(state, 0) if state is not None else None)
        x, w, dy = _operands(k, n)
        out = []
        for _ in range(2):  # delayed: the second step casts with the first one's scale
            y = gemm(x, w)
            out += [y, *torch.autograd.grad(y, (x, w), dy)]
            if state is not None:
                out.append(state.history.clone())
                Fp8Model(r, ["layer"], delayed=state).step_end()
        results.append(out)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "compiled,in_compile",
    [(False, False), (True, False), (True, True)],
    ids=["eager", "compiled", "compiled-kernels"],
)
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fused_casts_train_as_the_unfused_casts(
    recipe, compiled, in_compile, corpus_cache, tmp_path
):
    """A small Llama on CUDA (bf16 weight copies, the FP8 weight cache): the fused cast kernels
    and the separate torch casts give the same losses, bit for bit, over 6 steps. Eager, the
    layers call the kernels; under torch.compile they trace the torch casts (Inductor fuses them
    itself; `Recipe.fused_now`), unless train.fp8_fused_casts_compiled puts the kernels inside
    the compiled regions ("compiled-kernels").

    The kernels cast the bf16 tensor as eager torch does. Inductor, fusing the torch casts into
    the op that makes their input, skips that rounding to bf16 unless told to emulate it: left
    at its default the compiled torch casts moved step 1's loss by 1.2e-4 (relative) on an H100,
    and with `emulate_precision_casts` the two runs are equal bit for bit."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(emulate_precision_casts=in_compile):
        runs = [
            train(
                _llama_job(
                    corpus_cache,
                    tmp_path / str(fused),
                    **{
                        "train.compile": compiled,
                        "train.train_iters": 6,
                        "train.fp8": "hybrid",
                        "train.fp8_recipe": recipe,
                        "train.fp8_fused_casts": fused,
                        "train.fp8_fused_casts_compiled": in_compile,
                    },
                )
            )
            for fused in (False, True)
        ]
    assert runs[1].losses == runs[0].losses


def test_fused_cast_kernels_equal_the_torch_casts_at_training_shapes():
    """fp8_cast_transpose and fp8_amax on CUDA, llama-1b's activation and gradient shapes (4096
    tokens), eager and inside torch.compile (the custom ops), against scaling's torch casts."""
    from meshtrain.kernels.fp8_cast import fp8_amax, fp8_cast_transpose

    compiled = torch.compile(
        lambda t, s, d: fp8_cast_transpose(t, s, d, amax=True), fullgraph=True, dynamic=False
    )
    for i, shape in enumerate([(TOKENS, 2048), (4093, 2047), (TOKENS, 5632), (11264, 2048)]):
        for in_dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device="cuda").manual_seed(shape[1])
            x = torch.randn(shape, device="cuda", generator=g).to(in_dtype) * 100
            x[0, :3] = torch.tensor([1e6, -0.0, 0.0])  # saturates and signed zeros
            for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
                a = amax(x)
                assert torch.equal(fp8_amax(x), a)
                s = amax_to_scale(a, torch.finfo(fmt).max) * 64  # the top of the range saturates
                expect = cast_to_fp8(x, s, fmt).view(torch.uint8)
                calls = [fp8_cast_transpose(x, s, fmt, amax=True)]
                if (
                    i < 2 and in_dtype == torch.bfloat16
                ):  # a few compiles: under the recompile limit
                    calls.append(compiled(x, s, fmt))
                for q, qt, got in calls:
                    assert torch.equal(q.view(torch.uint8), expect), (shape, in_dtype, fmt)
                    assert torch.equal(qt.view(torch.uint8), expect.t().contiguous())
                    assert torch.equal(got, a)
