"""Synthetic vision-language batches for the trainer tests: random images and tokens with the
image placeholders expanded, the loss mask 0 on them, as the data service delivers them.

Sample k of step g is a pure function of (g, k), and micro-batch m of data-parallel rank r
takes samples [(m*dp + r)*mbs, (m*dp + r + 1)*mbs) of its step (Megatron's order), so any
layout sees the same micro-batches as one process does.
"""

from __future__ import annotations

import torch

from meshtrain.services.dataloader.loader import Batch

VISION = {
    "model.vision.image_size": 8,
    "model.vision.patch_size": 4,
    "model.vision.hidden_size": 32,
    "model.vision.num_layers": 3,
    "model.vision.num_attention_heads": 4,
    "model.vision.ffn_hidden_size": 64,
    "model.vision.image_token_id": 3,
}
"""A tiny CLIP-style encoder (4 patches per image, the last block unused at select_layer -2)."""


def sample(step: int, k: int, seq: int, vocab: int, image_token: int, per_image: int, size: int):
    """(tokens+1, images) of sample k of step: 0, 1 or 2 images at random places."""
    g = torch.Generator().manual_seed(1_000_003 * step + k)
    tokens = torch.randint(4, vocab, (seq + 1,), generator=g)
    n = k % 3  # samples without images, with one, with two
    starts = sorted(torch.randperm((seq - 1) // per_image, generator=g)[:n].tolist())
    for s in starts:
        tokens[s * per_image : (s + 1) * per_image] = image_token
    images = torch.randn(n, 3, size, size, generator=g)
    return tokens, images


class ImageBatches:
    """A batch source (`micro_batches(step)`) of synthetic vision-language micro-batches."""

    def __init__(self, job, dp_rank: int, dp: int, per_image: int):
        t, m = job.train, job.model
        self.mbs, self.dp, self.rank = t.micro_batch_size, dp, dp_rank
        self.n_micro = t.global_batch_size // (t.micro_batch_size * dp)
        self.seq, self.vocab = m.seq_length, m.vocab_size
        self.image_token, self.size = m.vision.image_token_id, m.vision.image_size
        self.per_image = per_image

    def micro_batches(self, step: int) -> list[Batch]:
        out = []
        for m in range(self.n_micro):
            first = (m * self.dp + self.rank) * self.mbs
            rows, images = [], []
            for k in range(first, first + self.mbs):
                tokens, imgs = sample(
                    step, k, self.seq, self.vocab, self.image_token, self.per_image, self.size
                )
                rows.append(tokens)
                images.append(imgs)
            s = torch.stack(rows)  # (mbs, seq + 1)
            mask = (s[:, :-1] != self.image_token).float()
            mask *= (s[:, 1:] != self.image_token).float()  # no placeholder as a target either
            out.append(Batch(s[:, :-1], s[:, 1:], mask, step, m, images=torch.cat(images)))
        return out
