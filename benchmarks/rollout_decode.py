"""Rollout generation speed on one device: meshtrain's rollout engine against a plain PyTorch
static-cache decoder of the same shapes, and where a colocated GRPO step's wall time goes.

(a) `RolloutEngine.generate` (services/rollout/engine.py: left-padded batch, KV cache, per-row
generators, log-probs) against `StaticDecoder`: `baseline_gpt.BaselineGPT`'s blocks driven by a
preallocated key/value cache and F.scaled_dot_product_attention, sampling with torch.multinomial
(argmax at temperature 0) and gathering the same temperature-1 log-probs, one host transfer at
the end. Same model shapes, weights dtype, batch, prompt length and new tokens (no early stop:
the engine gets no EOD id; on CUDA its decode steps replay captured CUDA graphs unless
`--no-cuda-graphs`, and the JSON's `meshtrain.cuda_graphs` says whether they did). Each side
is timed twice per repeat: with `--new-tokens` and with one new token; the latter is the
prefill (plus one draw), the difference the decode of the other tokens. Generated tokens/s =
batch x new tokens / the whole call.

(b) A short real GRPO run (`Trainer`, train.objective = "grpo", colocated rollouts) of a policy of
the same shapes, rewarded by the example rules of objectives/rewards.py on prompts of random
token ids (a `null:` tokenizer keeps the vocabulary): the first step is a warmup, then per step
the time in the rollout backend's `generate` against the whole synchronized step (the rest is
scoring, the training forward/backward and the optimizer), and GRPO steps per hour.

    python benchmarks/rollout_decode.py --out rollout.json            # llama-1b shapes, GPU
    python benchmarks/rollout_decode.py --tiny --device cpu --out r.json

The JSON is rewritten after each side, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

TINY = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
    vocab_size=512, batch=4, prompt_len=8, new_tokens=8, repeats=1,
    grpo_steps=2, grpo_prompts=2, grpo_group=4, grpo_new_tokens=4,
)  # fmt: skip
PEAK_BF16_TFLOPS = 989.0
"""H100/H200 SXM dense bf16 peak, for MFU."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="deploy/configs/llama-1b.toml", help="model shapes")
    for name in ("num-layers", "hidden-size", "num-attention-heads", "num-query-groups"):
        p.add_argument(f"--{name}", type=int, help="override the config's")
    p.add_argument("--ffn-hidden-size", type=int, help="override the config's")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--batch", type=int, default=64, help="rows decoded at once")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per side after a warmup")
    p.add_argument("--grpo-steps", type=int, default=3, help="timed GRPO steps (0: skip (b))")
    p.add_argument("--grpo-prompts", type=int, default=4, help="prompts per GRPO step")
    p.add_argument("--grpo-group", type=int, default=8, help="completions per prompt")
    p.add_argument("--grpo-new-tokens", type=int, default=64)
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine (and GRPO's colocated generator) replays decode steps as CUDA graphs",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--time-budget-s", type=float, default=150.0, help="skip what starts later")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--out", help="write the JSON result here (after each side)")
    args = p.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            if key in ("batch", "prompt_len", "new_tokens", "repeats") or key.startswith("grpo"):
                if p.get_default(key) == getattr(args, key):
                    setattr(args, key, value)
            elif getattr(args, key) in (None, p.get_default(key)):
                setattr(args, key, value)
    for key in ("batch", "prompt_len", "new_tokens", "repeats", "grpo_prompts", "grpo_group"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.grpo_steps < 0 or args.grpo_new_tokens < 1:
        p.error("--grpo-steps must be >= 0 and --grpo-new-tokens >= 1")
    return args


def model_table(args) -> dict:
    """The model section: the config's, with the command line's overrides."""
    from meshtrain.services.common import config as cfg

    table = dict(cfg.load_toml(args.config)["model"])
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups"):
        if getattr(args, key) is not None:
            table[key] = getattr(args, key)
    if args.ffn_hidden_size is not None:
        table["ffn_hidden_size"] = args.ffn_hidden_size
    table["vocab_size"] = args.vocab_size
    need = args.prompt_len + args.new_tokens
    table["seq_length"] = max(int(table.get("seq_length", 0)), need)
    return table


def decode_flops_per_token(c, context: float) -> float:
    """Forward FLOPs of one generated token: 2 x every matmul weight (projections, MLP, output
    head; not the embedding lookup) + 4 x layers x heads x head_dim x the keys it attends to."""
    h, d, f = c.hidden_size, c.head_dim, c.ffn_size
    up = 2 * f if c.activation == "swiglu" else f
    per_layer = h * c.num_attention_heads * d * 2 + h * 2 * c.groups * d + h * up + f * h
    weights = c.num_layers * per_layer + h * c.padded_vocab_size()
    return 2.0 * weights + 4.0 * c.num_layers * c.num_attention_heads * d * context


def timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def measure_side(name: str, run, args, sync, log) -> dict:
    """Best of --repeats timings of `run(n)` at n = --new-tokens and n = 1, after a warmup each."""
    full, one = args.new_tokens, 1
    run(full), run(one)  # warmup: allocator, cuBLAS handles, kernel selection
    totals = [timed(lambda: run(full), sync) for _ in range(args.repeats)]
    prefills = [timed(lambda: run(one), sync) for _ in range(args.repeats)]
    total, prefill = min(totals), min(prefills)
    # None where noise hides the decode (a busy CPU): never a made-up positive time
    decode = total - prefill if full > 1 and total > prefill else None
    rows = args.batch
    out = {
        "total_s": total,
        "prefill_s": prefill,
        "decode_s": decode,
        "generated_tokens_per_s": rows * full / total,
        "prefill_tokens_per_s": rows * args.prompt_len / prefill,
        "decode_tokens_per_s": rows * (full - 1) / decode if decode else None,
        "decode_ms_per_step": 1e3 * decode / (full - 1) if decode else None,
        "all_total_s": totals,
        "all_prefill_s": prefills,
    }
    log(f"{name}: {out['generated_tokens_per_s']:.0f} generated tok/s, prefill {prefill:.3f} s")
    return out


def engine_runner(c, device, dtype, args, rows: list[list[int]]):
    """(run, engine): run(n) has the engine generate n tokens after each of `rows` (one
    completion each)."""
    import torch

    from meshtrain.services.rollout.engine import Limits, RolloutEngine
    from meshtrain.services.rollout.types import RolloutRequest, SamplingParams
    from meshtrain.services.trainer.model import GPT

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(c).to(dtype)
    limits = Limits(
        max_prompts=args.batch, max_prompt_tokens=args.prompt_len,
        max_new_tokens=args.new_tokens, max_completions=args.batch, max_batch_rows=args.batch,
    )  # fmt: skip
    engine = RolloutEngine(model, eod_id=None, limits=limits, cuda_graphs=args.cuda_graphs)

    def run(n: int) -> None:
        sp = SamplingParams(max_new_tokens=n, temperature=args.temperature, seed=1)
        out = engine.generate(RolloutRequest(rows, group_size=1, sampling=sp))
        assert all(len(x.tokens) == n for x in out), "the engine stopped early"

    return run, engine


def baseline_runner(c, device, dtype, args, prompts):
    """run(n): the plain static-cache decoder generates n tokens after prompts (b, s)."""
    import torch

    from benchmarks.baseline_gpt import BaselineGPT, StaticDecoder

    torch.manual_seed(0)
    with torch.device(device):
        base = BaselineGPT(c).to(dtype).eval()
    decoder = StaticDecoder(base, args.batch, args.prompt_len + args.new_tokens)

    def run(n: int) -> None:
        toks, _ = decoder.generate(prompts, n, args.temperature)
        assert len(toks[0]) == n

    return run


def release(device) -> None:
    """Free the memory of the side just dropped before the next is built."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_decode(args, device, dtype, table: dict, result: dict, save, log) -> None:
    import torch

    from meshtrain.services.common import config as cfg
    from meshtrain.services.common.model_config import ModelConfig

    c = cfg.build(ModelConfig, table, "model.")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, c.vocab_size, (args.batch, args.prompt_len), generator=gen)
    flops = decode_flops_per_token(c, args.prompt_len + args.new_tokens / 2)
    peak = PEAK_BF16_TFLOPS if device.type == "cuda" and dtype == torch.bfloat16 else None
    result["decode_flops_per_token"] = flops
    result["mfu_counts"] = (
        "2 x matmul weights (incl. output head) + 4 x layers x heads x head_dim x mean context, "
        f"per generated token, against {PEAK_BF16_TFLOPS} TFLOP/s bf16 dense (H100/H200 SXM)"
    )

    def finish(side: dict) -> dict:
        side["mfu"] = side["generated_tokens_per_s"] * flops / (peak * 1e12) if peak else None
        return side

    run, engine = engine_runner(c, device, dtype, args, prompts.tolist())
    params = engine.model.num_parameters()
    log(f"meshtrain engine: {params / 1e6:.1f}M parameters, {dtype}")
    result["parameters"] = params
    side = finish(measure_side("meshtrain engine", run, args, sync, log))
    # whether the timed decode replayed captured CUDA graphs, and if not, why
    side["cuda_graphs"] = engine.graphs.captures > 0
    side["cuda_graphs_captured"] = engine.graphs.captures
    side["cuda_graphs_skipped"] = (
        engine.graphs.skipped if args.cuda_graphs else "turned off (--no-cuda-graphs)"
    )
    log(f"meshtrain engine: cuda graphs {side['cuda_graphs']} ({side['cuda_graphs_skipped']})")
    result["meshtrain"] = side
    save()
    del run, engine
    release(device)
    run = baseline_runner(c, device, dtype, args, prompts.to(device))
    result["baseline"] = finish(measure_side("plain static-cache", run, args, sync, log))
    del run
    release(device)
    result["ratio"] = {
        key: result["meshtrain"][k] / result["baseline"][k]
        for key, k in (
            ("generated_tokens_per_s", "generated_tokens_per_s"),
            ("prefill", "prefill_tokens_per_s"),
            ("decode", "decode_tokens_per_s"),
        )
        if result["meshtrain"][k] and result["baseline"][k]
    }
    log(f"ratio meshtrain / baseline: {result['ratio']}")
    save()


def write_prompts(path: Path, n: int, length: int, vocab: int) -> None:
    """Prompts of random token ids (as a `null:` tokenizer's text) with a random answer id."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            ids = " ".join(str(rng.randrange(vocab)) for _ in range(length))
            f.write(json.dumps({"prompt": ids, "answer": str(rng.randrange(vocab))}) + "\n")


def bench_grpo(args, device, table: dict, result: dict, save, log, deadline: float) -> None:
    import torch

    from meshtrain.services.trainer.config.load import load_config
    from meshtrain.services.trainer.train import Trainer

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    completions = args.grpo_prompts * args.grpo_group
    work = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    prompts = work / "prompts.jsonl"
    write_prompts(
        prompts,
        args.grpo_prompts * (args.grpo_steps + 1),
        args.prompt_len,
        min(1000, args.vocab_size),
    )
    model = {k: v for k, v in table.items() if k != "vocab_size"}  # the tokenizer's, EOD added
    model["seq_length"] = args.prompt_len + args.grpo_new_tokens
    rules = "meshtrain.services.trainer.objectives.rewards"
    table = {
        "model": model,
        "data": {"tokenizer": f"null:{args.vocab_size}"},
        "train": {
            "objective": "grpo",
            "device": device.type,
            "bf16": device.type == "cuda",
            "compile": False,
            "micro_batch_size": 16 if completions % 16 == 0 else completions,
            "global_batch_size": completions,
            "train_iters": args.grpo_steps + 1,
            "eval_interval": 0,
        },
        "optim": {"lr_warmup_iters": 0},
        "log": {"run_dir": str(work / "run"), "plot": False},
        "grpo": {
            "prompts_path": str(prompts),
            "group_size": args.grpo_group,
            "max_new_tokens": args.grpo_new_tokens,
            "temperature": args.temperature or 1.0,
            "reward_funcs": [f"{rules}:exact_answer", f"{rules}:digits_only"],
            "reward_weights": [1.0, 0.5],
            "rollout_cuda_graphs": args.cuda_graphs,
        },
    }
    trainer = Trainer(load_config([], base=table))
    rollouts = trainer.rollouts
    assert rollouts is not None, "the trainer built no GRPO rollouts"
    backend, spent = rollouts.backend, [0.0]
    inner = backend.generate

    def generate(request):
        sync()
        start = time.perf_counter()
        out = inner(request)
        sync()
        spent[0] += time.perf_counter() - start
        return out

    backend.generate = generate  # type: ignore[method-assign]
    log(f"grpo: {completions} completions/step, {args.grpo_new_tokens} new tokens, warmup step")
    grpo: dict = {
        "completions_per_step": completions,
        "prompts_per_step": args.grpo_prompts,
        "group_size": args.grpo_group,
        "max_new_tokens": args.grpo_new_tokens,
        "seq_length": model["seq_length"],
        "bf16": device.type == "cuda",
        "steps": [],
    }
    result["grpo"] = grpo
    try:
        timed(lambda: trainer.train_step(0), sync)
        for step in range(1, args.grpo_steps + 1):
            if time.perf_counter() > deadline:
                grpo["stopped"] = "time budget"
                break
            spent[0] = 0.0
            wall = timed(lambda s=step: trainer.train_step(s), sync)
            grpo["steps"].append({"wall_s": wall, "generate_s": spent[0]})
            log(f"grpo step {step}: {wall:.2f} s, generating {spent[0]:.2f} s")
            wall_sum = sum(s["wall_s"] for s in grpo["steps"])
            gen_sum = sum(s["generate_s"] for s in grpo["steps"])
            grpo["generate_share"] = gen_sum / wall_sum
            grpo["train_share"] = 1.0 - gen_sum / wall_sum
            grpo["step_s"] = wall_sum / len(grpo["steps"])
            grpo["steps_per_hour"] = 3600.0 / grpo["step_s"]
            grpo["rollout_tokens_per_s"] = (
                completions * args.grpo_new_tokens * len(grpo["steps"]) / gen_sum
            )
            graphs = getattr(backend, "graphs", None)
            grpo["cuda_graphs"] = graphs is not None and graphs.captures > 0
            save()
    finally:
        trainer.release_run_dir()


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.time_budget_s

    def log(msg: str) -> None:
        print(f"[rollout_decode {time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    wanted = args.dtype if args.dtype != "auto" else (
        "bfloat16" if device.type == "cuda" else "float32"
    )  # fmt: skip
    dtype = getattr(torch, wanted)
    table = model_table(args)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": wanted,
        "config": {
            "model": table, "batch": args.batch, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "temperature": args.temperature,
            "repeats": args.repeats, "grpo_steps": args.grpo_steps,
            "cuda_graphs": args.cuda_graphs,
        },
        "skipped": [],
    }  # fmt: skip

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    save()
    bench_decode(args, device, dtype, table, result, save, log)
    if args.grpo_steps and time.perf_counter() < deadline:
        bench_grpo(args, device, table, result, save, log, deadline)
    elif args.grpo_steps:
        result["skipped"].append("grpo: time budget")
    result["elapsed_s"] = time.perf_counter() - start
    save()
    log(json.dumps({k: result.get(k) for k in ("ratio", "grpo")}, default=str)[:2000])
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
