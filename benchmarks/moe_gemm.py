"""Expert GEMMs: meshtrain's grouped GEMM against one dense GEMM of the same FLOPs, and the loop.

    python benchmarks/moe_gemm.py --hidden 2048 --moe-ffn 4096 --experts 8 --topk 2 \
        --tokens 16384 --out moe_gemm.json

For each expert projection of a SwiGLU MoE block (fc1: hidden -> 2*moe_ffn, fc2: moe_ffn ->
hidden), `tokens * topk` rows in expert order go through `model.grouped_gemm.grouped_linear` (one
`torch._grouped_mm` per projection on a Hopper GPU) forward and backward; the baseline, timed in
the same run, is a single dense GEMM of the same rows and the same output width: the same
FLOPs with one weight, the best the grouped kernel could do. Also timed: the loop over experts
(`grouped_linear_loop`, what runs where the grouped kernel cannot). Routing is balanced
(every expert gets tokens*topk/experts rows) and skewed (expert e gets a share proportional to
e+1: the first expert about 1/4.5 as many rows as the last, for 8 experts), bf16.
Reports TFLOP/s of each and the grouped/dense ratio.

With `--fp8` each projection also runs `fp8.experts.fp8_grouped_linear` (train.fp8_experts: the
forward and input-gradient GEMMs as `torch._scaled_grouped_mm` on row-scaled e4m3 operands, the
row quantization of x, W, dy and Wᵀ included in the time; the weight gradient bf16), timed in the
same run as the bf16 grouped GEMMs on the same rows: TFLOP/s (the bf16 FLOP count), the
fp8/bf16-grouped ratio, and the FP8 output's error relative to the bf16 one (norm). The FP8
side runs twice: eager (`fp8_grouped`: each cast a few torch kernels) and under torch.compile
(`fp8_grouped_compiled`: Inductor fuses each cast, as in a train.compile run); a compile that
fails is reported in the JSON (its `error`) and the rest still runs.

    python benchmarks/moe_gemm.py --fp8 --out moe_gemm_fp8.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.trainer.fp8.experts import (  # noqa: E402
    fp8_grouped_linear,
    scaled_grouped_mm_available,
)
from meshtrain.services.trainer.model.grouped_gemm import (  # noqa: E402
    grouped_linear,
    grouped_linear_loop,
)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - start) / iters


def counts_for(rows: int, experts: int, skew: bool) -> torch.Tensor:
    """Rows per expert summing to `rows`: equal, or proportional to e+1."""
    share = (
        torch.arange(1, experts + 1, dtype=torch.float64)
        if skew
        else torch.ones(experts, dtype=torch.float64)
    )
    c = torch.floor(share / share.sum() * rows).long()
    c[-1] += rows - c.sum()
    return c


def measure(
    rows: int,
    k_in: int,
    n_out: int,
    experts: int,
    skew: bool,
    iters: int,
    fp8: bool = False,
    device: str = "cuda",
) -> dict:
    """One projection's sides (see the module doc); `device` "cpu" only for the tests, where
    each side runs its fallback (the loop, the FP8 emulation)."""
    dev = torch.device(device)
    x = torch.randn(rows, k_in, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (
        torch.randn(experts, n_out, k_in, device=dev, dtype=torch.bfloat16) * 0.02
    ).requires_grad_()
    dense_w = (torch.randn(n_out, k_in, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    counts = counts_for(rows, experts, skew).to(dev)
    gy = torch.randn(rows, n_out, device=dev, dtype=torch.bfloat16)
    flops_fwd = 2.0 * rows * k_in * n_out

    def fwd_bwd(f):
        def run():
            y = f()
            torch.autograd.backward(y, gy)

        return run

    grouped = lambda: grouped_linear(x, w, counts, grouped=True)  # noqa: E731
    loop = lambda: grouped_linear_loop(x, w, counts)  # noqa: E731
    dense = lambda: x @ dense_w.t()  # noqa: E731
    with torch.no_grad():
        diff = (
            grouped_linear(x, w, counts, True).float() - grouped_linear_loop(x, w, counts).float()
        )
        err = diff.abs().max().item()
    out = {"rows": rows, "k": k_in, "n": n_out, "skew": skew, "max_abs_err_vs_loop": err}
    sides = [("grouped", grouped), ("dense", dense), ("loop", loop)]
    if fp8:
        fp8_grouped = lambda: fp8_grouped_linear(x, w, counts, grouped=True)  # noqa: E731
        compiled = torch.compile(fp8_grouped_linear, dynamic=False)
        sides.append(("fp8_grouped", fp8_grouped))
        sides.append(("fp8_grouped_compiled", lambda: compiled(x, w, counts, True)))
        with torch.no_grad():
            ref = grouped_linear(x, w, counts, True).float()
            out["fp8_rel_err_vs_bf16"] = ((fp8_grouped().float() - ref).norm() / ref.norm()).item()
    for name, f in sides:
        try:
            with torch.no_grad():
                t_fwd = _timed(f, iters)
            t_all = _timed(fwd_bwd(f), iters)
        except Exception as e:  # a compile failure of the FP8 side: recorded, not fatal
            if not name.endswith("_compiled"):
                raise
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            x.grad = w.grad = dense_w.grad = None
            continue
        out[name] = {
            "fwd_ms": t_fwd * 1e3,
            "fwd_tflops": flops_fwd / t_fwd / 1e12,
            "fwd_bwd_ms": t_all * 1e3,
            "fwd_bwd_tflops": 3 * flops_fwd / t_all / 1e12,
        }
        x.grad = w.grad = dense_w.grad = None
    out["grouped_over_dense_fwd"] = out["grouped"]["fwd_tflops"] / out["dense"]["fwd_tflops"]
    out["grouped_over_dense_fwd_bwd"] = (
        out["grouped"]["fwd_bwd_tflops"] / out["dense"]["fwd_bwd_tflops"]
    )
    out["grouped_over_loop_fwd_bwd"] = (
        out["grouped"]["fwd_bwd_tflops"] / out["loop"]["fwd_bwd_tflops"]
    )
    for side in ("fp8_grouped", "fp8_grouped_compiled") if fp8 else ():
        if "error" not in out[side]:
            for part in ("fwd", "fwd_bwd"):
                out[f"{side}_over_grouped_{part}"] = (
                    out[side][f"{part}_tflops"] / out["grouped"][f"{part}_tflops"]
                )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--moe-ffn", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument(
        "--tokens", type=int, default=16384, help="tokens of one micro-batch (batch x seq)"
    )
    p.add_argument("--iters", type=int, default=50)
    p.add_argument(
        "--fp8",
        action="store_true",
        help="also time the FP8 grouped GEMMs (train.fp8_experts) against the bf16 grouped ones",
    )
    p.add_argument("--out", default="moe_gemm.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_gemm.py measures CUDA kernels: no CUDA device here")
    probe = torch.zeros(1, device="cuda")
    for k_in, n_out in ((a.hidden, 2 * a.moe_ffn), (a.moe_ffn, a.hidden)):
        if a.fp8 and not scaled_grouped_mm_available(probe, k_in, n_out):
            raise SystemExit(
                f"--fp8 times torch._scaled_grouped_mm: it needs compute capability 9.x "
                f"and widths that are multiples of 16 (got {k_in} -> {n_out})"
            )
    rows = a.tokens * a.topk
    results = []
    for skew in (False, True):
        for name, k_in, n_out in (("fc1", a.hidden, 2 * a.moe_ffn), ("fc2", a.moe_ffn, a.hidden)):
            r = measure(rows, k_in, n_out, a.experts, skew, a.iters, a.fp8)
            r["projection"] = name
            results.append(r)
            print(
                f"{name} {'skewed' if skew else 'balanced':8s} rows={rows} {k_in}->{n_out}: "
                f"grouped {r['grouped']['fwd_bwd_tflops']:.0f} TFLOP/s fwd+bwd "
                f"({r['grouped']['fwd_tflops']:.0f} fwd), "
                f"dense {r['dense']['fwd_bwd_tflops']:.0f} ({r['dense']['fwd_tflops']:.0f}), "
                f"loop {r['loop']['fwd_bwd_tflops']:.0f}; "
                f"grouped/dense {r['grouped_over_dense_fwd_bwd']:.3f} fwd+bwd, "
                f"{r['grouped_over_dense_fwd']:.3f} fwd; err {r['max_abs_err_vs_loop']:.2e}"
            )
            for side in ("fp8_grouped", "fp8_grouped_compiled") if a.fp8 else ():
                if "error" in r[side]:
                    print(f"    {side}: {r[side]['error'].splitlines()[0][:200]}")
                    continue
                print(
                    f"    {side} {r[side]['fwd_bwd_tflops']:.0f} TFLOP/s fwd+bwd "
                    f"({r[side]['fwd_tflops']:.0f} fwd); over bf16 grouped "
                    f"{r[f'{side}_over_grouped_fwd_bwd']:.3f} fwd+bwd, "
                    f"{r[f'{side}_over_grouped_fwd']:.3f} fwd; "
                    f"rel err vs bf16 {r['fp8_rel_err_vs_bf16']:.3f}"
                )
    Path(a.out).write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "host": platform.node(),
                "args": vars(a),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
