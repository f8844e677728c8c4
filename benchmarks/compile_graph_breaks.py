"""How torch.compile sees the (tensor-parallel) model: graphs and graph breaks per forward.

    torchrun --nproc-per-node 2 benchmarks/compile_graph_breaks.py --tp 2 [--sequence-parallel]
        [--async-grad-reduce] [--op-order]
    python benchmarks/compile_graph_breaks.py            # tp=1 reference
    python benchmarks/compile_graph_breaks.py --moe      # mixture of experts, one process
    torchrun --nproc-per-node 2 benchmarks/compile_graph_breaks.py --moe --ep 2
        [--capacity-factor 1.0] [--fp8-experts]
    python benchmarks/compile_graph_breaks.py --moe --expert-grad-fusion [--fp8-experts]

Runs `torch._dynamo.explain` on a small Llama-style model (CPU, gloo when distributed) and
prints the graph count, the graph-break count and the distinct break reasons: a compiled
model that breaks at every communication region runs as many small graphs, which is where
the TP=2 throughput gap on the H200 is expected to come from. `--moe` makes every block a
mixture of experts (8 experts, top-2, load-balancing and z-losses; `--capacity-factor` for
token dropping), `--ep` splits the experts over that many ranks, `--fp8-experts` runs their
grouped GEMMs in FP8 (train.fp8_experts; on the CPU the emulation's custom op).
`--expert-grad-fusion` (one process) runs the model on bf16 weight copies under bf16 autocast
with train.expert_gradient_accumulation_fusion, and also compiles it with fullgraph and runs a
backward, where the per-expert accumulation into the fp32 gradients runs.

`--op-order` also prints, for the forward and backward, the order of the collective launches
(`AR`, `RS`, `AG`), their waits (`w`) and the matmuls (`mm`), both in the AOT graphs and in
the code Inductor generates from them (after fusion, which can move waits up): where a launch
and its wait have matmuls between them, the collective can overlap that compute.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.common.model_config import ModelConfig  # noqa: E402
from meshtrain.services.trainer.fp8.convert import convert_experts  # noqa: E402
from meshtrain.services.trainer.model.gpt import GPT  # noqa: E402
from meshtrain.services.trainer.parallel.expert import parallelize_experts  # noqa: E402
from meshtrain.services.trainer.parallel.mesh import Mesh, init_process_group  # noqa: E402
from meshtrain.services.trainer.parallel.tensor import parallelize  # noqa: E402
from meshtrain.services.trainer.weight_copies import WeightCopies, call_with  # noqa: E402


def _parse_args() -> argparse.Namespace:
    """The command line, its combinations checked."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--async-grad-reduce", action="store_true", help="parallel.tp_async_grad_reduce")
    p.add_argument(
        "--op-order", action="store_true", help="print collectives / waits / matmuls in graph order"
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--moe", action="store_true", help="mixture-of-experts blocks")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (with --moe)")
    p.add_argument(
        "--fp8-experts", action="store_true", help="FP8 grouped expert GEMMs (with --moe)"
    )
    p.add_argument(
        "--capacity-factor", type=float, default=None, help="model.moe_expert_capacity_factor"
    )
    p.add_argument(
        "--expert-grad-fusion",
        action="store_true",
        help="train.expert_gradient_accumulation_fusion on bf16 weight copies (with --moe)",
    )
    args = p.parse_args()
    if (args.ep > 1 or args.capacity_factor is not None or args.fp8_experts) and not args.moe:
        p.error("--ep, --capacity-factor and --fp8-experts need --moe")
    if args.expert_grad_fusion and not (args.moe and args.tp == args.ep == 1):
        p.error("--expert-grad-fusion needs --moe in one process (the weight copies' layout)")
    return args


def _model(args: argparse.Namespace, mesh: Mesh) -> torch.nn.Module:
    """The small GPT the command line describes, parallelized over `mesh`."""
    moe = (
        dict(
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=64,
            moe_aux_loss_coeff=1e-2,
            moe_z_loss_coeff=1e-3,
            moe_expert_capacity_factor=args.capacity_factor,
        )
        if args.moe
        else {}
    )
    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=64,
        vocab_size=1000,
        normalization="rmsnorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        **moe,
    )
    torch.manual_seed(0)
    model = parallelize(
        GPT(cfg), mesh, args.sequence_parallel, async_grad_reduce=args.async_grad_reduce
    )
    if args.moe:
        model = parallelize_experts(model, mesh)
    if args.fp8_experts:  # the experts alone: the dense FP8 layers are not what is asked
        convert_experts(list(enumerate(model.layers)), margin=0)
    return model


def main() -> None:
    args = _parse_args()
    init_process_group("gloo")
    mesh = Mesh.build(tp=args.tp, ep=args.ep) if dist.is_initialized() else Mesh.single()
    model = _model(args, mesh)
    tokens = torch.randint(0, 1000, (2, 64))
    if args.expert_grad_fusion:
        explanation = explain_fused_experts(model, tokens)
    else:
        explanation = torch._dynamo.explain(model)(tokens, tokens)
    reasons = collections.Counter(
        f"{str(b.reason).splitlines()[0][:80]} at {_where(b)}" for b in explanation.break_reasons
    )
    if mesh.rank == 0:
        print(
            f"tp={args.tp} sequence_parallel={args.sequence_parallel} "
            f"async_grad_reduce={args.async_grad_reduce} layers={args.layers}"
            + (f" moe ep={args.ep} capacity_factor={args.capacity_factor}" if args.moe else "")
            + (" fp8_experts" if args.fp8_experts else "")
            + (" expert_grad_fusion" if args.expert_grad_fusion else "")
            + ": "
            f"{explanation.graph_count} graphs, {explanation.graph_break_count} graph breaks"
        )
        for reason, n in reasons.most_common():
            print(f"  {n:3d} x {reason}")
    if args.op_order:
        for where, graphs in (
            ("AOT graph", op_order(model, tokens, tokens)),
            ("Inductor code", inductor_order(model, tokens, tokens)),
        ):
            if mesh.rank == 0:
                for name, (seq, inflight) in graphs.items():
                    hidden = sum(1 for _, n in inflight if n)
                    print(
                        f"{where}, {name}: {hidden} of {len(inflight)} collectives "
                        f"have matmuls in flight\n  {seq}"
                    )


def explain_fused_experts(model: torch.nn.Module, tokens: torch.Tensor):
    """`torch._dynamo.explain` of the model on bf16 weight copies with the experts' gradients
    added into the fp32 .grads (under bf16 autocast, as the trainer runs it); then one
    fullgraph compile, forward and backward, which fails where the backward could not keep the
    accumulation in its graph."""
    copies = WeightCopies(model, torch.bfloat16, fuse_expert_weight_grads=True)
    run = functools.partial(call_with, model)
    with torch.autocast("cpu", torch.bfloat16):
        explanation = torch._dynamo.explain(run)(copies.copies, tokens, tokens)
        compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
        compiled(copies.copies, tokens, tokens).backward()
    return explanation


def _where(brk) -> str:
    """file:line and source of the user code a graph break is in (its innermost frame)."""
    if not brk.user_stack:
        return "?"
    f = brk.user_stack[-1]
    return f"{Path(f.filename).name}:{f.lineno} {(f.line or '').strip()[:60]}"


SHORT = {
    "all_reduce": "AR",
    "reduce_scatter_tensor": "RS",
    "all_gather_into_tensor": "AG",
    "wait_tensor": "w",
    "mm": "mm",
    "addmm": "mm",
    "bmm": "mm",
}
COLLECTIVES = ("AR", "RS", "AG")
Schedule = tuple[str, list[tuple[str, int]]]


def _schedule(events: list[tuple[str, object]]) -> Schedule:
    """(op, key) events in program order -> the op sequence as a string, and for each
    collective (kind, matmuls between its launch and the wait with the same key)."""
    seq, launched, inflight = [], {}, []
    for op, key in events:
        seq.append(op)
        if op in COLLECTIVES:
            launched[key] = (op, len(seq))
        elif op == "w" and key in launched:
            kind, at = launched.pop(key)
            inflight.append((kind, seq[at:].count("mm")))
    return " ".join(seq), inflight


def op_order(model: torch.nn.Module, *inputs: torch.Tensor) -> dict[str, Schedule]:
    """One compiled forward + backward of `model(*inputs)`, seen as AOT graphs.

    For the forward and the backward graph: the collective launches (AR, RS, AG), waits (w)
    and matmuls (mm) in graph order, as a string, and for each collective (kind, number of
    matmuls between its launch and its wait).
    """
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, Schedule] = {}

    def recorder(name):
        def compile_fn(gm, _inputs):
            events = []
            for node in gm.graph.nodes:
                op = (
                    SHORT.get(getattr(node.target, "__name__", "").split(".")[0])
                    if node.op == "call_function"
                    else None
                )
                if op is not None:
                    events.append((op, node.args[0] if op == "w" else node))
            graphs[name] = _schedule(events)
            return make_boxed_func(gm.forward)

        return compile_fn

    compiled = torch.compile(
        model,
        backend=aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward")),
    )
    compiled(*inputs).backward()
    return graphs


_LAUNCH = re.compile(
    r"(?:(buf\d+) = )?torch\.ops\._c10d_functional\.(all_reduce_|all_reduce|reduce_scatter_tensor|"
    r"all_gather_into_tensor)\.default\((?:reinterpret_tensor\()?(\w+)"
)
_WAIT = re.compile(
    r"torch\.ops\._c10d_functional\.wait_tensor\.default\((?:reinterpret_tensor\()?(\w+)"
)
_MM = re.compile(r"extern_kernels\.(mm|addmm|bmm)\(")
_KINDS = {
    "all_reduce_": "AR",
    "all_reduce": "AR",
    "reduce_scatter_tensor": "RS",
    "all_gather_into_tensor": "AG",
}


def inductor_order(model: torch.nn.Module, *inputs: torch.Tensor) -> dict[str, Schedule]:
    """As `op_order`, but read from the code Inductor generates (after its fusion and
    scheduling), which is what runs: for its forward and backward, the sequence of launches,
    waits and matmuls, and each collective's (kind, matmuls between launch and wait)."""
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(model)
    _, codes = run_and_get_code(lambda: compiled(*inputs).backward())
    out = {}
    for name, code in zip(("forward", "backward"), codes):
        events, buffers = [], set()
        for line in code.splitlines():
            line = line.strip()
            if line.startswith("#"):
                continue
            if m := _LAUNCH.search(line):
                result, op, arg = m.groups()
                buffers.add(result or arg)
                events.append((_KINDS[op], result or arg))
            elif (m := _WAIT.search(line)) and m.group(
                1
            ) in buffers:  # waits of launches seen above
                events.append(("w", m.group(1)))
            elif _MM.search(line):
                events.append(("mm", None))
        out[name] = _schedule(events)
    return out


if __name__ == "__main__":
    main()
