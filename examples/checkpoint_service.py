"""A checkpoint written through the checkpoint service: the ranks stream their shards to
`meshtrain ckpt serve`, which writes and commits them (the manifest last); loading reads the
storage directly, at any layout.

    meshtrain ckpt serve ROOT --port 7002 &
    python examples/checkpoint_service.py --root ROOT --address 127.0.0.1:7002
    python examples/checkpoint_service.py  # its own service on loopback, ROOT a new temp folder
"""

import argparse
import tempfile

import torch

import meshtrain as mt

p = argparse.ArgumentParser()
p.add_argument(
    "--root", default=None, help="the root the service writes (a folder, file://, s3://...)"
)
p.add_argument("--address", default=None, help="HOST:PORT of the service serving ROOT")
args = p.parse_args()

server = None
if args.address is None:  # a service in this process, on a free port (what `ckpt serve` runs)
    args.root = args.root or tempfile.mkdtemp(prefix="meshtrain-ckpt-")
    server, port, _ = mt.start_checkpoint_service(args.root, port=0)
    args.address = f"127.0.0.1:{port}"
elif args.root is None:
    p.error("--address needs the --root that service writes")

config = mt.ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256
)
torch.manual_seed(0)
model = mt.GPT(config)
optimizer = mt.build_optimizer(model, mt.OptimConfig(lr=1e-3))
tokens = torch.randint(0, 256, (4, 33))
model(tokens[:, :-1], tokens[:, 1:]).backward()  # one step, so the optimizer has moments to save
optimizer.step()
try:
    url = mt.save_checkpoint(
        args.root, 1, model, optimizer, service_address=args.address, overwrite=True
    )
finally:
    if server is not None:
        server.stop(grace=1).wait()
print(f"committed {url} through {args.address}")

torch.manual_seed(1)
fresh = mt.GPT(config)  # other weights until the load
fresh_optimizer = mt.build_optimizer(fresh, mt.OptimConfig(lr=1e-3))
state = mt.load_checkpoint(args.root, fresh, fresh_optimizer)
weights = all(
    torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
)
moments = all(
    torch.equal(optimizer.state[a]["exp_avg_sq"], fresh_optimizer.state[b]["exp_avg_sq"])
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
)
print(
    f"loaded step {state.iteration}: weights identical: {weights}, "
    f"Adam moments identical: {moments}"
)
if not (weights and moments):
    raise SystemExit("the reloaded checkpoint differs from what was saved")
