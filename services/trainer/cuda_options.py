"""CUDA settings a job asks for: an SM carveout for matmuls (TrainConfig), applied to the whole
process, as the trainer owns it; and the refusal of coordinate-descent tuning off CUDA (the
tuning itself is the compiled model's own option, set where the trainer compiles it)."""

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
    if train.matmul_sm_carveout:
        reserve_sms_from_matmuls(train.matmul_sm_carveout, device)


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
