"""CUDA settings a job asks for: Inductor's overlap scheduler, and an SM carveout for matmuls
(both in TrainConfig), each applied to the whole process, as the trainer owns it; and the
refusal of coordinate-descent tuning off CUDA (the tuning itself is the compiled model's own
option, set where the trainer compiles it)."""

from __future__ import annotations

import torch

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config import TrainConfig


def apply_cuda_options(train: TrainConfig, device: torch.device) -> None:
    """Set what `train` asks for on this process (nothing by default).

    Raises:
        ConfigError: an option that needs CUDA on another device, or a torch without it.
    """
    if train.compile_coordinate_descent_tuning and device.type != "cuda":
        raise ConfigError(f"train.compile_coordinate_descent_tuning tunes the Triton kernels Inductor generates "
                          f"for a CUDA device; this run is on {device}")
    if train.compile_overlap_scheduling:
        enable_overlap_scheduling(device)
    if train.matmul_sm_carveout:
        reserve_sms_from_matmuls(train.matmul_sm_carveout, device)


def enable_overlap_scheduling(device: torch.device) -> None:
    """Turn on Inductor's compute/collective overlap scheduler for this process (see TrainConfig)."""
    if device.type != "cuda":
        raise ConfigError(f"train.compile_overlap_scheduling times kernels on a CUDA device; this run is on {device}")
    import torch._inductor.config as inductor_config

    options = getattr(inductor_config, "aten_distributed_optimizations", None)
    if options is None or not hasattr(options, "enable_overlap_scheduling"):
        raise ConfigError(f"train.compile_overlap_scheduling: torch {torch.__version__} has no Inductor overlap "
                          "scheduler (torch._inductor.config.aten_distributed_optimizations)")
    options.enable_overlap_scheduling = True
    _count_gqa_attention_flops()


def reserve_sms_from_matmuls(n: int, device: torch.device) -> None:
    """Ask matmuls to leave `n` SMs to other kernels, for the rest of this process (see
    TrainConfig.matmul_sm_carveout; the carveout and the cuBLASLt backend stay set)."""
    if device.type != "cuda":
        raise ConfigError(f"train.matmul_sm_carveout leaves GPU SMs to collectives; this run is on {device}")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < n < sms:
        raise ConfigError(f"train.matmul_sm_carveout={n}: {torch.cuda.get_device_name(device)} has {sms} SMs")
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        raise ConfigError(f"train.matmul_sm_carveout: torch {torch.__version__} has no SM carveout")
    setter(n)
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the carveout reaches cuBLASLt's matmuls


def _count_gqa_attention_flops() -> None:
    """Let torch's SDPA FLOP formulas take grouped-query attention (fewer key/value heads).

    The overlap scheduler estimates each node's runtime from its FLOPs. torch 2.11's SDPA
    formulas assert equal query and key/value head counts, so a GQA model failed to compile
    ("sdpa_flop_count: query/key/value shapes are incompatible"). The kernel does the work of
    key/value heads broadcast to the query's, which is what newer torch counts; where the
    installed formulas refuse GQA, they get key/value shapes widened that way.
    """
    from torch.utils import flop_counter

    try:
        flop_counter.sdpa_flop_count((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
        return  # this torch counts GQA itself
    except AssertionError:
        pass
    forward, backward = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count

    def widen(query_shape, kv_shape):
        return (kv_shape[0], query_shape[1], *kv_shape[2:])

    flop_counter.sdpa_flop_count = lambda q, k, v: forward(q, widen(q, k), widen(q, v))
    flop_counter.sdpa_backward_flop_count = lambda g, q, k, v: backward(g, q, widen(q, k), widen(q, v))
