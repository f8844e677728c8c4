"""Dispatch registers every Triton kernel on CUDA, and importing a kernel module keeps the op."""

import importlib

import pytest

import kernels
from tests.kernels.conftest import HAS_TRITON, needs_triton


def test_kernels_import_without_loading_triton_kernels():
    """The package itself never imports a kernel module: CPU-only installs need no Triton."""
    assert set(kernels._TRITON_MODULES) == set(kernels.OPS)


@needs_triton
def test_every_op_registers_on_cuda(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_KERNELS", "triton")
    for op in kernels.OPS:
        fast = kernels.resolve(op, on_cuda=True)
        assert fast is kernels._FAST[op] and fast.__module__ == kernels._TRITON_MODULES[op]


@needs_triton
def test_importing_a_kernel_module_keeps_the_dispatching_op():
    """`kernels/rms_norm.py` shares its name with the op `kernels.rms_norm`; importing the
    module must not replace the function the model calls."""
    module = importlib.import_module("kernels.rms_norm")
    assert callable(kernels.rms_norm) and kernels.rms_norm is not module
    assert kernels.rms_norm.__module__ == "kernels"


@pytest.mark.skipif(HAS_TRITON, reason="only meaningful where Triton is missing")
def test_auto_falls_back_without_triton():
    from kernels import reference

    assert kernels.resolve("rms_norm", on_cuda=True) is reference.rms_norm


def test_the_config_knows_every_op():
    """train.compiled_triton_ops is checked against the config's copy of the op list."""
    pytest.importorskip("tomli_w", reason="the trainer's dependencies are not installed here")
    from services.trainer.config import KERNEL_OPS

    assert KERNEL_OPS == kernels.OPS
