"""A training loop of your own on meshtrain's public API: mesh -> config -> model -> optimizer ->
data -> steps -> checkpoint -> reload. CPU (gloo) or GPU (NCCL), one process or several:

    python examples/custom_loop.py
    torchrun --nproc-per-node 2 examples/custom_loop.py --tp 2    # --tp 1: two data-parallel ranks
"""

import argparse
import dataclasses

import torch

import meshtrain as mt

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=1), p.add_argument("--steps", type=int, default=30)
p.add_argument("--save", default="runs/custom_loop/checkpoints")
args = p.parse_args()

mesh = mt.initialize_model_parallel(
    tensor_model_parallel_size=args.tp
)  # torchrun's environment, else one rank
device = (
    torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.is_available()
    else torch.device("cpu")
)
# data: the embedded corpus (Python's own source, BPE 4096) unless data.data_path is set
job = mt.JobConfig(
    model=mt.ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128),
    train=mt.TrainConfig(
        micro_batch_size=4, global_batch_size=16, train_iters=args.steps, eval_interval=0
    ),
    optim=mt.OptimConfig(lr=2e-3, min_lr=2e-4, lr_warmup_iters=5),
    parallel=mt.ParallelConfig(tp=args.tp),
)
data = mt.build_data(job, dp_rank=mesh.dp_rank, dp_size=mesh.dp)  # this rank's share of each step
config = dataclasses.replace(job.model, vocab_size=data.vocab_size)


def build(seed: int) -> mt.DistributedDataParallel:
    torch.manual_seed(
        seed
    )  # the same full weights on every rank: parallelize keeps each rank's slice
    model = mt.parallelize(mt.GPT(config), mesh, sequence_parallel=args.tp > 1).to(device)
    return mt.DistributedDataParallel(model, mesh, job.optim, distributed_optimizer=mesh.dp > 1)


def on_device(b: mt.Batch) -> tuple[torch.Tensor, ...]:
    return b.tokens.to(device), b.labels.to(device), b.loss_mask.to(device)


model = build(seed=0)
optimizer = model.optimizer  # AdamW (ZeRO-1 over dp ranks); its step() reduces the gradients first
for step in range(args.steps):
    mt.set_lr(optimizer, mt.lr_at(step, job.optim, args.steps))
    micro = data.train.micro_batches(step)
    loss = 0.0
    for batch in model.accumulate(micro):  # gradients are reduced once, after the last micro-batch
        (part := model(*on_device(batch)) / len(micro)).backward()
        loss += part.item()
    grad_norm = optimizer.step()
    optimizer.zero_grad()
    if mesh.rank == 0:
        print(f"step {step + 1} loss {loss:.4f} grad_norm {grad_norm.item():.3f}", flush=True)

url = mt.save_checkpoint(args.save, args.steps, model, optimizer, overwrite=True)
probe = on_device(data.train.micro_batches(0)[0])
with torch.no_grad():
    before = model(*probe).item()
    fresh = build(seed=1)  # other weights, until the checkpoint replaces them
    state = mt.load_checkpoint(args.save, fresh, fresh.optimizer)
    after = fresh(*probe).item()
if mesh.rank == 0:
    print(
        f"saved {url}\nreloaded step {state.iteration}: "
        f"probe loss {before!r} before, {after!r} after"
    )
