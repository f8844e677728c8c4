"""Vision-language training throughput on one GPU: meshtrain's trainer vs a plain PyTorch LLaVA.

    python benchmarks/vision_train.py --out vision_train.json
    python benchmarks/vision_train.py --lm-layers 8 --vit-layers 12 --freeze-vision --out v.json
    python benchmarks/vision_train.py --tiny --out tiny.json          # CPU, seconds

The model has the shapes of `deploy/configs/llava-1.5-7b.toml` (CLIP ViT-L/14 at 336 px read at
its second-to-last layer, 576 image tokens, the mlp2x_gelu projector, a Llama-7B-wide language
model) at reduced depth (`--lm-layers`, `--vit-layers`; any `--model.KEY=VALUE` override is passed
on). meshtrain runs its real `Trainer.train_step` (bf16 weight copies, clipping, LR schedule,
gradient accumulation) on synthetic batches handed to it in place of its data source: random
pixels in bf16, each sample `--images-per-sample` images of placeholders after one text token,
the rest random tokens, the loss masked on the placeholders. The baseline (`baseline_vlm.py`: a
plain ViT, projector and `baseline_gpt.BaselineGPT`) trains on the same batches, compiled, in bf16
autocast with fused AdamW, in the same process after meshtrain. tokens/s counts every position of
every sequence (text and image tokens); MFU counts the language model's training FLOPs
(`GPT.flops_per_token`) plus the encoder's and projector's per image (`vision_flops_per_image`),
against the peak in the JSON. The JSON (`--out`) is written after each side, so a run cut short
still leaves what it measured; `--time-budget-s` shortens the timed steps to fit.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
import tomllib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.baseline_gpt import make_optimizer  # noqa: E402
from benchmarks.baseline_vlm import BaselineVLM  # noqa: E402
from benchmarks.train_throughput import release, time_steps  # noqa: E402
from meshtrain.services.common.logging import setup_logging  # noqa: E402
from meshtrain.services.dataloader.loader import Batch  # noqa: E402
from meshtrain.services.trainer.config.load import load_config  # noqa: E402
from meshtrain.services.trainer.metrics import model_size, peak_tflops  # noqa: E402
from meshtrain.services.trainer.train import Trainer  # noqa: E402

STARTED = time.monotonic()
TINY = {  # a CPU-sized model of the same structure: 2x2 patches an image, one ViT block run
    "model.hidden_size": 64,
    "model.num_attention_heads": 4,
    "model.ffn_hidden_size": 128,
    "model.vocab_size": 512,
    "model.vision.image_size": 28,
    "model.vision.hidden_size": 32,
    "model.vision.num_attention_heads": 4,
    "model.vision.ffn_hidden_size": 64,
    "model.vision.image_token_id": 300,
}
TINY_FLAGS = {
    "lm_layers": 2,
    "vit_layers": 2,
    "seq_length": 64,
    "micro_batch_size": 2,
    "global_batch_size": 4,
    "steps": 2,
    "warmup": 1,
    "device": "cpu",
    "compile": False,
}


def say(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f} s] {text}", flush=True)


def job_args(args, extra: list[str]) -> list[str]:
    """load_config's arguments: the TOML's [model] and [model.vision] shapes, the depths and batch
    of the flags, a small byte-level corpus for the trainer's (unused) data source, then `extra`."""
    model = tomllib.loads(Path(args.config).read_text()).get("model")
    if not model or not isinstance(model.get("vision"), dict):
        raise SystemExit(f"{args.config} has no [model] with a [model.vision] table")
    keys = {f"model.{k}": v for k, v in model.items() if k != "vision"}
    keys.update({f"model.vision.{k}": v for k, v in model["vision"].items()})
    keys.update(
        {
            "model.num_layers": args.lm_layers,
            "model.vision.num_layers": args.vit_layers,
            "model.seq_length": args.seq_length,
            "model.vocab_size": args.vocab_size,
            **(TINY if args.tiny else {}),
            "data.tokenizer": "byte",
            "data.default_corpus_bytes": 200_000,
            "data.split": "100,0,0",
            "train.micro_batch_size": args.micro_batch_size,
            "train.global_batch_size": args.global_batch_size,
            "train.train_iters": args.warmup + 1 + args.steps,  # and the planning step
            "train.eval_interval": 0,
            "train.bf16": True,
            "train.compile": args.compile,
            "train.device": args.device,
            "train.freeze_vision": args.freeze_vision,
            "optim.lr": 1e-4,
            "optim.lr_warmup_iters": 0,
            "optim.weight_decay": 0.0,
            "optim.clip_grad": 1.0,
            "log.run_dir": args.run_dir,
            "log.plot": False,
        }
    )
    out = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
    return out + extra


def vision_flops_per_image(c, frozen: bool) -> float:
    """Training FLOPs per image of the encoder's run blocks, its patch convolution and the
    projector, counted as `GPT.flops_per_token` counts the language model: 2 per multiply-add
    forward, 2 more for each weight gradient and 2 for each input gradient computed, attention
    12·T·hidden per token (T tokens, full, not causal). The pixels need no gradient (the patch
    convolution's weight gradient only); a `frozen` encoder (train.freeze_vision) runs forward
    only, and the projector's first layer then computes no input gradient either."""
    v = c.vision
    h, hv = c.hidden_size, v.hidden_size
    t = v.grid**2 + int(v.class_token)  # tokens through the blocks
    patch = v.grid**2 * 3 * v.patch_size**2 * hv  # multiply-adds of the patch convolution
    # per run block: qkv, out, fc1, fc2, and attention's two (t x t x hidden) products
    blocks = v.layers_run * (t * (4 * hv * hv + 2 * hv * v.ffn_hidden_size) + 2 * t * t * hv)
    fc1 = v.tokens_per_image * hv * h  # the projector's multiply-adds
    fc2 = v.tokens_per_image * h * h if v.projector == "mlp2x_gelu" else 0
    if frozen:
        return 2.0 * (patch + blocks) + 4.0 * fc1 + 6.0 * fc2
    return 4.0 * patch + 6.0 * blocks + 6.0 * (fc1 + fc2)


class SyntheticImageBatches:
    """A batch source (`micro_batches(step)`, the trainer's data interface) of a few fixed
    micro-batches in turn: bf16 random pixels, tokens with the placeholders expanded (each sample:
    one text token, then its images' placeholders, then random text), the loss mask 0 where the
    input or the target is a placeholder, as the data service delivers them."""

    def __init__(self, job, images_per_sample: int, distinct: int = 2):
        t, m, v = job.train, job.model, job.model.vision
        per_image, seq = v.tokens_per_image, m.seq_length
        if images_per_sample * per_image >= seq:
            raise SystemExit(
                f"--images-per-sample {images_per_sample} x {per_image} image tokens does not fit "
                f"a sequence of {seq} tokens with text around it"
            )
        self.n_micro = t.global_batch_size // t.micro_batch_size
        g = torch.Generator().manual_seed(0)
        self.sets = []
        for step in range(distinct):
            micro = []
            for i in range(self.n_micro):
                s = torch.randint(0, m.vocab_size - 1, (t.micro_batch_size, seq + 1), generator=g)
                s += (s >= v.image_token_id).long()  # every id but the placeholder's
                s[:, 1 : 1 + images_per_sample * per_image] = v.image_token_id
                mask = ((s[:, :-1] != v.image_token_id) & (s[:, 1:] != v.image_token_id)).float()
                n = t.micro_batch_size * images_per_sample
                size = (n, 3, v.image_size, v.image_size)
                images = (torch.rand(size, generator=g) * 2 - 1).to(torch.bfloat16)
                micro.append(Batch(s[:, :-1], s[:, 1:], mask, step, i, images=images))
            self.sets.append(micro)

    def micro_batches(self, step: int) -> list[Batch]:
        return self.sets[step % len(self.sets)]


def peak_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def timed_side(step, device, args, plan: dict) -> dict:
    """Warm `step` up, fix the timed step count on the first side (`plan`), time it."""
    reset_peak(device)
    for i in range(args.warmup):
        step(i)
        say(f"  warm-up step {i + 1}/{args.warmup}")
    if "steps" not in plan:  # the first side: what fits the budget, both sides timed alike
        one = time_steps(step, args.warmup, 1, device)["step_time_s"]
        setup = time.monotonic() - STARTED
        left = args.time_budget_s - 2 * setup  # the second side's build and warm-up like this one
        plan["steps"] = max(2, min(args.steps, int(left / 2 / max(one, 1e-9))))
        if plan["steps"] < args.steps:
            say(f"  --time-budget-s {args.time_budget_s}: {plan['steps']} timed steps a side")
    row = time_steps(step, args.warmup + 1, plan["steps"], device)
    row["peak_mem_gb"] = peak_memory_gb(device)
    return row


def run_meshtrain(job, args, plan: dict) -> dict:
    trainer = Trainer(job)
    try:
        trainer.data.train = SyntheticImageBatches(trainer.job, args.images_per_sample)
        losses: list[torch.Tensor] = []

        def step(i: int) -> None:
            losses.append(trainer.train_step(i)[0])

        row = timed_side(step, trainer.device, args, plan)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        row.update(
            loss_first=losses[0].item(), loss_last=losses[-1].item(), trainable_params=trainable
        )
        return row
    finally:
        trainer.release_run_dir()


def run_baseline(job, args, plan: dict) -> dict:
    device = torch.device(
        "cpu" if args.device == "cpu" or not torch.cuda.is_available() else "cuda"
    )
    torch.manual_seed(0)
    model = BaselineVLM(job.model, args.freeze_vision).to(device)
    opt = make_optimizer(model, job.optim.lr, job.optim.weight_decay)
    fwd = torch.compile(model) if args.compile else model
    batches = [
        [
            (
                b.tokens.to(device),
                b.labels.masked_fill(b.loss_mask == 0, -100).to(device),
                b.images.to(device),
            )
            for b in micro
        ]
        for micro in SyntheticImageBatches(job, args.images_per_sample).sets
    ]
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        micro = batches[i % len(batches)]
        total = torch.zeros((), device=device)
        for tokens, targets, images in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = fwd(tokens, targets, images) / len(micro)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, job.optim.clip_grad, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)

    row = timed_side(step, device, args, plan)
    row.update(
        loss_first=losses[0].item(),
        loss_last=losses[-1].item(),
        trainable_params=sum(p.numel() for p in params),
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config", default="deploy/configs/llava-1.5-7b.toml", help="its [model] shapes"
    )
    p.add_argument("--lm-layers", type=int, default=4, help="language-model blocks")
    p.add_argument("--vit-layers", type=int, default=6, help="encoder blocks (select_layer cuts)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32064, help="LLaVA's: Llama's + <image>")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--images-per-sample", type=int, default=1)
    p.add_argument("--freeze-vision", action="store_true", help="the encoder does not train")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps (at most)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    p.add_argument("--time-budget-s", type=float, default=150.0, help="fewer timed steps to fit")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch.compile both sides (--no-compile: both eager)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model (tests, smoke runs)")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--run-dir", default="runs/bench-vision")
    p.add_argument("--out", default="vision_train.json")
    args, extra = p.parse_known_args()
    if args.tiny:  # its depths, batch and device, unless given
        p.set_defaults(**TINY_FLAGS)
        args, extra = p.parse_known_args()
    if bad := [a for a in extra if not a.startswith("--")]:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.steps < 2 or args.warmup < 1:
        p.error("--steps must be at least 2 and --warmup at least 1")
    setup_logging("WARNING")
    job = load_config(job_args(args, extra))
    c, t = job.model, job.train
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    peak = peak_tflops(device, t.peak_tflops)
    lm_flops = model_size(c).flops_per_token
    vision_flops = vision_flops_per_image(c, args.freeze_vision)
    tokens_per_step = t.global_batch_size * c.seq_length
    images_per_step = t.global_batch_size * args.images_per_sample
    flops_per_step = lm_flops * tokens_per_step + vision_flops * images_per_step
    result: dict = {
        "config": args.config,
        "overrides": extra,
        "model": {
            "lm_layers": c.num_layers,
            "hidden_size": c.hidden_size,
            "ffn_hidden_size": c.ffn_hidden_size,
            "vocab_size": c.vocab_size,
            "vit_layers": c.vision.num_layers,
            "vit_layers_run": c.vision.layers_run,
            "vit_hidden_size": c.vision.hidden_size,
            "image_size": c.vision.image_size,
            "image_tokens": c.vision.tokens_per_image,
            "projector": c.vision.projector,
        },
        "seq_length": c.seq_length,
        "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "images_per_sample": args.images_per_sample,
        "freeze_vision": args.freeze_vision,
        "bf16": True,
        "compile": args.compile,
        "flops": {
            "lm_per_token": lm_flops,
            "vision_per_image": vision_flops,
            "per_step": flops_per_step,
            "counted": "training FLOPs: LM 6N + 12·L·s·a per token (GPT.flops_per_token, N its "
            "matmul weights incl. the head); encoder blocks, patch convolution and projector per "
            "image (vision_flops_per_image; a frozen encoder forward only)",
        },
        "peak_tflops": peak,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "results": {},
        "failed": {},
    }
    out = Path(args.out)

    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        out.write_text(json.dumps(result, indent=2))

    write()
    plan: dict = {}
    sides = [("meshtrain", run_meshtrain)]
    if not args.skip_baseline:
        sides.append(("baseline (plain torch)", run_baseline))
    for name, run in sides:
        say(f"{name}: building")
        try:
            row = run(job, args, plan)
        except Exception as e:  # noqa: BLE001 (one side failing leaves the other's number)
            result["failed"][name] = f"{type(e).__name__}: {e}"
            say(f"{name}: failed: {result['failed'][name]}")
            write()
            continue
        finally:
            gc.collect()
            release(job)
        row["tokens_per_s"] = tokens_per_step / row["step_time_s"]
        row["images_per_s"] = images_per_step / row["step_time_s"]
        row["mfu"] = flops_per_step / row["step_time_s"] / (peak * 1e12) if peak else None
        result["results"][name] = row
        mfu = f"{row['mfu'] * 100:.1f}%" if row["mfu"] is not None else "-"
        say(
            f"{name}: {row['step_time_s']:.4f} s/step, {row['tokens_per_s']:,.0f} tokens/s, "
            f"{row['images_per_s']:,.1f} images/s, MFU {mfu}"
        )
        rows = result["results"]
        if len(rows) == 2:
            mesh, base = rows["meshtrain"], rows["baseline (plain torch)"]
            result["ratio_tokens_per_s"] = mesh["tokens_per_s"] / base["tokens_per_s"]
            result["ratio_tokens_per_s_median"] = (
                base["step_time_median_s"] / mesh["step_time_median_s"]
            )
            say(f"ratio meshtrain / baseline: {result['ratio_tokens_per_s']:.3f}")
        write()
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
