"""Batches from a data worker, used from Python: the micro-batches a trainer rank pulls over gRPC,
bit for bit the ones the in-process reader gives (both are a pure function of the dataset, the
seed and the step, so any worker serves any rank from any step).

    meshtrain data serve --port 7001 &                   # a worker; start as many as you like
    python examples/data_service.py --address 127.0.0.1:7001 [--address ...] [--data-path PREFIX]
    python examples/data_service.py                      # starts a worker of its own on loopback
"""

import argparse
import dataclasses

import torch

import meshtrain as mt

p = argparse.ArgumentParser()
p.add_argument("--address", action="append", default=[], help="HOST:PORT of a worker (repeatable)")
p.add_argument(
    "--data-path", default=None, help="a preprocessed dataset PREFIX (default: the embedded corpus)"
)
p.add_argument("--tokenizer", default="bpe", help="the tokenizer PREFIX was preprocessed with")
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()

server = None
if (
    not args.address
):  # a worker in this process, on a free port (the same servicer `data serve` runs)
    server, port, _ = mt.start_data_worker(port=0)
    args.address = [f"127.0.0.1:{port}"]

job = mt.JobConfig(
    model=mt.ModelConfig(seq_length=128),
    train=mt.TrainConfig(micro_batch_size=4, global_batch_size=8, train_iters=args.steps),
    data=mt.DataConfig(
        data_path=[args.data_path] if args.data_path else [], tokenizer=args.tokenizer
    ),
)
local = mt.build_data(job)  # read in this process
remote = mt.build_data(
    dataclasses.replace(job, data=dataclasses.replace(job.data, service_addresses=args.address))
)
try:
    for step in range(args.steps):
        for got, want in zip(
            remote.train.micro_batches(step), local.train.micro_batches(step), strict=True
        ):
            same = all(
                torch.equal(getattr(got, k), getattr(want, k))
                for k in ("tokens", "labels", "loss_mask")
            )
            print(
                f"step {step} micro-batch {got.microbatch}: tokens {tuple(got.tokens.shape)} "
                f"{got.tokens[0, :6].tolist()}... identical to in-process: {same}"
            )
            if not same:
                raise SystemExit(
                    f"step {step} micro-batch {got.microbatch} differs from the in-process batch"
                )
finally:
    remote.train.close()
    if server is not None:
        server.stop(grace=1).wait()
