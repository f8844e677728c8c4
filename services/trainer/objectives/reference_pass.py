"""The precomputed DPO reference: the starting model run once over every pair of the dataset (train
and held-out), its summed completion log-probs written beside the data for
`dpo.reference = "precomputed"` (`meshtrain dpo reference`, docs/dpo.md).

    written = compute_reference(job)   # every rank of the job's mesh calls it

The model is the one the frozen reference would be: `dpo.reference_load` (its step
`reference_load_step`), else `checkpoint.load` (`load_step`), built and sharded on the job's mesh
(tensor, pipeline and data parallel) by `FrozenReference.load`. Pairs go in micro-batches of
`train.micro_batch_size` pairs taken in dataset order, micro-batch j to data-parallel rank
j mod dp; the last one is filled up with copies of its last pair, whose values are dropped. The
ranks that hold a result (tensor rank 0 of the last pipeline stage) put their rows in a
zero vector that a sum over the world assembles exactly; rank 0 writes it, to a temporary file
renamed into place with its sidecar last (`PreferencePairs.write_reference`), so a pass that
fails or is killed leaves nothing `dpo.reference = "precomputed"` accepts.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from meshtrain.services.checkpoint.reader import latest_step
from meshtrain.services.common.errors import CheckpointError
from meshtrain.services.dataloader.preference import PreferenceBatchSource, PreferencePairs
from meshtrain.services.dataloader.tokenizers.base import build_tokenizer
from meshtrain.services.trainer.build import build_mesh, pick_device, set_kernel_mode
from meshtrain.services.trainer.config.dpo import check_reference_job, reference_checkpoint
from meshtrain.services.trainer.config.load import replace
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.objectives.dpo import FrozenReference, pair_micro_batches
from meshtrain.services.trainer.parallel.mesh import Mesh

log = logging.getLogger("meshtrain.train")


@dataclass
class ReferenceWritten:
    """One dataset's column: where it went, how many pairs, and the model it came from."""

    prefix: str
    pairs: int
    path: str
    model: str


def compute_reference(job: JobConfig) -> list[ReferenceWritten]:
    """Compute and commit the reference column of dpo.data_path and dpo.valid_data_path (when
    set); every rank of the job's mesh calls it and gets the same answer."""
    check_reference_job(job)
    # the activations between pipeline stages are shaped for pairs (2 sequences each)
    job = replace(job, train={"objective": "dpo"})
    if job.model.vocab_size is None:
        job = replace(job, model={"vocab_size": build_tokenizer(job.data.tokenizer).vocab_size})
    set_kernel_mode(job.train)
    device = pick_device(job.train.device)
    mesh = build_mesh(job, device)
    root, step = reference_checkpoint(job)
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(f"no committed checkpoint under {root}")
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if job.train.bf16
        else contextlib.nullcontext()
    )
    reference = FrozenReference.load(job, mesh, device, root, step, autocast)
    source = f"{root} step {step}"
    prefixes = [job.dpo.data_path] + ([job.dpo.valid_data_path] if job.dpo.valid_data_path else [])
    written = []
    for prefix in prefixes:
        assert prefix is not None
        pairs = PreferencePairs(prefix)
        values = _column(job, mesh, device, reference, pairs)
        if mesh.rank == 0:
            pairs.write_reference(values, source)
            log.info(
                "dpo reference: %s (%d pairs) from %s",
                pairs.reference_path,
                len(values) // 2,
                source,
            )
        if mesh.world_size > 1:  # the command returns once the column is committed
            dist.barrier()
        written.append(ReferenceWritten(prefix, pairs.num_pairs, str(pairs.reference_path), source))
    return written


def _column(
    job: JobConfig,
    mesh: Mesh,
    device: torch.device,
    reference: FrozenReference,
    pairs: PreferencePairs,
) -> np.ndarray:
    """Every sequence's reference sum, (2 * pairs,) float32, the same on every rank."""
    mbs = job.train.micro_batch_size
    source = PreferenceBatchSource(pairs, job.model.seq_length, mbs, mbs)  # checks the lengths
    n = pairs.num_pairs
    chunks = range(mesh.dp_rank, -(-n // mbs), mesh.dp)  # this dp rank's micro-batches
    values = torch.zeros(2 * n, dtype=torch.float32, device=device)
    counts = torch.zeros(2 * n, dtype=torch.float32, device=device)
    holds_result = mesh.tp_rank == 0 and (
        reference.pipeline is None or reference.pipeline.stage.is_last
    )
    for j in chunks:
        real = np.arange(j * mbs, min((j + 1) * mbs, n))
        filled = np.concatenate([real, np.full(mbs - len(real), real[-1])])
        batch = source.batch(filled)
        micro = pair_micro_batches([batch], lambda ts: [t.to(device) for t in ts], None)
        (sums,) = reference.logps(micro)
        if holds_result:
            assert sums is not None
            rows = np.concatenate([np.arange(len(real)), mbs + np.arange(len(real))])
            seqs = torch.from_numpy(batch.sequences[rows]).to(device)
            values[seqs] = sums[torch.from_numpy(rows).to(device)]
            counts[seqs] = 1.0
    if mesh.world_size > 1:  # each sequence's value comes from one rank, zeros from the rest
        dist.all_reduce(values)
        dist.all_reduce(counts)
    missed = int((counts != 1).sum())
    if missed:
        raise RuntimeError(f"{pairs.prefix}: {missed} sequences computed other than once")
    return values.cpu().numpy()
