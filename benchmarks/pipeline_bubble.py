"""The pipeline bubble, measured: per-action timelines of a training step on CPU ranks.

    python benchmarks/pipeline_bubble.py --out bubble.json --png-dir plots/ \
        --pp 2 4 --micro 4 8 --schedules gpipe 1f1b interleaved zb-h1

For each (schedule, pp, m) it starts pp gloo processes (one thread each, so put it on a machine with
at least pp free cores), builds a GPT whose blocks dominate the step (a small vocabulary, so the
first and last stage do little besides their blocks), splits it into stages and runs the real
`PipelineRuntime` with every action timed. From the median of `--steps` steps (after a warm-up step)
it reports, per rank, the bubble as idle time over busy time ((makespan - busy) / busy, Megatron's
bubble ratio: (p-1)/m for 1F1B, (p-1)/(v*m) interleaved) and against the slowest stage's compute
(makespan / its busy time - 1: stages are not equally heavy, the last also computes the loss), next
to the ideal, and on stage 0 the peak number of micro-batches in flight and the peak bytes of
activations saved for backward (tensors autograd keeps, parameters excluded). A PNG per run draws
the step's timeline, one row per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COMPUTE = ("F", "B", "I", "W")


class SavedBytes:
    """Bytes of tensors autograd saves for backward and still holds (parameters excluded)."""

    def __init__(self, params):
        self.params = {p.data_ptr() for p in params}
        self.live = self.peak = 0

    def hooks(self):
        def pack(t):
            if t.data_ptr() in self.params:
                return t
            n = t.numel() * t.element_size()
            self.live += n
            self.peak = max(self.peak, self.live)
            holder = _Held(t)
            weakref.finalize(holder, self._release, n)
            return holder

        def unpack(h):
            return h.t if isinstance(h, _Held) else h

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _release(self, n):
        self.live -= n


class _Held:
    def __init__(self, t):
        self.t = t


def _rank(rank, world, store, cfg, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from meshtrain.services.common.model_config import ModelConfig
    from meshtrain.services.trainer.config.parallel import ParallelConfig
    from meshtrain.services.trainer.model.gpt import GPT
    from meshtrain.services.trainer.parallel.mesh import Mesh
    from meshtrain.services.trainer.parallel.pipeline.engine import _defer_weight_grads
    from meshtrain.services.trainer.parallel.pipeline.runtime import PipelineRuntime
    from meshtrain.services.trainer.parallel.pipeline.stage import PipelineStage, stage_layers
    from meshtrain.services.trainer.parallel.pipeline.zero_bubble import WeightGradStore

    pp, v, m = world, cfg["virtual"], cfg["micro"]
    mesh = Mesh.build(pp=pp)
    layers = pp * v * cfg["layers_per_stage"]
    mc = ModelConfig(
        num_layers=layers,
        hidden_size=cfg["hidden"],
        num_attention_heads=cfg["heads"],
        seq_length=cfg["seq"],
        vocab_size=cfg["vocab"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    stage = PipelineStage(
        GPT(mc), mesh.pp_rank, pp, stage_layers(layers, pp, v), ParallelConfig(pp=pp)
    )
    store = None
    if cfg["schedule"] == "zb-h1":
        store = WeightGradStore()
        _defer_weight_grads(stage, store)
    mb, seq = cfg["micro_batch"], cfg["seq"]
    runtime = PipelineRuntime(
        stage,
        mesh,
        cfg["schedule"],
        m,
        (mb, seq, cfg["hidden"]),
        torch.float32,
        torch.device("cpu"),
        weight_store=store,
    )
    g = torch.Generator().manual_seed(1)
    micro = [
        (
            torch.randint(0, cfg["vocab"], (mb, seq), generator=g),
            torch.randint(0, cfg["vocab"], (mb, seq), generator=g),
            torch.ones(mb, seq),
        )
        for _ in range(m)
    ]
    saved = SavedBytes(list(stage.parameters()))
    timelines = []
    for i in range(cfg["steps"] + 1):  # the first is a warm-up
        runtime.record = i > 0
        dist.barrier()
        with saved.hooks():
            runtime.step(micro)
        for p in stage.parameters():
            p.grad = None
        if i > 0:
            timelines.append([(str(a), a.kind, s, e) for a, s, e in runtime.timeline])
    out = {
        "rank": rank,
        "timelines": timelines,
        "peak_in_flight": runtime.peak_in_flight,
        "peak_saved_bytes": saved.peak,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def measure(cfg: dict) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="bubble-"), "store")
    procs = [
        ctx.Process(target=_rank, args=(r, cfg["pp"], store, cfg, queue)) for r in range(cfg["pp"])
    ]
    for p in procs:
        p.start()
    ranks = queue.get(timeout=1200)
    for p in procs:
        p.join()
    p, m, v = cfg["pp"], cfg["micro"], cfg["virtual"]
    ideal = (p - 1) / (v * m) if cfg["schedule"] in ("1f1b", "interleaved", "gpipe") else None
    steps = []
    for k in range(cfg["steps"]):
        lines = {r["rank"]: r["timelines"][k] for r in ranks}
        start = min(s for tl in lines.values() for _, _, s, _ in tl)
        makespan = max(e for tl in lines.values() for _, _, _, e in tl) - start
        busy = [sum(e - s for _, kind, s, e in lines[r] if kind in COMPUTE) for r in sorted(lines)]
        bubbles = [(makespan - b) / b for b in busy]
        steps.append(
            {
                "makespan_s": makespan,
                "bubble_ratio_per_rank": bubbles,
                "bubble_ratio_mean": sum(bubbles) / len(bubbles),
                # against the slowest stage's compute: what the step loses to the schedule
                # when stages are not equally heavy (the last one also computes the loss)
                "bubble_ratio_bottleneck": makespan / max(busy) - 1,
                "timeline": {
                    r: [(n, s - start, e - start) for n, _, s, e in tl] for r, tl in lines.items()
                },
            }
        )
    # the median step by its mean bubble (CPU ranks share caches and memory bandwidth: steps vary)
    steps.sort(key=lambda st: st["bubble_ratio_mean"])
    median = steps[len(steps) // 2]
    result = {
        **cfg,
        **median,
        "ideal_bubble_ratio": ideal,
        "bubble_ratio_mean_all_steps": [st["bubble_ratio_mean"] for st in steps],
        "peak_in_flight_stage0": ranks[0]["peak_in_flight"],
        "peak_saved_mb_stage0": ranks[0]["peak_saved_bytes"] / 2**20,
    }
    if ideal:
        result["bottleneck_over_ideal"] = result["bubble_ratio_bottleneck"] / ideal
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#DD8452"}
    fig, ax = plt.subplots(figsize=(12, 0.6 * result["pp"] + 1.2))
    for rank, actions in result["timeline"].items():
        for name, s, e in actions:
            kind = name.rstrip("0123456789.")
            ax.broken_barh(
                [(s, e - s)],
                (int(rank) - 0.4, 0.8),
                color=colors.get(kind, "#BBBBBB"),
                edgecolor="white",
                linewidth=0.3,
            )
            if kind in colors and e - s > result["makespan_s"] / 60:
                ax.text(
                    (s + e) / 2,
                    int(rank),
                    name.split(".")[0][len(kind) :],
                    ha="center",
                    va="center",
                    fontsize=6,
                )
    ax.set_yticks(range(result["pp"]), [f"rank {r}" for r in range(result["pp"])])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (F blue, B/I green, W orange, communication grey)")
    ax.set_title(
        f"{result['schedule']} pp={result['pp']} v={result['virtual']} m={result['micro']}: "
        f"bubble ratio {result['bubble_ratio_mean']:.3f}, "
        f"bottleneck {result['bubble_ratio_bottleneck']:.3f}"
        + (f" (ideal {result['ideal_bubble_ratio']:.3f})" if result["ideal_bubble_ratio"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--png-dir")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb-h1"])
    ap.add_argument("--virtual", type=int, default=2, help="chunks per rank for 'interleaved'")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--layers-per-stage", type=int, default=2, help="blocks per virtual stage")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    results = []
    for pp in args.pp:
        for m in args.micro:
            for schedule in args.schedules:
                v = args.virtual if schedule == "interleaved" else 1
                layers_per_stage = (
                    args.layers_per_stage // v
                    if schedule == "interleaved"
                    else args.layers_per_stage
                )
                cfg = {
                    "schedule": schedule,
                    "pp": pp,
                    "micro": m,
                    "virtual": v,
                    "hidden": args.hidden,
                    "heads": args.heads,
                    "seq": args.seq,
                    "vocab": args.vocab,
                    "micro_batch": args.micro_batch,
                    "layers_per_stage": max(layers_per_stage, 1),
                    "threads": args.threads,
                    "steps": args.steps,
                }
                r = measure(cfg)
                print(
                    f"{schedule:12s} pp={pp} v={v} m={m}: bubble {r['bubble_ratio_mean']:.3f} "
                    f"(bottleneck {r['bubble_ratio_bottleneck']:.3f}) "
                    "(ideal "
                    f"{r['ideal_bubble_ratio'] if r['ideal_bubble_ratio'] is not None else '-'}) "
                    f"in flight {r['peak_in_flight_stage0']}, "
                    f"saved {r['peak_saved_mb_stage0']:.1f} MB, "
                    f"step {r['makespan_s']:.2f} s",
                    flush=True,
                )
                if args.png_dir:
                    os.makedirs(args.png_dir, exist_ok=True)
                    plot(r, os.path.join(args.png_dir, f"bubble-{schedule}-pp{pp}-v{v}-m{m}.png"))
                results.append(r)
    with open(args.out, "w") as f:
        json.dump(
            {"cpus": os.cpu_count(), "torch": torch.__version__, "results": results}, f, indent=1
        )


if __name__ == "__main__":
    main()
