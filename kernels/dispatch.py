"""Fused ops and their dispatch.

The model calls ops through this module, never through a specific implementation. CUDA
tensors take the Triton kernel of `kernels/<op>.py` (registered in `_FAST` the first time an
op runs on CUDA, so importing this module never needs Triton); everything else takes
`meshtrain.kernels.reference` (plain torch: the spec and the CPU path).
`MESHTRAIN_KERNELS=reference` forces the reference everywhere; `=triton` makes a missing Triton
kernel an error instead of a silent fallback.

Under torch.compile the same choice is made while Dynamo traces: every Triton op is also a
custom op (`meshtrain::<op>`, registered by its module) that Dynamo records as one opaque
node, so a compiled model calls the Triton kernels without a graph break (on a GPU build a
`triton_op`: Inductor launches the kernels from its own code). `auto` takes an op's Triton
kernel inside a compiled region only if the op is in the compiled set (`set_mode`'s
`compiled_ops`; every op unless narrowed); anything else there gets the reference, which
Inductor then fuses itself.
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import importlib
import os
from collections.abc import Callable

import torch

from meshtrain.kernels import reference

OPS = ("rms_norm", "layer_norm", "gelu", "swiglu", "rope", "cross_entropy", "linear_cross_entropy")

# op -> module holding its Triton implementation (a function of the same name).
_TRITON_MODULES = {
    "rms_norm": "meshtrain.kernels.rms_norm",
    "layer_norm": "meshtrain.kernels.layer_norm",
    "gelu": "meshtrain.kernels.gelu",
    "swiglu": "meshtrain.kernels.swiglu",
    "rope": "meshtrain.kernels.rope",
    "cross_entropy": "meshtrain.kernels.cross_entropy",
    "linear_cross_entropy": "meshtrain.kernels.linear_cross_entropy",
    "fp8_amax": "meshtrain.kernels.fp8_cast",
    "fp8_cast_transpose": "meshtrain.kernels.fp8_cast",
    "rms_norm_fp8": "meshtrain.kernels.norm_fp8",
    "layer_norm_fp8": "meshtrain.kernels.norm_fp8",
    "swiglu_fp8": "meshtrain.kernels.activation_fp8",
    "gelu_fp8": "meshtrain.kernels.activation_fp8",
}

FP8_OPS = ("fp8_amax", "fp8_cast_transpose")
"""The FP8 casts of FP8 training. Not in `OPS`: under torch.compile they take their Triton
kernel whatever `compiled_ops` holds, because Inductor's fusion of the reference is the amax,
cast and transposing copy as separate passes that the kernel exists to merge."""

FP8_OUTPUT_OPS = ("rms_norm_fp8", "layer_norm_fp8", "swiglu_fp8", "gelu_fp8")
"""A norm or an activation that also writes the FP8 copy of its output (and its amax) for the
FP8 linear after it. Eager only: the FP8 layers call them outside compiled regions, where
Inductor fuses the plain op and the cast itself."""

# ops that take their Triton kernel inside a compiled region in 'auto' mode (set_mode narrows it)
_compiled_ops: frozenset[str] = frozenset(OPS)

# op name -> Triton implementation, filled lazily by `_load_fast`.
_FAST: dict[str, Callable] = {}
_fast_loaded = False


def triton_available() -> bool:
    """Whether Triton can be imported here (it is an optional, GPU-side dependency)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Dynamo runs this at trace time instead of tracing it (imports are not traceable); it
# returns nothing the graph depends on, `_FAST` is read afterwards.
@torch.compiler.assume_constant_result
def _load_fast() -> bool:
    """Register every Triton kernel in `_FAST`; a no-op (empty registry) without Triton."""
    global _fast_loaded
    if _fast_loaded:
        return True
    _fast_loaded = True
    if triton_available():
        for op, module in _TRITON_MODULES.items():
            _FAST[op] = getattr(importlib.import_module(module), op)
    return True


_MODES = ("auto", "reference", "triton")
_configured = "auto"  # set by the trainer from train.kernels; MESHTRAIN_KERNELS overrides it


def set_mode(value: str, compiled_ops: frozenset[str] | set[str] | None = None) -> None:
    """Set the process's dispatch mode ('auto', 'reference' or 'triton'), e.g. from a config.

    `compiled_ops`: in 'auto' mode, the ops that take their Triton kernel inside a
    torch.compile region (the rest get the reference there); None: every op.
    A change of either resets torch.compile's caches (torch.compiler.reset()), so that no graph
    compiled under the old choice is reused; setting the same choice again keeps them.
    """
    global _configured, _compiled_ops
    if value not in _MODES:
        raise ValueError(f"kernel mode {value!r}; allowed: {', '.join(_MODES)}")
    ops = frozenset(OPS if compiled_ops is None else compiled_ops)
    if ops - set(OPS):
        raise ValueError(
            f"no compiled Triton op {min(ops - set(OPS))!r}; the ops are {', '.join(OPS)}"
        )
    if (value, ops) != (_configured, _compiled_ops):
        # A compiled graph reads mode() once, while it is traced, and bakes the choice in without
        # a guard: graphs compiled under the old choice would go on being reused. Drop them.
        torch.compiler.reset()
    _configured, _compiled_ops = value, ops


def configured() -> tuple[str, frozenset[str]]:
    """What `set_mode` last chose: (mode, the ops on Triton inside compiled regions)."""
    return _configured, _compiled_ops


@torch.compiler.assume_constant_result  # read once per trace; the graph bakes in the choice
def mode() -> str:
    """The dispatch mode: $MESHTRAIN_KERNELS if set, else what `set_mode` chose ('auto' by
    default)."""
    value = os.environ.get("MESHTRAIN_KERNELS", _configured)
    if value not in _MODES:
        raise ValueError(f"MESHTRAIN_KERNELS={value!r}; allowed: auto, reference, triton")
    return value


def resolve(op: str, on_cuda: bool) -> Callable:
    """The implementation of `op` for tensors on CUDA (`on_cuda`) or elsewhere."""
    m = mode()
    if m == "reference" or (m == "auto" and not on_cuda):
        return getattr(reference, op)
    if m == "auto" and op in OPS and op not in _compiled_ops and torch.compiler.is_compiling():
        return getattr(reference, op)
    if on_cuda:
        _load_fast()
        if op in _FAST:
            return _FAST[op]
    if m == "triton":
        env = os.environ.get("MESHTRAIN_KERNELS")
        source = f"MESHTRAIN_KERNELS={env}" if env else "kernel mode 'triton' (train.kernels)"
        if not on_cuda:
            why = "its tensors are not on a CUDA device (the Triton kernels run on CUDA only)"
        elif not triton_available():
            why = "Triton is not installed here (pip install triton)"
        else:
            why = "it has no Triton kernel"
        raise RuntimeError(
            f"{source}, but op {op!r} cannot run on Triton: {why}; use 'auto' or 'reference'"
        )
    return getattr(reference, op)


def _dispatching(op: str) -> Callable:
    ref = getattr(reference, op)

    def call(x: torch.Tensor, *args, **kwargs):
        return resolve(op, x.is_cuda)(x, *args, **kwargs)

    call.__name__ = op
    call.__doc__ = ref.__doc__
    return call


rms_norm = _dispatching("rms_norm")
layer_norm = _dispatching("layer_norm")
gelu = _dispatching("gelu")
swiglu = _dispatching("swiglu")
rope = _dispatching("rope")
cross_entropy = _dispatching("cross_entropy")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    **kwargs,
):
    impl = resolve("linear_cross_entropy", hidden.is_cuda)
    if impl is reference.linear_cross_entropy:
        # the plain projection, then whichever cross-entropy this place takes: under
        # torch.compile, 'auto' may hold cross_entropy alone in the compiled set, and its
        # Triton kernel should then run on these logits
        return impl(hidden, weight, labels, loss_mask, vocab_size, ce=cross_entropy)
    return impl(hidden, weight, labels, loss_mask, vocab_size, **kwargs)


linear_cross_entropy.__doc__ = reference.linear_cross_entropy.__doc__
rope_cos_sin = reference.rope_cos_sin
fp8_amax = _dispatching("fp8_amax")
fp8_cast_transpose = _dispatching("fp8_cast_transpose")
rms_norm_fp8 = _dispatching("rms_norm_fp8")
layer_norm_fp8 = _dispatching("layer_norm_fp8")
swiglu_fp8 = _dispatching("swiglu_fp8")
gelu_fp8 = _dispatching("gelu_fp8")
