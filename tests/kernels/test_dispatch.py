"""Dispatch registers every Triton kernel on CUDA, and importing a kernel module keeps the op."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.kernels import dispatch, reference
from tests.kernels.conftest import HAS_TRITON, needs_triton


def test_kernels_import_without_loading_triton_kernels():
    """Dispatch itself never imports a kernel module: CPU-only installs need no Triton."""
    assert set(dispatch._TRITON_MODULES) == (
        set(dispatch.OPS) | set(dispatch.FP8_OPS) | set(dispatch.FP8_OUTPUT_OPS)
    )


@needs_triton
def test_every_op_registers_on_cuda(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_KERNELS", "triton")
    for op in dispatch.OPS + dispatch.FP8_OPS + dispatch.FP8_OUTPUT_OPS:
        fast = dispatch.resolve(op, on_cuda=True)
        assert fast is dispatch._FAST[op] and fast.__module__ == dispatch._TRITON_MODULES[op]


@needs_triton
def test_fp8_casts_take_triton_in_compiled_regions_whatever_the_compiled_set(monkeypatch):
    """The compiled set narrows the norms and activations to Inductor's fusion of the reference;
    the FP8 casts stay on their kernel (Inductor's fusion is the passes the kernel merges)."""
    monkeypatch.delenv("MESHTRAIN_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "_compiled_ops", frozenset({"rope"}))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch.resolve("rms_norm", on_cuda=True) is reference.rms_norm
    fast = dispatch.resolve("fp8_cast_transpose", on_cuda=True)
    assert fast.__module__ == "meshtrain.kernels.fp8_cast"
    assert dispatch.resolve("fp8_amax", on_cuda=False) is reference.fp8_amax


@needs_triton
def test_importing_a_kernel_module_keeps_the_dispatching_op():
    """`kernels/rms_norm.py` shares its name with the op `dispatch.rms_norm`; importing the module
    must not replace the function the model calls."""
    module = importlib.import_module("meshtrain.kernels.rms_norm")
    assert callable(dispatch.rms_norm) and dispatch.rms_norm is not module
    assert dispatch.rms_norm.__module__ == "meshtrain.kernels.dispatch"


@pytest.mark.skipif(HAS_TRITON, reason="only meaningful where Triton is missing")
def test_auto_falls_back_without_triton():
    from meshtrain.kernels import reference

    assert dispatch.resolve("rms_norm", on_cuda=True) is reference.rms_norm


def test_the_config_knows_every_op():
    """train.compiled_triton_ops is checked against the config's copy of the op list."""
    pytest.importorskip("tomli_w", reason="the trainer's dependencies are not installed here")
    from meshtrain.services.trainer.config.sections import KERNEL_OPS

    assert KERNEL_OPS == dispatch.OPS


def test_reference_projection_hands_its_logits_to_the_dispatched_cross_entropy(monkeypatch):
    """Where linear_cross_entropy takes the reference but cross_entropy its Triton kernel (under
    torch.compile with train.compiled_triton_ops = ["cross_entropy"]), the loss runs through
    the dispatched cross_entropy on the (tokens, vocab) logits, padding rows cut off."""
    import torch

    from meshtrain.kernels import reference

    seen = []

    def fake_triton_ce(logits, labels, loss_mask=None):
        seen.append(tuple(logits.shape))
        return reference.cross_entropy(logits, labels, loss_mask)

    real = dispatch.resolve
    monkeypatch.setattr(
        dispatch,
        "resolve",
        lambda op, on_cuda: fake_triton_ce if op == "cross_entropy" else real(op, on_cuda),
    )
    torch.manual_seed(0)
    h, w = torch.randn(2, 5, 8), torch.randn(12, 8)  # vocabulary 10, padded to 12
    labels = torch.randint(0, 10, (2, 5))
    loss = dispatch.linear_cross_entropy(h, w, labels, None, 10)
    assert seen == [(2, 5, 10)]
    torch.testing.assert_close(loss, reference.linear_cross_entropy(h, w, labels, None, 10))


def test_linear_cross_entropy_compiles_whole_on_the_reference():
    """The dispatcher's choice between the fused op and projection + cross_entropy is made at
    trace time: no graph break."""
    import torch

    from meshtrain.kernels import reference

    torch._dynamo.reset()
    h, w = torch.randn(3, 8), torch.randn(10, 8)
    labels = torch.randint(0, 10, (3,))
    f = torch.compile(
        lambda a, b: dispatch.linear_cross_entropy(a, b, labels, None, 10), fullgraph=True
    )
    torch.testing.assert_close(f(h, w), reference.linear_cross_entropy(h, w, labels, None, 10))
    torch._dynamo.reset()


def test_triton_mode_off_cuda_names_where_the_mode_came_from_and_why(monkeypatch):
    """train.kernels = 'triton' (set_mode) on CPU tensors: the error said MESHTRAIN_KERNELS=triton,
    a variable nobody set, and 'no Triton kernel for this device'; it names the setting and
    the reason. With the variable set, the variable."""
    import torch

    monkeypatch.delenv("MESHTRAIN_KERNELS", raising=False)
    dispatch.set_mode("triton")
    try:
        with pytest.raises(
            RuntimeError, match=r"kernel mode 'triton' \(train.kernels\).*'rms_norm'.*not on a CUDA"
        ):
            dispatch.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
        monkeypatch.setenv("MESHTRAIN_KERNELS", "triton")
        dispatch.set_mode("auto")
        with pytest.raises(
            RuntimeError, match=r"MESHTRAIN_KERNELS=triton, but op 'gelu'.*not on a CUDA"
        ):
            dispatch.gelu(torch.randn(3))
    finally:
        dispatch.set_mode("auto")


@pytest.mark.e2e
def test_triton_mode_without_triton_says_triton_is_missing():
    """A CUDA op in 'triton' mode where `import triton` fails (run in a fresh interpreter with
    triton blocked): the error says Triton is not installed; 'auto' takes the reference."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from meshtrain.kernels import dispatch\nfrom meshtrain.kernels import reference\n"
        "assert dispatch.resolve('rms_norm', on_cuda=True) is reference.rms_norm\n"
        "dispatch.set_mode('triton')\n"
        "try:\n    dispatch.resolve('rms_norm', on_cuda=True)\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MESHTRAIN_KERNELS"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=Path(dispatch.__file__).resolve().parents[1],
    ).stdout
    assert "'rms_norm' cannot run on Triton: Triton is not installed" in out, out
