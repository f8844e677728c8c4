"""TP's all-reduce in isolation: NCCL against PyTorch's symmetric-memory all-reduces.

TP=2 on llama-1b all-reduces a (micro-batch x seq x hidden) bf16 activation four times per
block and micro-batch (32 MB at micro-batch 4). In the profiles (BENCHMARKS.md) NCCL's ring
took about 0.15 ms for each, about 210 GB/s, under half the NVLink bandwidth. This times, per
message size:

    nccl        dist.all_reduce on a plain tensor (the trainer's path); NCCL's environment
                (NCCL_PROTO, NCCL_MIN_NCHANNELS, ...) applies, so run it once per setting
    one-shot    torch.ops.symm_mem.one_shot_all_reduce_out: each rank reads every peer's
                buffer over NVLink (peer loads, no multicast) and adds
    two-shot    torch.ops.symm_mem.two_shot_all_reduce_: reduce-scatter then all-gather
                through peer memory
    meshtrain   the trainer's op for parallel.tp_reduce_impl='symm_mem'
                (services/trainer/parallel/symm_reduce.py): two-shot into a fresh output
    low-cont    PyTorch's "low-contention" reduce-scatter + all-gather: the peer transfers are
                copies (copy engines, not SMs), only the local sum is a kernel

With `--beside-gemm M K N` each is also timed launched beside a GEMM on the current stream
(the symmetric-memory kernels on a side stream, NCCL on its own): what the async input-gradient
all-reduce meets in training, where the profiles show the GEMMs slowing by about as much as the
all-reduce they hide. Run it under the trainer's streams settings (CUDA_DEVICE_MAX_CONNECTIONS=1
TORCH_NCCL_HIGH_PRIORITY=1) to compare with those rows.

The symmetric-memory rows include the copy into the symmetric buffer (the trainer's tensors
are not allocated there). Every row's result is checked against the exact sum before it is
timed. CUDA only (symmetric memory has no CPU backend); `--device cpu` runs the nccl row on
gloo with 4096 elements for each `--mb` given (the sizes are not scaled), a check that the
script works, not a measurement.

    torchrun --standalone --nproc-per-node 2 benchmarks/allreduce_bench.py --out ar.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tp_overlap_ops import time_ms


def _exact_sum(n: int, world: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input and the all-reduced sum, in values whose bf16 sum is exact."""
    rank = dist.get_rank()
    base = torch.arange(n, device=device, dtype=torch.float32).remainder_(64)
    x = (base + rank).to(dtype)
    want = (base * world + sum(range(world))).to(dtype)
    return x, want


class Variant:
    """One all-reduce: launch() starts it (maybe on another stream), finish(h) waits and returns the sum."""

    def __init__(self, name: str, launch, finish):
        self.name, self.launch, self.finish = name, launch, finish

    def __call__(self) -> torch.Tensor:
        return self.finish(self.launch())


def _on_side_stream(name: str, fn, device: torch.device) -> Variant:
    """A variant whose kernels run on the current stream, moved to a side stream so it can run beside a GEMM."""
    if device.type != "cuda":
        return Variant(name, fn, lambda out: out)
    side = torch.cuda.Stream(device)

    def launch():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            return fn()

    def finish(out):
        torch.cuda.current_stream().wait_stream(side)
        return out

    return Variant(name, launch, finish)


def variants(n: int, device: torch.device, dtype: torch.dtype, group_name: str | None) -> list[Variant]:
    """The all-reduces compared, on this rank's input of `n` elements."""
    x, _ = _exact_sum(n, dist.get_world_size(), device, dtype)
    buf = x.clone()

    def nccl_launch():
        buf.copy_(x)
        return dist.all_reduce(buf, async_op=True)  # on NCCL's own stream

    def nccl_finish(work):
        work.wait()
        return buf

    out = [Variant("nccl", nccl_launch, nccl_finish)]
    if group_name is None:
        return out
    import torch.distributed._symmetric_memory as symm_mem

    sym = symm_mem.empty(n, dtype=dtype, device=device)
    symm_mem.rendezvous(sym, group_name)
    res = torch.empty_like(x)

    def one_shot():
        sym.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(sym, "sum", group_name, res)

    def two_shot():
        sym.copy_(x)
        return torch.ops.symm_mem.two_shot_all_reduce_(sym, "sum", group_name)

    from meshtrain.services.trainer.parallel.symm_reduce import symm_all_reduce

    def trainer_op():
        return symm_all_reduce(x, group_name)

    def low_contention_launch():
        # reduce-scatter (peer writes by copy engine, then a local sum), all-gather (peer reads by
        # copy engine): both on PyTorch's symmetric-memory backend stream, waited for like funcol's
        rs = torch.ops.symm_mem._low_contention_reduce_scatter(x, "sum", group_name)
        return torch.ops.symm_mem._low_contention_all_gather(rs, group_name)

    def low_contention_finish(ag):
        return torch.ops._c10d_functional.wait_tensor(ag)

    return out + [_on_side_stream("one-shot", one_shot, device), _on_side_stream("two-shot", two_shot, device),
                  _on_side_stream("meshtrain", trainer_op, device),
                  Variant("low-cont", low_contention_launch, low_contention_finish)]


def beside_gemm(v: Variant, gemm, device: torch.device, iters: int, rounds: int) -> float:
    """ms per iteration of: launch the all-reduce, run the GEMM on the current stream, wait."""
    def step():
        h = v.launch()
        gemm()
        v.finish(h)

    return time_ms(step, device, iters, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mb", type=float, nargs="+", default=[8, 16, 32, 64],
                   help="message sizes in MiB of bf16 (default: 8 16 32 64)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--label", default="", help="a name for the NCCL setting this run is under (default: the "
                   "NCCL_* variables set; all of them are recorded in the JSON)")
    p.add_argument("--beside-gemm", type=int, nargs=3, metavar=("M", "K", "N"),
                   help="also time each all-reduce launched beside a bf16 (M x K) @ (K x N) GEMM on the "
                        "current stream, e.g. 5632 8192 2048: llama-1b's fc1 weight gradient at TP=2, "
                        "micro-batch 4, the GEMM the async input-gradient all-reduce hides behind")
    p.add_argument("--out", help="write the results as JSON here (rank 0)")
    a = p.parse_args()

    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group_name = None
    if device.type == "cuda":
        group_name = dist.group.WORLD.group_name
    dtype = torch.bfloat16
    gemm, gemm_ms = None, None
    if a.beside_gemm:
        m, k, n_ = a.beside_gemm
        gen = torch.Generator(device="cpu").manual_seed(0)
        ga = torch.randn(m, k, generator=gen).to(device, dtype)
        gb = torch.randn(k, n_, generator=gen).to(device, dtype)
        gc = torch.empty(m, n_, device=device, dtype=dtype)

        def gemm():
            torch.mm(ga, gb, out=gc)

        gemm_ms = time_ms(gemm, device, a.iters, a.rounds)
    rows = []
    for mb in a.mb:
        n = int(mb * 2**20) // 2 if device.type == "cuda" else 4096
        _, want = _exact_sum(n, world, device, dtype)
        for v in variants(n, device, dtype, group_name):
            got = v()
            if not torch.equal(got, want):
                raise SystemExit(f"{v.name} at {mb} MiB: wrong sum (max error "
                                 f"{(got.float() - want.float()).abs().max().item()})")
            ms = time_ms(v, device, a.iters, a.rounds)
            nbytes = n * 2
            row = {"variant": v.name, "mib": nbytes / 2**20, "ms": ms, "algbw_gbs": nbytes / ms / 1e6,
                   "busbw_gbs": nbytes / ms / 1e6 * 2 * (world - 1) / world}
            if gemm is not None:
                row["beside_gemm_ms"] = beside_gemm(v, gemm, device, a.iters, a.rounds)
                got = v()
                if not torch.equal(got, want):
                    raise SystemExit(f"{v.name} at {mb} MiB beside the GEMM: wrong sum")
            rows.append(row)
    if rank == 0:
        nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
        setting = a.label or " ".join(f"{k}={v}" for k, v in nccl_env.items()) or "default"
        print(f"all-reduce, {world} ranks, bf16, NCCL setting: {setting}")
        if gemm is not None:
            print(f"beside a {'x'.join(map(str, a.beside_gemm))} GEMM (m x k x n) taking {gemm_ms:.4f} ms alone; "
                  "hidden: the share of the all-reduce's time that the pair saves over running both in turn")
        print(f"{'variant':<10} {'MiB':>6} {'ms':>8} {'algbw GB/s':>11} {'busbw GB/s':>11}"
              + (f" {'with GEMM':>10} {'hidden':>7}" if gemm is not None else ""))
        for r in rows:
            line = f"{r['variant']:<10} {r['mib']:>6g} {r['ms']:>8.4f} {r['algbw_gbs']:>11.1f} {r['busbw_gbs']:>11.1f}"
            if gemm is not None:
                r["hidden"] = (gemm_ms + r["ms"] - r["beside_gemm_ms"]) / r["ms"]
                line += f" {r['beside_gemm_ms']:>10.4f} {r['hidden']:>7.0%}"
            print(line)
        nccl = {r["mib"]: r["ms"] for r in rows if r["variant"] == "nccl"}
        for r in rows:
            r["speedup_vs_nccl"] = nccl[r["mib"]] / r["ms"]
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"world": world, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "setting": setting, "nccl_env": nccl_env,
                           "gemm": a.beside_gemm and {"m_k_n": a.beside_gemm, "ms": gemm_ms},
                           "torch": torch.__version__, "rows": rows,
                           "median_speedup": {v: statistics.median(r["speedup_vs_nccl"] for r in rows if r["variant"] == v)
                                              for v in {r["variant"] for r in rows}}}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
