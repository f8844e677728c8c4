"""What full recompute keeps under torch.compile, against eager, on CPU.

    python benchmarks/recompute_compile_memory.py --layers 8 --seq 1024 --out memory.json

A small Llama-shaped model (RMSNorm, SwiGLU, RoPE, GQA; fp32), one forward + backward per
variant after a warm-up, all in one process: eager without recompute, eager full recompute (the
baseline), the model compiled whole with full recompute (`torch.compile(model)`, what
train.compile ran before), the blocks compiled one by one behind their checkpoints
(`build.compile_model`, what train.compile runs now), and selective recompute eager and compiled
whole. Reports the bytes autograd saves for backward (`saved_bytes`: an outer saved-tensors hook,
which sees a compiled graph's `ctx.save_for_backward` too; parameters not counted) and the step's
peak (`peak_allocated_bytes`: the CPU allocator's allocation and free events from the profiler,
which also see the buffers Inductor's generated backward allocates), each with its ratio to the
baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.common.model_config import ModelConfig  # noqa: E402
from meshtrain.services.trainer.build import compile_model  # noqa: E402
from meshtrain.services.trainer.config.parallel import ParallelConfig  # noqa: E402
from meshtrain.services.trainer.config.sections import TrainConfig  # noqa: E402
from meshtrain.services.trainer.model.gpt import GPT  # noqa: E402
from meshtrain.services.trainer.parallel import recompute  # noqa: E402

# name: (recompute plan, how the model is compiled: None, "whole" or "compile_model")
VARIANTS = {
    "eager none": ({}, None),
    "eager full": ({"recompute_granularity": "full"}, None),
    "compiled whole, full": ({"recompute_granularity": "full"}, "whole"),
    "compiled per block, full": ({"recompute_granularity": "full"}, "compile_model"),
    "eager selective": ({"recompute_granularity": "selective"}, None),
    "compiled whole, selective": ({"recompute_granularity": "selective"}, "whole"),
}
BASELINE = "eager full"


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn()` runs, those of
    `exclude` (e.g. the parameters, held anyway) not counted. A non-reentrant checkpoint's own
    hook hides what its region saves, as the checkpoint drops it."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held above its level at the start, while `fn()` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:  # + an allocation, - a free
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(config: ModelConfig, plan: dict, how: str | None, backend: str) -> dict:
    """Saved bytes, step peak and loss of one variant (after a warm-up step that compiles)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    parallel = ParallelConfig(**plan)
    model = recompute.apply(GPT(config), parallel)
    run: torch.nn.Module = model
    if how == "whole":
        run = torch.compile(model, backend=backend)
    elif how == "compile_model":
        if backend != "inductor":  # compile_model compiles with Inductor, as train.compile does
            raise SystemExit("the per-block variant runs Inductor: pass --backend inductor")
        run = compile_model(model, TrainConfig(compile=True), None, parallel, pipelined=False)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size or 1, (1, config.seq_length), generator=gen)
    labels = tokens.roll(-1, 1)

    def step() -> float:
        loss = run(tokens, labels)
        loss.backward()
        return loss.item()

    step()
    exclude = list(model.parameters()) + list(model.buffers())
    kept = saved_bytes(lambda: run(tokens, labels), exclude)
    # the .grads freed before the profiler starts: it drops frees of blocks older than itself
    model.zero_grad(set_to_none=True)
    losses: list[float] = []
    peak = peak_allocated_bytes(lambda: losses.append(step()))
    return {"saved_bytes": kept, "peak_bytes": peak, "loss": losses[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--backend", default="inductor", help="the whole-model compile's backend")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default="recompute_compile_memory.json")
    args = p.parse_args()
    config = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=args.seq,
        vocab_size=128,
        normalization="rmsnorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )
    names = [BASELINE] + [n for n in args.variants if n != BASELINE]
    result: dict = {"args": vars(args), "torch": torch.__version__, "variants": {}}
    for name in names:
        plan, how = VARIANTS[name]
        row = measure(config, plan, how, args.backend)
        base = result["variants"].get(BASELINE, row)
        row["saved_vs_eager_full"] = row["saved_bytes"] / base["saved_bytes"]
        row["peak_vs_eager_full"] = row["peak_bytes"] / base["peak_bytes"]
        result["variants"][name] = row
        print(
            f"{name:28s} saved {row['saved_bytes'] / 2**20:7.2f} MiB "
            f"({row['saved_vs_eager_full']:.2f}x)  step peak {row['peak_bytes'] / 2**20:7.2f} MiB "
            f"({row['peak_vs_eager_full']:.2f}x)  loss {row['loss']:.6f}",
            flush=True,
        )
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
