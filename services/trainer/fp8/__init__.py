"""FP8 training: linear layers on FP8 GEMMs with fp32 master weights (train.fp8, --fp8-format).

`scaling` holds the formats and scaling rules, `linear` the FP8 GEMMs (`torch._scaled_mm`) and
layers, `experts` the MoE blocks' FP8 grouped expert GEMMs (train.fp8_experts), `convert` the
choice of layers and delayed scaling's per-step update. The trainer calls `apply_fp8` after tensor
and expert parallelism and `Fp8Model.step_end` after each step's backward; nothing else in the
trainer, the optimizer or the checkpoints sees FP8.
"""

from meshtrain.services.trainer.fp8.convert import Fp8Model, apply_fp8, build_fp8
from meshtrain.services.trainer.fp8.linear import DelayedState, Fp8Gemm, Fp8Linear, Groups
from meshtrain.services.trainer.fp8.scaling import FORMATS, Recipe

__all__ = [
    "FORMATS",
    "DelayedState",
    "Fp8Gemm",
    "Fp8Linear",
    "Fp8Model",
    "Groups",
    "Recipe",
    "apply_fp8",
    "build_fp8",
]
