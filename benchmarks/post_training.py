"""Post-training speed on one GPU: SFT on packed documents with document masking, and DPO.

    python benchmarks/post_training.py --out post_training.json
    python benchmarks/post_training.py --layers 16 --hidden 2048 --ffn 8192 --out 1b.json

(a) SFT: meshtrain's real training step (its Trainer: data, build, step) on packed chat data
(data.format='sft': whole conversations packed first-fit, loss on the answers, attention kept
inside each conversation and positions restarting at each, data.reset_attention_mask +
data.reset_position_ids: FlexAttention block masks on CUDA) against the same model WITHOUT masks
(the same conversations as Megatron pretraining samples, data.format='gpt': plain causal
attention; goal >= 0.95x), and against a plain PyTorch loop (benchmarks/baseline_gpt.py with its
FlexAttention document mask) that trains on the very micro-batches meshtrain trained on (goal >=
1.0x). (b) DPO: meshtrain's step with the reference log-probs precomputed (the column `meshtrain
dpo reference` commits, computed here by its pass from the policy's initial weights) against
twice the unmasked SFT step, which trains one sequence of the same shape per pair (goal <= 1.1x).

The data is synthetic and seeded: conversations of random text (byte-level ids; the model's
vocabulary is --vocab, and the ids' values do not change a step's work) whose lengths are drawn
from a lognormal distribution stated in the JSON with the dataset's real lengths. Every side is
built, warmed up (compilation excluded), timed with CUDA events and released before the next;
the JSON is written after each side, so a run cut short keeps what it measured. tokens/s counts
every position of every sequence (packing padding and DPO padding included); MFU uses
meshtrain's model FLOPs per token (6N + 12·L·s·a: attention over the whole causal sequence, so
the masked sides, which skip the cross-document blocks, get no credit for that saving) and the
device's bf16 dense peak (989 TFLOP/s for H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baseline_gpt import BaselineGPT, make_optimizer  # noqa: E402
from benchmarks.train_throughput import release, time_steps, warm_up  # noqa: E402
from meshtrain.services.common.logging import setup_logging  # noqa: E402
from meshtrain.services.dataloader.preference import PreferencePairs, write_pairs  # noqa: E402
from meshtrain.services.dataloader.sft_data import open_sft_parts, preprocess_chat  # noqa: E402
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer  # noqa: E402
from meshtrain.services.trainer.build import (  # noqa: E402
    build_model,
    pick_device,
    seed_everything,
    set_kernel_mode,  # noqa: E402
)
from meshtrain.services.trainer.config.load import load_config  # noqa: E402
from meshtrain.services.trainer.data import build_data  # noqa: E402
from meshtrain.services.trainer.metrics import model_size, peak_tflops  # noqa: E402
from meshtrain.services.trainer.objectives.dpo import FrozenReference  # noqa: E402
from meshtrain.services.trainer.objectives.preference import SequenceLogpsHead  # noqa: E402
from meshtrain.services.trainer.objectives.reference_pass import _column  # noqa: E402
from meshtrain.services.trainer.parallel.mesh import Mesh  # noqa: E402
from meshtrain.services.trainer.train import Trainer  # noqa: E402

STARTED = time.monotonic()
SIDES = ("sft_masked", "baseline_masked", "sft_unmasked", "dpo")
CHAT_OVERHEAD = 64  # bytes ChatML adds around two messages (and the EOD), with room to spare
GOALS = {  # ratio key -> (goal, whether the ratio must be at least it, else at most it)
    "sft_masked_vs_unmasked": (0.95, True),
    "sft_masked_vs_baseline": (1.0, True),
    "dpo_vs_twice_sft": (1.1, False),
}


def say(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f} s] {text}", flush=True)


def document_lengths(args) -> np.ndarray:
    """The conversations' text lengths (bytes: tokens of the byte tokenizer): lognormal around
    --doc-median with --doc-sigma, clipped so every conversation fits a sequence."""
    rng = np.random.default_rng(args.seed)
    raw = rng.lognormal(np.log(args.doc_median), args.doc_sigma, args.conversations)
    return np.clip(raw.astype(np.int64), args.doc_min, args.seq + 1 - CHAT_OVERHEAD)


def make_data(args, work: Path) -> tuple[str, str, dict]:
    """The SFT dataset (`meshtrain data preprocess --chat`'s output, ChatML, byte tokenizer) and the
    preference pairs (`preprocess-pairs`'), both from seeded random text; (sft prefix, pairs
    prefix, the length distribution asked for and found)."""
    rng = np.random.default_rng(args.seed + 1)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)

    def text(n: int) -> str:
        return letters[rng.integers(0, len(letters), max(int(n), 1))].tobytes().decode()

    lengths = document_lengths(args)
    chats, pairs = work / "chats.jsonl", work / "pairs.jsonl"
    with chats.open("w") as f:
        for n in lengths:  # the prompt a fifth to a half of the conversation, the answer the rest
            cut = int(n * rng.uniform(0.2, 0.5))
            turns = [{"role": "user", "content": text(cut)}, {"role": "assistant", "content": ""}]
            turns[1]["content"] = text(n - cut)
            f.write(json.dumps({"messages": turns}) + "\n")
    with pairs.open("w") as f:  # the prompt, then two answers of lengths apart
        for n in lengths[: args.gbs * planned_steps(args)]:
            cut = int(n * rng.uniform(0.2, 0.5))
            row = {"prompt": text(cut), "chosen": text(n - cut), "rejected": text(n - cut // 2)}
            f.write(json.dumps(row) + "\n")
    tok = build_tokenizer("byte")
    sft, prefs = str(work / "sft"), str(work / "prefs")
    preprocess_chat([chats], sft, tok, template="chatml", max_tokens=args.seq + 1)
    write_pairs(pairs, prefs, tok, max_length=args.seq + 1)
    found = open_sft_parts(sft)[0].sequence_lengths.astype(np.int64)
    stats = {
        "asked": f"lognormal text lengths, median {args.doc_median}, sigma {args.doc_sigma}, "
        f"clipped to [{args.doc_min}, {args.seq + 1 - CHAT_OVERHEAD}], seed {args.seed}; "
        "ChatML around a user and an assistant turn, EOD last",
        "conversations": int(found.size),
        "tokens_mean": float(found.mean()),
        "tokens_median": float(np.median(found)),
        "tokens_p10_p90": [float(x) for x in np.percentile(found, [10, 90])],
        "tokens_min_max": [int(found.min()), int(found.max())],
    }
    return sft, prefs, stats


def planned_steps(args) -> int:
    return args.warmup + args.steps


def job_for(args, work: Path, side: str, sft: str, prefs: str):
    """The JobConfig of one meshtrain side."""
    cuda = args.device == "cuda"
    data: dict = {"tokenizer": "byte", "data_path": [sft], "split": "100,0,0"}
    if side == "sft_masked":
        data |= {"format": "sft", "reset_position_ids": True}  # sft sets reset_attention_mask
    table = {
        "model": {
            "num_layers": args.layers,
            "hidden_size": args.hidden,
            "num_attention_heads": args.heads,
            "num_query_groups": args.groups,
            "ffn_hidden_size": args.ffn,
            "seq_length": args.seq,
            "vocab_size": args.vocab,
            "normalization": "rmsnorm",
            "activation": "swiglu",
            "position_embedding_type": "rope",
            "add_bias_linear": False,
            "untie_embeddings_and_output_weights": True,
        },
        "data": data,
        "train": {
            "micro_batch_size": args.mbs,
            "global_batch_size": args.gbs,
            "train_iters": planned_steps(args),
            "eval_interval": 0,
            "seed": args.seed,
            "device": args.device,
            "bf16": cuda,
            "compile": args.compile,
        },
        "optim": {"lr": 1e-5, "min_lr": 1e-6, "weight_decay": 0.0},
        "log": {"run_dir": str(work / f"run-{side}")},
    }
    if side == "dpo":
        table["train"]["objective"] = "dpo"
        table["data"] = {"tokenizer": "byte"}
        table["dpo"] = {"data_path": prefs, "reference": "precomputed", "beta": 0.1}
    return load_config([], base=table)


def write_reference(job) -> None:
    """The precomputed reference column of the pairs, as `meshtrain dpo reference` computes it
    (its pass, `_column`), from the weights the DPO run starts with: the same seed, the same
    build, so the policy's first DPO loss is log 2."""
    set_kernel_mode(job.train)
    device = pick_device(job.train.device)
    seed_everything(job.train.seed)  # as Trainer does before it builds the policy
    model, _, _ = build_model(job, Mesh.single(), device)
    model.head = SequenceLogpsHead(cast(torch.nn.Module, model.head))
    model.eval().requires_grad_(False)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if job.train.bf16
        else contextlib.nullcontext()
    )
    pairs = PreferencePairs(job.dpo.data_path)
    values = _column(job, Mesh.single(), device, FrozenReference(model, None, autocast), pairs)
    pairs.write_reference(values, f"initial weights, seed {job.train.seed}")


def timed(step, device: torch.device, args) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm_up(step, args.warmup, device)
    row = time_steps(step, args.warmup, args.steps, device)
    row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    return row


def meshtrain_side(args, job) -> dict:
    """Time meshtrain's Trainer.train_step on `job`: its first and last loss with the times."""
    trainer = Trainer(job)
    try:
        losses: list[torch.Tensor] = []
        row = timed(lambda i: losses.append(trainer.train_step(i)[0]), trainer.device, args)
        row |= {"loss_first": losses[0].item(), "loss_last": losses[-1].item()}
    finally:
        trainer.release_run_dir()
    return row


def baseline_side(args, job, batches: list, device: torch.device) -> dict:
    """The plain-PyTorch loop (BaselineGPT, FlexAttention document mask, RoPE at the documents'
    positions, the loss mask) on meshtrain's own micro-batches, uploaded before timing."""
    torch.manual_seed(job.train.seed)
    model = BaselineGPT(job.model).to(device)
    opt = make_optimizer(model, job.optim.lr, job.optim.weight_decay)
    fwd = torch.compile(model) if job.train.compile else model
    fields = ("tokens", "labels", "loss_mask", "document_ids", "position_ids")
    steps = [
        [tuple(getattr(b, k).to(device, non_blocking=True) for k in fields) for b in micro]
        for micro in batches
    ]
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        total = torch.zeros((), device=device)
        for inputs in steps[i]:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.train.bf16):
                loss = fwd(*inputs) / len(steps[i])
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.clip_grad, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)

    row = timed(step, device, args)
    return row | {"loss_first": losses[0].item(), "loss_last": losses[-1].item()}


def run_side(side: str, args, job, batches: list, device: torch.device) -> dict:
    if side == "baseline_masked":
        return baseline_side(args, job, batches, device)
    if side == "dpo":
        write_reference(job)
        release(job)  # the reference pass's model
    return meshtrain_side(args, job)


def packing_stats(batches: list, seq: int) -> dict:
    """What the masked sides' micro-batches hold: documents per sequence, and the share of the
    causal attention pairs (query, earlier key) inside one document (the work a document mask
    leaves; packing padding is a document of its own)."""
    docs, inside = [], []
    for micro in batches:
        for b in micro:
            for row in b.document_ids.numpy():
                _, counts = np.unique(row, return_counts=True)
                docs.append(len(counts))
                inside.append(float((counts * (counts + 1)).sum() / (seq * (seq + 1))))
    return {
        "documents_per_sequence": float(np.mean(docs)),
        "attention_share": float(np.mean(inside)),
    }


def finish(result: dict, args) -> None:
    """Tokens/s, MFU and the ratios from the rows timed so far; the JSON written."""
    rows = result["results"]
    peak, fpt = result["peak_tflops"], result["flops_per_token"]
    for name, r in rows.items():
        r["tokens_per_step"] = args.gbs * args.seq * (2 if name == "dpo" else 1)
        r["tokens_per_s"] = r["tokens_per_step"] / r["step_time_s"]
        r["mfu"] = fpt * r["tokens_per_s"] / (peak * 1e12) if peak else None
    pairs = {
        "sft_masked_vs_unmasked": ("sft_masked", "sft_unmasked"),
        "sft_masked_vs_baseline": ("sft_masked", "baseline_masked"),
    }
    for key, (a, b) in pairs.items():
        if a in rows and b in rows:
            result[key] = rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
            result[key + "_median"] = rows[b]["step_time_median_s"] / rows[a]["step_time_median_s"]
    if "dpo" in rows and "sft_unmasked" in rows:
        for suffix, k in (("", "step_time_s"), ("_median", "step_time_median_s")):
            result["dpo_vs_twice_sft" + suffix] = rows["dpo"][k] / (2 * rows["sft_unmasked"][k])
    for key, (goal, at_least) in GOALS.items():
        if key in result:
            result[key + "_meets_goal"] = result[key] >= goal if at_least else result[key] <= goal
    Path(args.out).write_text(json.dumps(result, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=8, help="key/value heads (GQA)")
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=2, help="sequences (DPO: pairs) per micro-batch")
    p.add_argument("--gbs", type=int, default=4, help="sequences (DPO: pairs) per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--doc-median", type=int, default=400, help="median conversation text bytes")
    p.add_argument("--doc-sigma", type=float, default=1.0, help="lognormal sigma of the lengths")
    p.add_argument("--doc-min", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--compile", choices=("auto", "on", "off"), default="auto", help="every side (auto: CUDA)"
    )
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {SIDES}")
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=120.0,
        help="start no side after this many seconds (the JSON keeps what was timed)",
    )
    p.add_argument("--work-dir", default="runs/post_training")
    p.add_argument("--out", default="post_training.json")
    args = p.parse_args()
    sides = [s for s in args.sides.split(",") if s]
    if not set(sides) <= set(SIDES) or not sides:
        p.error(f"--sides: each of {', '.join(SIDES)}; got {args.sides!r}")
    if args.gbs % args.mbs or args.seq < 2 * CHAT_OVERHEAD or args.doc_min < 1:
        p.error("--gbs must be a multiple of --mbs; --seq at least 128; --doc-min at least 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.compile = args.compile == "on" or (args.compile == "auto" and args.device == "cuda")
    setup_logging("WARNING")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    sft, prefs, lengths = make_data(args, work)
    say(f"data: {lengths['conversations']} conversations, mean {lengths['tokens_mean']:.0f} tokens")
    device = torch.device(args.device)
    jobs = {side: job_for(args, work, side, sft, prefs) for side in SIDES}
    size = model_size(jobs["sft_masked"].model)
    result: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")},
        "parameters": size.parameters,
        "flops_per_token": size.flops_per_token,
        "flops_counted": "6N + 12*L*s*a per token (meshtrain's GPT.flops_per_token, full causal "
        "attention); DPO counts both sequences of a pair",
        "peak_tflops": peak_tflops(device, None),
        "documents": lengths,
        "goals": {k: (">=" if at_least else "<=") + str(g) for k, (g, at_least) in GOALS.items()},
        "results": {},
        "skipped": [],
        "failed": {},
    }
    # every step's micro-batches of the masked side: the pure function of the step its Trainer
    # reads, which the baseline trains on (host tensors)
    source: Any = build_data(jobs["sft_masked"]).train
    batches = [source.micro_batches(i) for i in range(planned_steps(args))]
    result["packing"] = packing_stats(batches, args.seq)
    for side in sides:
        if time.monotonic() - STARTED > args.time_budget_s:
            result["skipped"].append(side)
            say(f"skipped {side}: past --time-budget-s {args.time_budget_s:.0f}")
            continue
        say(f"building {side}")
        try:
            row = run_side(side, args, jobs[side], batches, device)
        except Exception as e:  # noqa: BLE001 (one side failing: the others are still timed)
            traceback.print_exc()
            result["failed"][side] = f"{type(e).__name__}: {e}"
            say(f"failed {side}: {result['failed'][side]}")
            row = None
        release(jobs[side])
        if row is not None:
            result["results"][side] = row
            say(
                f"timed {side}: {row['step_time_s'] * 1e3:.1f} ms/step, loss {row['loss_last']:.4f}"
            )
        finish(result, args)
    finish(result, args)
    for name, r in result["results"].items():
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        print(f"{name:<18}{r['tokens_per_s']:>12,.0f} tokens/s  MFU {mfu:>6}")
    for key in GOALS:
        if key in result:
            print(f"{key}: {result[key]:.3f} (goal {result['goals'][key]})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
