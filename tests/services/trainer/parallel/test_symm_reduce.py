"""The symmetric-memory forward all-reduce (`parallel.tp_reduce_impl = "symm_mem"`): what runs where.

Symmetric memory has no CPU backend, so the reduction itself is checked on two GPUs
(tests/services/trainer/test_gpu.py: the tp2-symm-reduce cases against one GPU, and
benchmarks/allreduce_bench.py checks its sum before timing it). Here: the option's refusals,
which tensors the kernel takes, and the op's fake implementation that torch.compile traces.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config import ModelConfig, load_config
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel import symm_reduce
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor import parallelize
from tests.services.trainer.parallel.test_tensor import GPT2

TP2 = ["--tensor-model-parallel-size", "2"]


def test_config_accepts_symm_mem_only_where_it_replaces_an_all_reduce():
    assert load_config([]).parallel.tp_reduce_impl == "nccl"
    assert load_config(TP2 + ["--tp-reduce-impl", "symm_mem"]).parallel.tp_reduce_impl == "symm_mem"
    with pytest.raises(ConfigError, match="needs parallel.tp > 1"):
        load_config(["--tp-reduce-impl", "symm_mem"])
    with pytest.raises(ConfigError, match="reduce-scatters stay on NCCL"):
        load_config(TP2 + ["--sequence-parallel", "--tp-reduce-impl", "symm_mem"])
    with pytest.raises(ConfigError, match="tp_reduce_impl"):
        load_config(TP2 + ["--tp-reduce-impl", "gloo"])


def test_parallelize_refuses_symm_mem_off_cuda_and_with_sequence_parallelism():
    mesh = Mesh(tp=2, rank=0, ranks={"tp": [0, 1]})
    with pytest.raises(ConfigError, match="tp_reduce_impl='symm_mem': it needs CUDA devices"):
        parallelize(GPT(ModelConfig(**GPT2)), mesh, reduce_impl="symm_mem", device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="without sequence parallelism"):
        parallelize(GPT(ModelConfig(**GPT2)), mesh, sequence_parallel=True, reduce_impl="symm_mem")
    with pytest.raises(ConfigError, match="'nccl' or 'symm_mem'"):
        parallelize(GPT(ModelConfig(**GPT2)), mesh, reduce_impl="mpi")


def test_the_kernel_takes_bf16_and_fp32_in_16_byte_multiples_only():
    assert symm_reduce.reduces_here(torch.empty(4, 2048, dtype=torch.bfloat16))
    assert symm_reduce.reduces_here(torch.empty(3, 4))  # 48 bytes of fp32
    assert not symm_reduce.reduces_here(torch.empty(7, dtype=torch.bfloat16))  # 14 bytes: NCCL instead
    assert not symm_reduce.reduces_here(torch.empty(8, dtype=torch.float16))


def test_the_fake_op_keeps_shape_and_dtype_for_compile():
    with FakeTensorMode():
        x = torch.empty(2, 16, 64, dtype=torch.bfloat16)
        y = torch.ops.meshtrain.symm_all_reduce(x, "tp-group")
    assert y.shape == (2, 16, 64) and y.dtype == torch.bfloat16 and y.is_contiguous()
