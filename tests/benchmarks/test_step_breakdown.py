"""The step breakdown's reduction: interval arithmetic, kernel kinds, exposed communication."""

import importlib

import pytest
import torch

from benchmarks.step_breakdown import (
    Span,
    breakdown,
    classify,
    format_breakdown,
    length,
    merge,
    overlap,
    profile_steps,
)


def test_merge_length_and_overlap():
    assert merge([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6)]) == [
        (0, 4),
        (5, 7),
    ]  # touching runs join; empty ones go
    a = merge([(0, 10), (20, 30)])
    b = merge([(5, 25), (28, 40)])
    assert length(a) == 20 and length(b) == 32
    assert overlap(a, b) == 5 + 5 + 2
    assert overlap(a, []) == 0 and overlap(a, a) == length(a)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "gemm"),
        ("triton_tem_fused_mm_0", "gemm"),
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>",
            "attention",
        ),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1",
            "attention",
        ),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
        ("Memcpy PtoP (Device -> Device)", "comm"),
        ("triton_poi_fused__scaled_dot_product_cudnn_attention_transpose_0", "inductor triton"),
        ("triton_poi_fused_all_gather_into_tensor_1", "inductor triton"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_2", "inductor triton"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel"
            "<FusedAdamMathFunctor<float, 4>>",
            "optimizer",
        ),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("Memset (Device)", "copy"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
            "other aten",
        ),
        ("aten::mm", "gemm"),
        (  # a row-scaled FP8 grouped GEMM: its epilogue's name is no collective
            "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShape"
            "EvEEJNS1O_16Sm90RowBroadcastILi0ESJ_PffNS6_",
            "gemm",
        ),
        ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
        ("c10d::broadcast_", "comm"),
        ("gloo:all_gather", "comm"),
        ("some_custom_kernel", "other"),
    ],
)
def test_kernel_names_get_their_kind(name, kind):
    assert classify(name) == kind


def _python_name(obj) -> str:
    while hasattr(obj, "fn"):  # Autotuner -> JITFunction -> the Python function
        obj = obj.fn
    return obj.__name__


def test_every_meshtrain_triton_kernel_is_counted_as_ours():
    # JITFunction, Autotuner, or (under TRITON_INTERPRET=1, as the kernel tests set)
    # InterpretedFunction
    names = {
        _python_name(obj)
        for op in ("rms_norm", "layer_norm", "rope", "gelu", "swiglu", "cross_entropy")
        for obj in vars(importlib.import_module(f"meshtrain.kernels.{op}")).values()
        if type(obj).__module__.startswith("triton.runtime") and hasattr(obj, "fn")
    }
    launched = {n for n in names if not n.startswith("_row_")}  # _row_*: device helpers, inlined
    assert {"_rms_norm_fwd", "_layer_norm_bwd", "_rope_kernel", "_ce_fused_kernel"} <= launched
    assert {n: classify(n) for n in launched} == dict.fromkeys(launched, "meshtrain triton")


def test_breakdown_separates_busy_idle_and_exposed_communication():
    # Two steps of 100 us: a GEMM 0-40, a collective 30-60 (10 us of it beside the GEMM), an
    # Inductor kernel 60-70; nothing runs 70-100 (host-bound).
    one = [
        Span("nvjet_gemm", 0, 40),
        Span("ncclDevKernel_AllGather", 30, 60),
        Span("triton_poi_fused_add_0", 60, 70),
    ]
    spans = one + [Span(s.name, s.start_us + 100, s.end_us + 100) for s in one]
    r = breakdown(spans, wall_us=200, steps=2)
    assert r["wall_ms"] == pytest.approx(0.1) and r["busy_ms"] == pytest.approx(0.07)
    assert r["idle_ms"] == pytest.approx(0.03)
    assert r["kinds"] == pytest.approx({"gemm": 0.04, "comm": 0.03, "inductor triton": 0.01})
    assert r["comm_ms"] == pytest.approx(0.03) and r["comm_exposed_ms"] == pytest.approx(0.02)
    assert r["top"][0] == ("nvjet_gemm", pytest.approx(0.04))
    text = format_breakdown("x", r)
    assert "comm exposed" in text and "20.0%" in text


def test_profile_steps_on_the_host_counts_the_ops_of_each_step():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step(i):
        for _ in range(3):
            (a @ b).relu_()

    r = profile_steps(step, first_step=0, steps=2, device=torch.device("cpu"))
    assert r["source"] == "host ops (no GPU)"
    assert r["kinds"]["gemm"] > 0 and r["busy_ms"] <= r["wall_ms"]
    assert dict(r["top"])["aten::matmul"] == pytest.approx(
        r["kinds"]["gemm"]
    )  # its aten::mm inside is not counted twice


def test_subtract_and_gaps():
    from benchmarks.step_breakdown import gaps, subtract

    a = merge([(0, 10), (20, 30), (40, 50)])
    b = merge([(2, 4), (8, 22), (45, 60)])
    assert subtract(a, b) == [(0, 2), (4, 8), (22, 30), (40, 45)]
    assert subtract(a, []) == a and subtract(a, a) == [] and subtract([], b) == []
    assert length(subtract(a, b)) == length(a) - overlap(a, b)
    assert gaps(a) == [(10, 20), (30, 40)] and gaps([]) == [] and gaps([(0, 1)]) == []


def test_breakdown_says_where_the_exposed_communication_and_idle_time_are():
    # One step: GEMM 0-40; a reduce-scatter 30-60 (20 us alone); an all-gather 90-95 alone after
    # 15 us of idle; a kernel 110-120 after another 15; a final idle gap of 30 us before 150.
    spans = [
        Span("nvjet_gemm", 0, 40),
        Span("ncclDevKernel_ReduceScatter", 30, 60),
        Span("triton_poi_fused_add_0", 60, 75),
        Span("ncclDevKernel_AllGather", 90, 95),
        Span("triton_poi_fused_mul_1", 110, 120),
        Span("nvjet_gemm", 150, 160),
    ]
    r = breakdown(spans, wall_us=160, steps=1)
    assert r["exposed_by_comm"] == [
        ("ncclDevKernel_ReduceScatter", pytest.approx(0.02)),
        ("ncclDevKernel_AllGather", pytest.approx(0.005)),
    ]

    def flat(pairs):
        return [x for pair in pairs for x in pair]

    assert flat(r["idle_gaps"]) == pytest.approx([0.12, 0.03, 0.075, 0.015, 0.095, 0.015])
    assert flat(r["exposed_stretches"]) == pytest.approx([0.04, 0.02, 0.09, 0.005])
    text = format_breakdown("x", r)
    assert "exposed comm by kernel: ncclDevKernel_ReduceScatter 0.02" in text
    assert "longest idle gaps (at ms: ms): 0.1: 0.03" in text
