"""Causal attention forward+backward through each SDPA backend, at the model configs' shapes.

    python3 benchmarks/attention_backends.py --out attention.json

For each shape, times `scaled_dot_product_attention` (is_causal) forward and backward under each
backend that accepts it: flash, cuDNN and memory-efficient; grouped-query shapes are run both
with `enable_gqa` and with the key/value heads expanded first (some backends take only equal
head counts). The baseline is the default dispatch (`auto`, what `model.attention_backend =
"auto"` does) in the same run. TFLOP/s counts causal attention as 2·(4·b·h·s²·d)/2 forward and
2.5× that backward (flash recomputes the scores). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshtrain.services.trainer.model.attention import BACKENDS, sdpa

SHAPES = {
    # name: (batch, heads, kv_groups, seq, head_dim) of one micro-batch
    "gpt2-125m s1024": (16, 12, 12, 1024, 64),
    "gpt2-125m s2048": (8, 12, 12, 2048, 64),
    "gpt2-350m s2048": (8, 16, 16, 2048, 64),
    "llama-1b s2048": (4, 16, 8, 2048, 128),
}


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run_case(shape, backend: str, iters: int) -> dict:
    b, h, g, s, d = shape
    q = (
        torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        .transpose(1, 2)
        .requires_grad_()
    )
    k = (
        torch.randn(b, s, g, d, device="cuda", dtype=torch.bfloat16)
        .transpose(1, 2)
        .requires_grad_()
    )
    v = (
        torch.randn(b, s, g, d, device="cuda", dtype=torch.bfloat16)
        .transpose(1, 2)
        .requires_grad_()
    )
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return sdpa(q, k, v, 0.0, backend)

    def fwd_bwd():
        out = fwd()
        torch.autograd.grad(out, (q, k, v), grad)

    try:
        fwd_bwd()
    except RuntimeError as e:  # the backend refuses this shape / dtype / GPU
        return {"backend": backend, "error": str(e).splitlines()[0][:200]}
    f_ms = time_ms(fwd, iters)
    fb_ms = time_ms(fwd_bwd, iters)
    flops_fwd = 4 * b * h * s * s * d / 2  # causal: half the score matrix
    return {
        "backend": backend,
        "fwd_ms": f_ms,
        "fwd_bwd_ms": fb_ms,
        "fwd_tflops": flops_fwd / f_ms / 1e9,
        "fwd_bwd_tflops": 3.5 * flops_fwd / fb_ms / 1e9,
    }


def reference_check(shape, backend: str) -> float:
    """Max abs difference of the output from the math backend in fp32, on a smaller batch."""
    _, h, g, s, d = shape  # batch 1 here
    torch.manual_seed(0)
    q = torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, g, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, g, s, d, device="cuda", dtype=torch.bfloat16)
    ref = F.scaled_dot_product_attention(
        q.float(),
        k.float().repeat_interleave(h // g, 1),
        v.float().repeat_interleave(h // g, 1),
        is_causal=True,
    )
    return (sdpa(q, k, v, 0.0, backend).float() - ref).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="attention_backends.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_backends needs a CUDA GPU")
    rows = []
    for name, shape in SHAPES.items():
        for backend in BACKENDS:
            if backend == "math":
                continue
            r = run_case(shape, backend, args.iters)
            if "error" not in r:
                r["max_abs_err_vs_fp32"] = reference_check(shape, backend)
            rows.append({"shape": name, **r})
    base = {r["shape"]: r for r in rows if r["backend"] == "auto"}
    print(
        f"{'shape':18} {'backend':16} {'fwd ms':>8} {'fwd+bwd ms':>11} "
        f"{'TFLOP/s':>8} {'vs auto':>8}  err"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:18} {r['backend']:16} refused: {r['error'][:70]}")
            continue
        r["speedup_vs_auto"] = base[r["shape"]]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        print(
            f"{r['shape']:18} {r['backend']:16} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} "
            f"{r['fwd_bwd_tflops']:8.1f} {r['speedup_vs_auto']:7.2f}x  "
            f"{r['max_abs_err_vs_fp32']:.2e}"
        )
    meta = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "host": platform.node(),
        "cudnn": torch.backends.cudnn.version(),
    }
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
