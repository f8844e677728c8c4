"""The ops under torch.compile: dispatch without graph breaks, and the Triton custom ops.

On CPU, `dispatch.<op>` dispatches to the reference, compiled or not; the Triton kernels are
reached by calling `kernels/<op>.py` directly (on CPU tensors: Triton's interpreter), which
under compile goes through the custom ops `meshtrain::<op>`. `fullgraph=True` turns any graph
break into an error. The `aot_eager` backend traces forward and backward exactly as Inductor
would (fake tensors, AOT autograd) without generating code, which keeps these tests fast and
free of a C++ compiler. Outputs are compared in fp32 to the reference at 1e-5 (same math,
different reduction order), gradients likewise.
"""

import importlib

import pytest
import torch

from meshtrain.kernels import dispatch, reference
from tests.kernels.conftest import DEVICE, needs_triton

FP32 = {"rtol": 1e-5, "atol": 1e-5}


def _cases():
    """op -> (args builder, extra positional args); tiny shapes, odd sizes."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, grad=True):  # made on the CPU generator, then moved: same values everywhere
        return torch.randn(*shape, generator=g).to(DEVICE).requires_grad_(grad)

    s, d = 7, 6
    cos, sin = (t.to(DEVICE) for t in reference.rope_cos_sin(s, d, 10000.0))
    labels = torch.randint(0, 11, (2, 3), generator=g).to(DEVICE)
    mask = (torch.rand(2, 3, generator=g) > 0.3).float().to(DEVICE)
    return {
        "rms_norm": lambda: (randn(2, 3, 20), randn(20), 1e-5),
        "layer_norm": lambda: (randn(2, 3, 20), randn(20), randn(20), 1e-5),
        "gelu": lambda: (randn(3, 17),),
        "swiglu": lambda: (randn(3, 2 * 9),),
        "rope": lambda: (randn(1, 2, s, d), cos, sin),
        "cross_entropy": lambda: (randn(2, 3, 11), labels, mask),
        "linear_cross_entropy": lambda: (randn(2, 3, 8), randn(13, 8), labels, mask, 11),
    }


def _grads(out, args):
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return torch.autograd.grad(out.sum(), leaves)


def _check_compiled(fn, op, backend="aot_eager"):
    build = _cases()[op]
    args, ref_args = build(), None
    ref_args = [
        a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        for a in args
    ]
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    expected = getattr(reference, op)(*ref_args)
    torch.testing.assert_close(out, expected, **FP32)
    for a, b in zip(_grads(out, args), _grads(expected, ref_args)):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("op", dispatch.OPS)
def test_dispatching_op_compiles_without_graph_breaks(op):
    """What a compiled model runs: `dispatch.<op>` picks its implementation while tracing (the
    reference on CPU) with no graph break."""
    _check_compiled(getattr(dispatch, op), op)


def _triton(op):
    return getattr(importlib.import_module(f"meshtrain.kernels.{op}"), op)


@needs_triton
@pytest.mark.parametrize("op", dispatch.OPS)
def test_triton_op_compiles_as_custom_op(op):
    """The Triton implementation under compile: one `meshtrain::` node per call in the traced
    graph, forward and backward equal to the reference."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fn = _triton(op)
    torch._dynamo.reset()
    args = _cases()[op]()
    torch.compile(fn, fullgraph=True, backend=backend)(*args)
    assert any(t.startswith("meshtrain.") for t in seen), seen
    _check_compiled(fn, op)


def _custom_op(op):
    module = importlib.import_module(f"meshtrain.kernels.{op}")
    name = {"cross_entropy": "_ce_op", "linear_cross_entropy": "_lce_op"}.get(op, f"_{op}_op")
    return getattr(module, name)


@needs_triton
@pytest.mark.parametrize("op", dispatch.OPS)
def test_custom_op_passes_opcheck(op):
    """torch.library.opcheck: schema, fake (meta) implementation against the real outputs'
    shapes, dtypes and strides, autograd registration, and AOT dispatch with dynamic shapes."""
    args = list(_cases()[op]())
    if op == "linear_cross_entropy":
        args = args + [4, torch.float32, True]  # chunk_size (two chunks), compute dtype, want_grads
    torch.library.opcheck(_custom_op(op), tuple(args))


@needs_triton
def test_layer_norm_custom_op_without_bias_passes_opcheck():
    from meshtrain.kernels.layer_norm import _layer_norm_op

    x, w = torch.randn(5, 20).to(DEVICE), torch.randn(20).to(DEVICE)
    torch.library.opcheck(_layer_norm_op, (x.requires_grad_(), w.requires_grad_(), None, 1e-5))


@needs_triton
def test_auto_keeps_the_compiled_set_on_triton_inside_compiled_regions(monkeypatch):
    """'auto' on CUDA while compiling: Triton for the ops in set_mode's compiled set (every op
    by default), the reference for the others; outside compiled regions Triton for all."""
    monkeypatch.delenv("MESHTRAIN_KERNELS", raising=False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    try:
        dispatch.set_mode("auto")
        assert dispatch.resolve("rms_norm", on_cuda=True).__module__ == "meshtrain.kernels.rms_norm"
        dispatch.set_mode("auto", compiled_ops={"rope", "swiglu"})
        assert dispatch.resolve("rms_norm", on_cuda=True) is reference.rms_norm
        assert dispatch.resolve("rope", on_cuda=True).__module__ == "meshtrain.kernels.rope"
        assert dispatch.resolve("swiglu", on_cuda=True).__module__ == "meshtrain.kernels.swiglu"
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        assert dispatch.resolve("rms_norm", on_cuda=True).__module__ == "meshtrain.kernels.rms_norm"
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setenv("MESHTRAIN_KERNELS", "triton")  # forcing Triton ignores the set
        assert dispatch.resolve("rms_norm", on_cuda=True).__module__ == "meshtrain.kernels.rms_norm"
    finally:
        dispatch.set_mode("auto")


def test_a_change_of_mode_is_not_hidden_by_a_graph_compiled_before_it(monkeypatch):
    """mode() is read once per trace and baked in unguarded: a second job in the same process
    (another Trainer, a benchmark's variant) with another choice must not reuse the first
    job's compiled graphs; setting the same choice again keeps them."""
    monkeypatch.delenv("MESHTRAIN_KERNELS", raising=False)
    traces = []

    def backend(gm, example_inputs):
        traces.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def shifted(x):
        return x + (1 if dispatch.mode() == "reference" else 2)

    x = torch.zeros(3)
    try:
        dispatch.set_mode("reference")
        assert shifted(x).tolist() == [1, 1, 1]
        dispatch.set_mode("reference")  # unchanged: the graph stays
        assert shifted(x).tolist() == [1, 1, 1] and len(traces) == 1
        dispatch.set_mode("triton")
        assert shifted(x).tolist() == [2, 2, 2] and len(traces) == 2
        dispatch.set_mode("triton", compiled_ops={"rope"})  # the compiled set alone changed
        assert shifted(x).tolist() == [2, 2, 2] and len(traces) == 3
    finally:
        dispatch.set_mode("auto")


def test_set_mode_refuses_an_unknown_compiled_op():
    with pytest.raises(ValueError, match="no compiled Triton op 'softmax'"):
        dispatch.set_mode("auto", compiled_ops={"softmax"})
    assert dispatch.mode() in ("auto", "reference", "triton")
