"""The training loop on CUDA: bf16 autocast trains, and NCCL tp=2 / dp=2 match one GPU.

Skipped without CUDA (and the multi-GPU case without two GPUs). Run on the H200 machines
with `make test-gpu` (or `pytest -m gpu`).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.services.trainer.config.load import load_config
from meshtrain.services.trainer.train import train
from tests.services.trainer.conftest import small_job_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[3]


def test_bf16_training_on_cuda(corpus_cache, tmp_path):
    args = small_job_args(
        corpus_cache,
        tmp_path / "run",
        **{"train.device": "cuda", "train.bf16": True, "train.peak_tflops": 989.0},
    )
    result = train(load_config(args))
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < record["mfu"] < 1


def _losses(run: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }


def _train_on_gpus(world: int, args: list[str], run_dir: Path) -> dict[int, float]:
    """`meshtrain train --nproc-per-node WORLD ARGS` into `run_dir` (NCCL); its losses by step."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtrain.services.cli",
            "train",
            "--nproc-per-node",
            str(world),
            *args,
            f"--log.run_dir={run_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(run_dir)


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
MOE = ["--model.num_experts=4", "--model.moe_router_topk=2", "--model.moe_ffn_hidden_size=64"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
LLAMA = [
    "--model.normalization=rmsnorm",
    "--model.activation=swiglu",
    "--model.position_embedding_type=rope",
    "--model.num_query_groups=2",
    "--model.add_bias_linear=false",
]


def test_compiled_triton_ops_train_like_the_reference(corpus_cache, tmp_path):
    """A Llama-style model compiled on CUDA in fp32: with RoPE and SwiGLU on Triton inside the
    graph (train.compiled_triton_ops' default) its losses follow the all-reference run's."""
    common = small_job_args(
        corpus_cache,
        tmp_path / "x",
        **{
            "train.device": "cuda",
            "train.eval_interval": 0,
            "train.train_iters": 20,
            "train.compile": True,
        },
    )
    common = [a for a in common if not a.startswith("--log.run_dir")] + LLAMA
    mixed = train(load_config(common + [f"--log.run_dir={tmp_path / 'mixed'}"]))
    # the op choice is baked into the compiled graph, not guarded: compile afresh
    torch._dynamo.reset()
    reference = train(
        load_config(
            common + ["--train.compiled_triton_ops=[]", f"--log.run_dir={tmp_path / 'ref'}"]
        )
    )
    assert mixed.losses[20] < mixed.losses[1] - 1.0
    for step, loss in reference.losses.items():
        assert mixed.losses[step] == pytest.approx(loss, rel=1e-4), step


def test_bf16_weight_copies_train_like_autocast(corpus_cache, tmp_path):
    """Compiled in bf16 on CUDA: with train.bf16_weight_copies (the linears on bf16 copies cast
    once a step) the losses follow the autocast run's (exact on CPU in eager mode; Inductor may
    round its fusions of the two graphs differently)."""
    common = small_job_args(
        corpus_cache,
        tmp_path / "x",
        **{
            "train.device": "cuda",
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 20,
            "train.compile": True,
        },
    )
    common = [a for a in common if not a.startswith("--log.run_dir")] + LLAMA
    plain = train(
        load_config(
            common + ["--train.bf16_weight_copies=false", f"--log.run_dir={tmp_path / 'plain'}"]
        )
    )
    torch._dynamo.reset()
    copies = train(load_config(common + [f"--log.run_dir={tmp_path / 'copies'}"]))  # on by default
    assert copies.losses[20] < copies.losses[1] - 1.0
    for step, loss in plain.losses.items():
        assert copies.losses[step] == pytest.approx(loss, rel=1e-2), step


def test_accumulate_weight_grad_on_cuda_adds_fp32_sums_in_place():
    """The fused weight-gradient GEMM on CUDA: bf16 operands, the fp32 .grad read and written
    in place, no bf16 rounding of the product: its error is a small fraction of what a bf16 GEMM
    followed by the fp32 add (the hook's path) makes on the same operands."""
    from meshtrain.services.trainer.model.main_grad import accumulate_weight_grad

    torch.manual_seed(0)
    main = torch.randn(1536, 1024, device="cuda")
    start, ptr = main.double(), main.data_ptr()
    dy = torch.randn(4, 2048, 1536, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        accumulate_weight_grad(main, dy, x)
    want = start + 2 * (dy.reshape(-1, 1536).double().t() @ x.reshape(-1, 1024).double())
    hooked = start.float()
    for _ in range(2):
        hooked += (dy.reshape(-1, 1536).t() @ x.reshape(-1, 1024)).float()
    assert main.data_ptr() == ptr and main.dtype == torch.float32
    error = ((main.double() - want).abs().max() / want.abs().max()).item()
    hooked_error = ((hooked.double() - want).abs().max() / want.abs().max()).item()
    # fp32 sums over 8192 products: ~1e-5 of the largest entry; bf16 products: ~1e-3
    assert error < 5e-5 and error < hooked_error / 20, (error, hooked_error)


def test_fused_gradient_accumulation_trains_like_the_copies_hooks(corpus_cache, tmp_path):
    """Compiled in bf16 on CUDA with train.gradient_accumulation_fusion (on there by default): the
    losses follow the run whose copies' bf16 gradients a hook adds."""
    from meshtrain.services.trainer.train import Trainer

    common = small_job_args(
        corpus_cache,
        tmp_path / "x",
        **{
            "train.device": "cuda",
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 20,
            "train.compile": True,
        },
    )
    common = (
        [a for a in common if not a.startswith("--log.run_dir")]
        + LLAMA
        + ["--untie-embeddings-and-output-weights"]
    )
    unfused = Trainer(
        load_config(
            common + ["--no-gradient-accumulation-fusion", f"--log.run_dir={tmp_path / 'hooks'}"]
        )
    )
    assert not unfused.weight_copies.fused
    hooks = unfused.run()
    torch._dynamo.reset()
    trainer = Trainer(load_config(common + [f"--log.run_dir={tmp_path / 'fused'}"]))
    assert trainer.weight_copies.fused
    fused = trainer.run()
    assert fused.losses[20] < fused.losses[1] - 1.0
    for step, loss in hooks.losses.items():
        assert fused.losses[step] == pytest.approx(loss, rel=1e-2), step


@pytest.mark.parametrize("arch", [[], LLAMA], ids=["gpt2", "llama"])
def test_bf16_residual_stream_trains_like_the_fp32_one(arch, corpus_cache, tmp_path):
    """Compiled in bf16 on CUDA: with the stream between blocks in bf16 (the default) the loss
    curve follows the fp32 stream's (model.fp32_residual_connection) over 40 steps."""
    common = small_job_args(
        corpus_cache,
        tmp_path / "x",
        **{
            "train.device": "cuda",
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.compile": True,
        },
    )
    common = [a for a in common if not a.startswith("--log.run_dir")] + arch
    fp32 = train(
        load_config(common + ["--fp32-residual-connection", f"--log.run_dir={tmp_path / 'fp32'}"])
    )
    torch._dynamo.reset()
    bf16 = train(load_config(common + [f"--log.run_dir={tmp_path / 'bf16'}"]))
    assert bf16.losses[40] < bf16.losses[1] - 1.5
    for step, loss in fp32.losses.items():
        assert bf16.losses[step] == pytest.approx(loss, rel=2e-2), step


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    "layout,shared,rel",
    [
        (
            TP2_SP + ["--parallel.tp_async_grad_reduce=false"],
            [],
            1e-4,
        ),  # the input gradients' plain reduce-scatter
        (TP2_SP, ["--train.compile=true"], 1e-4),  # the in-place gathers of sp, compiled for CUDA
        # Compiled tp without SP, the input gradients' all-reduce in copy_to_region (not the default
        # async path): an in-place all-reduce in a Function's backward was lost in the CUDA graph
        # (losses stalled), which no CPU run showed.
        (
            ["--tensor-model-parallel-size", "2", "--parallel.tp_async_grad_reduce=false"],
            ["--train.compile=true"],
            1e-4,
        ),
        (TP2_SP + ["--tp-comm-overlap"], [], 1e-4),
        # Input gradients reduced during the weight-gradient GEMM: reduce-scatter (sp, eager) and
        # all-reduce (compiled), on NCCL.
        (TP2_SP + ["--parallel.tp_async_grad_reduce=true"], [], 1e-4),
        (
            ["--tensor-model-parallel-size", "2", "--parallel.tp_async_grad_reduce=true"],
            ["--train.compile=true"],
            1e-4,
        ),
        (
            ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
            [],
            1e-4,
        ),
        # Compiled (per block, and the head on its own, under overlap_param_gather).
        (
            ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
            ["--train.compile=true"],
            1e-4,
        ),
        # Gradients reduced in bf16 (half the bytes on the wire): equal to bf16's rounding of them.
        (
            [
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
                "--grad-reduce-in-bf16",
            ],
            ["--train.compile=true"],
            5e-3,
        ),
        # bf16 autocast: the linears' collectives move bf16 (one GPU never rounds their sums to
        # bf16), so a bf16 tolerance.
        (TP2_SP, ["--train.bf16=true"], 1e-2),
        # Llama-style, compiled: RoPE and SwiGLU on Triton inside the graph
        # (train.compiled_triton_ops' default) on each rank's heads and FFN shard, on both sides.
        (["--tensor-model-parallel-size", "2"], ["--train.compile=true"] + LLAMA, 1e-4),
        # Pipeline stages on NCCL: batched point-to-point transfers; compiled per block; the
        # zero-bubble schedule's deferred weight gradients in bf16; interleaved chunks.
        (["--pipeline-model-parallel-size", "2"], ["--model.num_layers=4"], 1e-4),
        (
            ["--pipeline-model-parallel-size", "2"],
            ["--model.num_layers=4", "--train.compile=true"],
            1e-4,
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--parallel.pipeline_schedule=zb-h1"],
            ["--model.num_layers=4", "--train.bf16=true"],
            1e-2,
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"],
            ["--model.num_layers=4"] + LLAMA,
            1e-4,
        ),
        # Context parallel on NCCL: the ring's batched transfers overlapped with the flash blocks
        # (bf16: the flash kernels), the fp32 reference blocks, and the all-to-alls compiled around.
        (["--context-parallel-size", "2"], ["--train.bf16=true"] + LLAMA, 1e-2),
        (["--context-parallel-size", "2"], LLAMA, 1e-4),
        (
            ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
            ["--train.compile=true", "--train.bf16=true"],
            1e-2,
        ),
        # Experts split over the two GPUs (and dp=2): the token all-to-alls on NCCL.
        (["--expert-model-parallel-size", "2"], LLAMA + MOE, 1e-4),
        # FP8 on both sides (bf16 autocast): the amax max-reduced over tp and the inputs
        # all-gathered as FP8 bytes; delayed scaling's history reduced over dp once a step,
        # with ZeRO-1.
        (TP2_SP, ["--train.bf16=true"] + LLAMA + FP8, 2e-2),
        (
            ["--use-distributed-optimizer", "--overlap-grad-reduce"],
            ["--train.bf16=true", "--train.compile=true"]
            + LLAMA
            + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
            2e-2,
        ),
    ],
    ids=[
        "tp2-sp-sync-grad",
        "tp2-sp-compiled",
        "tp2-compiled",
        "tp2-sp-comm-overlap",
        "tp2-sp-async-grad",
        "tp2-async-grad-compiled",
        "dp2-zero1-overlap",
        "dp2-zero1-overlap-compiled",
        "dp2-zero1-bf16-grad-reduce",
        "tp2-sp-bf16",
        "tp2-llama-triton-ops-compiled",
        "pp2-1f1b",
        "pp2-compiled",
        "pp2-zb-h1-bf16",
        "pp2-interleaved-llama",
        "cp2-p2p-bf16-llama",
        "cp2-p2p-llama",
        "cp2-a2a-compiled-bf16",
        "ep2-moe-llama",
        "fp8-tp2-sp",
        "fp8-dp2-zero1-delayed-compiled",
    ],
)
def test_nccl_two_gpus_match_one_gpu(layout, shared, rel, corpus_cache, tmp_path):
    """fp32 on CUDA: NCCL reduction order differs from one GPU's, so 1e-4 relative."""
    common = small_job_args(
        corpus_cache,
        tmp_path / "x",
        **{"train.device": "cuda", "train.eval_interval": 0, "train.train_iters": 10},
    )
    common = [a for a in common if not a.startswith("--log.run_dir")] + shared
    one = train(load_config(common + [f"--log.run_dir={tmp_path / 'one'}"]))
    two = _train_on_gpus(2, common + layout, tmp_path / "two")
    for step, loss in one.losses.items():
        assert two[step] == pytest.approx(loss, rel=rel), step


@pytest.mark.dist
@pytest.mark.parametrize(
    "world,saved_at,resumed_at",
    [
        (2, TP2_SP, ["--pipeline-model-parallel-size", "2"]),
        (
            4,
            TP2_SP + ["--pipeline-model-parallel-size", "2"],
            [
                "--context-parallel-size",
                "2",
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
            ],
        ),
    ],
    ids=["tp2-to-pp2", "tp2-pp2-to-cp2-dp2-zero1"],
)
def test_nccl_checkpoint_crosses_layouts_and_exports_with_one_gpus_logits(
    world, saved_at, resumed_at, corpus_cache, tmp_path
):
    """Layout independence on NCCL: saved at step 5 by one layout on `world` GPUs, resumed there
    at another and on one GPU; steps 6..10 follow the uninterrupted one-GPU run (fp32, 1e-4 as
    above), and the resumed run's last checkpoint, exported to Hugging Face, loads in
    transformers with the logits of the one-GPU run's export (and the same tensors)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    from safetensors.torch import load_file

    from meshtrain.services.checkpoint.hf.convert import export_hf

    transformers = pytest.importorskip("transformers")
    common = small_job_args(
        corpus_cache,
        tmp_path / "x",
        **{
            "train.device": "cuda",
            "train.eval_interval": 0,
            "train.train_iters": 10,
            "model.num_layers": 4,
        },
    )
    common = [a for a in common if not a.startswith("--log.run_dir")] + LLAMA

    def ck(name: str) -> list[str]:
        return [f"--checkpoint.save={tmp_path / ('ck-' + name)}"]

    every5 = ["--checkpoint.save_interval=5"]
    one = train(load_config(common + ck("one") + every5 + [f"--log.run_dir={tmp_path / 'one'}"]))
    load = [f"--checkpoint.load={tmp_path / 'ck-saved'}", "--checkpoint.load_step=5"]
    saved = _train_on_gpus(world, common + saved_at + every5 + ck("saved"), tmp_path / "saved")
    resumed = _train_on_gpus(
        world, common + resumed_at + load + ck("resumed"), tmp_path / "resumed"
    )
    alone = train(
        load_config(
            common
            + ck("alone")
            + load  # the same checkpoint on one GPU
            + [f"--log.run_dir={tmp_path / 'alone'}"]
        )
    ).losses
    assert sorted(saved) == list(range(1, 11)) and sorted(resumed) == sorted(alone) == list(
        range(6, 11)
    )
    for step, loss in one.losses.items():
        assert saved[step] == pytest.approx(loss, rel=1e-4), step
        if step > 5:
            assert resumed[step] == pytest.approx(loss, rel=1e-4), step
            assert alone[step] == pytest.approx(loss, rel=1e-4), step
    export_hf(str(tmp_path / "ck-resumed"), str(tmp_path / "hf-resumed"), 10)
    export_hf(str(tmp_path / "ck-one"), str(tmp_path / "hf-one"), 10)
    ours, theirs = (
        load_file(tmp_path / name / "model.safetensors") for name in ("hf-resumed", "hf-one")
    )
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        torch.testing.assert_close(ours[name], t, rtol=0, atol=1e-4, msg=name)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    logits = []
    for name in ("hf-resumed", "hf-one"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / name), dtype=torch.float32
        ).eval()
        with torch.no_grad():
            logits.append(hf(tokens).logits)
    assert logits[1].abs().max() > 1.0  # not a comparison of near-zero outputs
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "extra",
    [[], ["--train.cuda_graph=true"], ["--no-gradient-accumulation-fusion"]],
    ids=["eager", "cuda-graph", "copies-hooks"],
)
def test_a_training_step_never_synchronizes_with_the_host(extra, corpus_cache, tmp_path):
    """CUDA's sync debug mode turns any host synchronization (.item(), a D2H copy, a
    data-dependent shape) inside the step into an error; logging steps are the only place
    the loop reads values back, so the steps between them must run clean."""
    from meshtrain.services.trainer.train import Trainer

    args = small_job_args(
        corpus_cache,
        tmp_path / "run",
        **{"train.device": "cuda", "train.bf16": True, "train.eval_interval": 0},
    )
    trainer = Trainer(load_config(args + extra))
    trainer.train_step(
        0
    )  # warm-up: lazy initialization (cuBLAS handles, kernel loading) may sync; the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            trainer.train_step(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    trainer.checkpointer.close()


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2"],
        TP2_SP,
        ["--tensor-model-parallel-size", "2", "--train.compile=true"],
        ["--overlap-grad-reduce"],
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
        [
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--train.compile=true",
        ],
    ],
    ids=[
        "tp2",
        "tp2-sp",
        "tp2-compiled",
        "dp2-overlap",
        "dp2-zero1-overlap",
        "dp2-zero1-overlap-compiled",
    ],
)
def test_sharded_steps_never_synchronize_with_the_host(layout, corpus_cache, tmp_path):
    """As the single-GPU test, for each sharded path on NCCL
    (tests/services/trainer/sync_free_steps.py)."""
    args = small_job_args(
        corpus_cache,
        tmp_path / "run",
        **{"train.device": "cuda", "train.bf16": True, "train.eval_interval": 0},
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tests.services.trainer.sync_free_steps",
            *args,
            *layout,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_coordinate_descent_tuning_reaches_the_compiled_model_and_trains(corpus_cache, tmp_path):
    """train.compile_coordinate_descent_tuning is in the compiled callable's Inductor options
    (this model's graphs only, not the process's config), and the tuned model's losses follow
    the untuned one's (tuning picks launch settings; a reduction's block size can change its
    rounding, hence the tolerance)."""
    import torch._inductor.config as inductor_config

    from meshtrain.services.trainer.train import Trainer

    common = small_job_args(
        corpus_cache,
        tmp_path / "x",
        **{
            "train.device": "cuda",
            "train.bf16": True,
            "train.eval_interval": 0,
            "train.train_iters": 12,
            "train.compile": True,
        },
    )
    common = [a for a in common if not a.startswith("--log.run_dir")] + LLAMA
    trainer = Trainer(
        load_config(
            common
            + [
                "--train.compile_coordinate_descent_tuning=true",
                f"--log.run_dir={tmp_path / 'probe'}",
            ]
        )
    )
    try:
        assert trainer.train_forward.get_compiler_config()["coordinate_descent_tuning"] is True
        assert (
            inductor_config.coordinate_descent_tuning is False
        )  # the process's setting is untouched
    finally:
        trainer.checkpointer.close()
    torch._dynamo.reset()
    tuned = train(
        load_config(
            common
            + [
                "--train.compile_coordinate_descent_tuning=true",
                f"--log.run_dir={tmp_path / 'tuned'}",
            ]
        )
    )
    torch._dynamo.reset()
    plain = train(load_config(common + [f"--log.run_dir={tmp_path / 'plain'}"]))
    assert tuned.losses[12] < tuned.losses[1] - 1.0
    for step, loss in plain.losses.items():
        assert tuned.losses[step] == pytest.approx(loss, rel=1e-2), step
