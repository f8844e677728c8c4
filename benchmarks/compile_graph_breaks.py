"""How torch.compile sees the (tensor-parallel) model: graphs and graph breaks per forward.

    torchrun --nproc-per-node 2 benchmarks/compile_graph_breaks.py --tp 2 [--sequence-parallel]
    python benchmarks/compile_graph_breaks.py            # tp=1 reference

Runs `torch._dynamo.explain` on a small Llama-style model (CPU, gloo when distributed) and
prints the graph count, the graph-break count and the distinct break reasons: a compiled
model that breaks at every communication region runs as many small graphs, which is where
the TP=2 throughput gap on the H200 is expected to come from.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer.config import ModelConfig  # noqa: E402
from services.trainer.model.gpt import GPT  # noqa: E402
from services.trainer.parallel.mesh import Mesh, init_process_group  # noqa: E402
from services.trainer.parallel.tensor import parallelize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--async-grad-reduce", action="store_true", help="parallel.tp_async_grad_reduce")
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    init_process_group("gloo")
    mesh = Mesh.build(tp=args.tp) if dist.is_initialized() else Mesh.single()
    cfg = ModelConfig(num_layers=args.layers, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      seq_length=64, vocab_size=1000, normalization="rmsnorm", activation="swiglu",
                      position_embedding_type="rope", add_bias_linear=False,
                      untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    model = parallelize(GPT(cfg), mesh, args.sequence_parallel, async_grad_reduce=args.async_grad_reduce)
    tokens = torch.randint(0, 1000, (2, 64))
    explanation = torch._dynamo.explain(model)(tokens, tokens)
    reasons = collections.Counter(str(b.reason).splitlines()[0][:110] for b in explanation.break_reasons)
    if mesh.rank == 0:
        print(f"tp={args.tp} sequence_parallel={args.sequence_parallel} "
              f"async_grad_reduce={args.async_grad_reduce} layers={args.layers}: "
              f"{explanation.graph_count} graphs, {explanation.graph_break_count} graph breaks")
        for reason, n in reasons.most_common():
            print(f"  {n:3d} x {reason}")


if __name__ == "__main__":
    main()
