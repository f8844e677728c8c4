"""The autotune space of the norm kernels: what pruning keeps for a row width."""

import pytest

from tests.kernels.conftest import needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("block", [128, 1024, 2048, 8192, 16384])
def test_pruned_space_fits_registers_and_keeps_the_heuristic(monkeypatch, block, backward):
    """On a GPU (autotuning on): every kept tile fits the per-lane budget, the untuned launch
    is always a candidate, and the space stays small enough to tune in seconds."""
    from meshtrain.kernels import _launch

    monkeypatch.setattr(_launch, "autotuning", lambda: True)
    kept = _launch.prune_row_configs(backward)(
        _launch.row_configs(backward), {"n_rows": 16384}, BLOCK=block
    )
    default = _launch.heuristic_config(block, backward)

    def key(c):
        return (c.kwargs["ROWS"], c.num_warps, c.num_stages)

    assert key(kept[0]) == key(default)
    assert 1 <= len(kept) <= 30
    for c in kept[1:]:
        assert (
            (8 if backward else 4)
            <= c.kwargs["ROWS"] * block // (32 * c.num_warps)
            <= (32 if backward else 64)
        )
    assert len({key(c) for c in kept}) == len(kept)


def test_prune_returns_the_heuristic_alone_without_autotuning(monkeypatch):
    """Under the interpreter (these tests) or MESHTRAIN_KERNEL_AUTOTUNE=0 nothing is timed."""
    from meshtrain.kernels import _launch

    monkeypatch.setattr(_launch, "autotuning", lambda: False)
    kept = _launch.prune_row_configs(False)(_launch.row_configs(False), {"n_rows": 5}, BLOCK=128)
    assert len(kept) == 1


@pytest.mark.parametrize("rows", [1, 5, 70, 4096, 16385])
def test_reduction_programs_cover_every_row_once(rows):
    import torch

    from meshtrain.kernels._launch import reduction_programs

    programs, per_program = reduction_programs(rows, torch.device("cpu"))
    assert (programs - 1) * per_program < rows <= programs * per_program


def test_reduction_programs_of_no_rows_is_one_empty_program():
    """An empty batch: one program that walks no rows (it writes the zero partial row of the
    weight gradient), not a division by zero."""
    import torch

    from meshtrain.kernels._launch import reduction_programs

    assert reduction_programs(0, torch.device("cpu")) == (1, 0)


@pytest.mark.parametrize("per_sm", [None, 1, 2, 8])
@pytest.mark.parametrize("rows", [1, 131, 16384, 16385])
def test_reduction_programs_on_a_gpu_cover_every_row_once_within_the_per_sm_budget(
    monkeypatch, rows, per_sm
):
    """On a CUDA device the count follows the SMs: at most per_sm (default
    REDUCTION_PROGRAMS_PER_SM) programs per SM, none of them without rows."""
    import torch

    from meshtrain.kernels import _launch

    monkeypatch.setattr(_launch, "sm_count", lambda index: 132)
    programs, per_program = _launch.reduction_programs(rows, torch.device("cuda", 0), per_sm)
    budget = 132 * (per_sm or _launch.REDUCTION_PROGRAMS_PER_SM)
    assert (programs - 1) * per_program < rows <= programs * per_program
    assert programs <= budget
    # a row each while they fit; past that, rounding the run length up idles under half the budget
    assert programs == rows if rows <= budget else programs > budget // 2


@pytest.mark.parametrize("interpreted", [False, True])
def test_kernel_op_is_traced_into_on_a_gpu_build_and_opaque_under_the_interpreter(
    monkeypatch, interpreted
):
    """`kernel_op` makes a `triton_op` when Triton compiles for a GPU: AOT autograd traces its
    body, so the compiled graph holds the body's own ops. Under the interpreter (whose kernels
    cannot be traced) the op stays one opaque node. A body of plain torch ops shows which."""
    import torch

    from meshtrain.kernels import _launch

    monkeypatch.setattr(_launch, "interpreting", lambda: interpreted)
    name = f"meshtrain_test::scaled_{'interp' if interpreted else 'gpu'}"

    @_launch.kernel_op(name)
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, 3.0)

    @scaled.register_fake
    def _(x):
        return torch.empty_like(x)

    seen = []

    def backend(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(g, _inputs):
            seen.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return g

        return aot_module_simplified(gm, example_inputs, fw_compiler=record)

    x = torch.arange(4.0)
    torch._dynamo.reset()
    out = torch.compile(lambda t: scaled(t) + 1, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(out, x * 3 + 1)
    opaque = any("meshtrain_test" in t for t in seen)
    assert opaque == interpreted, seen
    assert interpreted or any("aten.mul" in t for t in seen), seen


def _run_without_interpreter(code: str, **env_extra: str):
    """Run `code` in a fresh Python without TRITON_INTERPRET (which these tests set), so Triton
    compiles for a GPU and each op is a triton_op; returns the JSON its last output line holds."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_extra
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_FIND_KERNELS = """
import importlib, json, torch
from torch._library.triton import get_triton_kernels_for_op
found = {}
for module, ops in json.loads(MODULES).items():
    importlib.import_module(module)
    for op in ops:
        kernels = get_triton_kernels_for_op("meshtrain::" + op)
        found[op] = sorted(getattr(k, "fn", k).__name__ for k in kernels)
print(json.dumps(found))
"""


def test_torch_finds_each_triton_ops_kernels_for_the_compile_cache_key():
    """Where Triton compiles (here: a process without the interpreter, which these tests set),
    each op is a triton_op, and torch's scan of its source finds the kernels it launches:
    their source goes into the AOT-autograd cache key, so editing a kernel invalidates
    compiled graphs that use it instead of serving them stale."""
    import json

    import torch

    if not hasattr(torch.library, "triton_op") or not hasattr(torch._library, "triton"):
        pytest.skip("this torch has no triton_op")
    expected = {
        # the norms' backward also sums its partials with kernels/_column_sums.py's kernel
        "rms_norm": ["_rms_norm_fwd"],
        "rms_norm_backward": ["_column_sums", "_rms_norm_bwd"],
        "layer_norm": ["_layer_norm_fwd"],
        "layer_norm_backward": ["_column_sums", "_layer_norm_bwd"],
        "gelu": ["_gelu_fwd"],
        "gelu_backward": ["_gelu_bwd"],
        "swiglu": ["_swiglu_fwd"],
        "swiglu_backward": ["_swiglu_bwd"],
        "rope": ["_rope_kernel"],
        "rope_backward": ["_rope_kernel"],
        "cross_entropy": ["_ce_fused_kernel"],
        "cross_entropy_backward": ["_grad_kernel"],
        "linear_cross_entropy": ["_ce_fused_kernel"],
    }
    modules = {
        f"meshtrain.kernels.{op}": [op, f"{op}_backward"]
        for op in ("rms_norm", "layer_norm", "gelu", "swiglu", "rope")
    }
    modules["meshtrain.kernels.cross_entropy"] = ["cross_entropy", "cross_entropy_backward"]
    modules["meshtrain.kernels.linear_cross_entropy"] = ["linear_cross_entropy"]
    found = _run_without_interpreter(
        "import os; MODULES = os.environ['MODULES']\n" + _FIND_KERNELS, MODULES=json.dumps(modules)
    )
    assert found == expected


def test_kernels_are_wrapped_for_tracing_only_while_a_dispatch_mode_traces(monkeypatch):
    """Eager launches get the bare kernel (no detour through the tracing wrapper); inside a
    dispatch mode (AOT autograd tracing a triton_op's body) they get torch's wrapper; under
    the interpreter never."""
    import torch
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from meshtrain.kernels import _launch

    kernel = object()
    monkeypatch.setattr(torch.library, "wrap_triton", lambda k: ("wrapped", k), raising=False)
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    assert _launch.wrap_triton(kernel) is kernel
    with FunctionalTensorMode():
        assert _launch.wrap_triton(kernel) == ("wrapped", kernel)
    monkeypatch.setattr(_launch, "interpreting", lambda: True)
    with FunctionalTensorMode():
        assert _launch.wrap_triton(kernel) is kernel


def test_an_autotuned_kernel_reaches_inductor_with_one_config(monkeypatch):
    """While traced, a kernel with several configs is tuned first and Inductor gets an
    autotuner over the same function holding the chosen config alone (one per config)."""
    import torch
    import triton
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from meshtrain.kernels import _launch
    from meshtrain.kernels.layer_norm import _layer_norm_fwd

    monkeypatch.setattr(torch.library, "wrap_triton", lambda k: ("wrapped", k), raising=False)
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    assert len(_layer_norm_fwd.configs) > 1
    with FunctionalTensorMode():
        assert isinstance(_launch.wrap_triton(_layer_norm_fwd), _launch._TunedWhileTracing)
    one_config = triton.autotune(configs=[_layer_norm_fwd.configs[0]], key=["n_cols"])(
        _layer_norm_fwd.fn
    )
    with FunctionalTensorMode():  # nothing to choose: torch's wrapper straight away
        assert _launch.wrap_triton(one_config) == ("wrapped", one_config)
    chosen = _layer_norm_fwd.configs[1]
    pinned = _launch._with_config(_layer_norm_fwd, chosen)
    assert pinned.configs == [chosen] and pinned.fn is _layer_norm_fwd.fn
    assert list(pinned.keys) == list(_layer_norm_fwd.keys)
    assert _launch._with_config(_layer_norm_fwd, chosen) is pinned
    assert _launch._with_config(_layer_norm_fwd, _layer_norm_fwd.configs[2]) is not pinned


_TRACE_ROPE = """
import json, torch
from torch._functorch.aot_autograd import aot_module_simplified
from meshtrain.kernels import reference
from meshtrain.kernels.rope import rope

seen = []


class Recorded(Exception):
    pass


def backend(gm, example_inputs):
    def record(graph, _inputs):  # stop before running it: no GPU here to launch the kernel on
        seen.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
        raise Recorded

    return aot_module_simplified(gm, example_inputs, fw_compiler=record)


cos, sin = reference.rope_cos_sin(8, 4, 10000.0)
try:
    torch.compile(rope, backend=backend, fullgraph=True)(torch.randn(1, 2, 8, 4), cos, sin)
except Exception as e:
    if "Recorded" not in repr(e):
        raise
print(json.dumps(seen))
"""


def test_aot_autograd_traces_a_triton_op_down_to_its_kernel_launch():
    """Where Triton compiles (a process without the interpreter), torch.compile's AOT autograd
    decomposes `meshtrain::rope` into the launch of its kernel: the graph Inductor would get
    holds a `triton_kernel_wrapper_functional` node and no call back into the op. (The graph is
    recorded, not run: this machine has no GPU.)"""
    import torch

    if not hasattr(torch.library, "triton_op"):
        pytest.skip("this torch has no triton_op")
    seen = _run_without_interpreter(_TRACE_ROPE)
    assert "triton_kernel_wrapper_functional" in seen, seen
    assert not any("meshtrain" in t for t in seen), seen
