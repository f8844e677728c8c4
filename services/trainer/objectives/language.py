"""Language modeling, the default objective (pretraining, SFT, vision-language): the next-token
loss the model's own head computes over the data's batches (`data.build_data`), each
micro-batch uploaded as (tokens, labels, loss_mask, document_ids, position_ids, images), and the
validation loss weighted by the tokens each micro-batch counts. Token ids past the vocabulary and
images that do not match their placeholder tokens are refused on the host, before the upload.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from meshtrain.services.common.errors import DataError
from meshtrain.services.trainer.config.sections import JobConfig
from meshtrain.services.trainer.data import TrainData, build_data, placement
from meshtrain.services.trainer.objectives.base import Objective, check_token_ids
from meshtrain.services.trainer.parallel import mappings
from meshtrain.services.trainer.parallel.context import token_count
from meshtrain.services.trainer.parallel.mesh import Mesh


class LanguageModeling(Objective):
    """train.objective = 'lm'."""

    def build_data(self, job: JobConfig, mesh: Mesh) -> TrainData:
        # context-parallel peers read the same samples, each only its chunks of them; from the
        # service, a tensor-parallel group pulls once and shares
        spread, sharing = placement(mesh, bool(job.data.service_addresses))
        return build_data(
            job,
            dp_rank=mesh.dp_rank,
            dp_size=mesh.dp,
            cp_rank=mesh.cp_rank,
            cp_size=mesh.cp,
            spread=spread,
            sharing=sharing,
        )

    def micro_batches(self, step: int, reads: bool) -> list | None:
        source: Any = self.trainer.data.train
        return source.micro_batches(step) if reads else None

    def inputs(self, micro: list | None, n: int) -> Iterable:
        return self.on_device(micro) if micro is not None else [None] * n

    def on_device(self, batches) -> Iterator[tuple]:
        """(tokens, labels, loss_mask, document_ids, position_ids, images) of each micro-batch on
        the device, in order (`Uploader`); the last three None where the batches have none."""
        trainer = self.trainer
        for b in batches:
            check_token_ids(b, trainer.job, trainer.data)
            self._check_images(b)
        fields = [
            (
                b.tokens,
                b.labels,
                b.loss_mask,
                b.document_ids,
                b.position_ids,
                getattr(b, "images", None),
            )
            for b in batches
        ]
        uploaded = trainer.uploader.upload([tuple(t for t in f if t is not None) for f in fields])
        for f, tensors in zip(fields, uploaded):
            present = iter(tensors)
            yield tuple(None if t is None else next(present) for t in f)

    def _check_images(self, batch) -> None:
        """Refuse images for a text-only model, and placeholder tokens that do not match the
        images (naming the counts), on the host tensors before the upload."""
        images = getattr(batch, "images", None)
        vision = self.trainer.job.model.vision
        if vision is None:
            if images is not None and images.shape[0]:
                raise DataError(
                    f"the batch carries {images.shape[0]} images and model.vision is unset: "
                    "configure a vision encoder ([model.vision]) or read text-only data"
                )
            return
        if batch.tokens.device.type != "cpu":
            return
        placeholders = int((batch.tokens == vision.image_token_id).sum())
        n = 0 if images is None else images.shape[0]
        per_image = 0
        if images is not None and n:
            rows, cols = images.shape[2] // vision.patch_size, images.shape[3] // vision.patch_size
            per_image = rows * cols + (vision.select_feature == "cls_patch")
        if placeholders != n * per_image:
            raise DataError(
                f"micro-batch {batch.microbatch} of step {batch.step} has {placeholders} image "
                f"placeholder tokens (model.vision.image_token_id={vision.image_token_id}) for "
                f"{n} images of {per_image} tokens each"
            )

    @torch.no_grad()
    def evaluate(self) -> float:
        trainer, mesh = self.trainer, self.mesh
        model: Any = trainer.model  # a GPT, or this rank's pipeline stage
        model.eval()
        if trainer.pipeline is not None:
            total, counted = self._pipeline_eval_sums()
        else:
            total = torch.zeros((), dtype=torch.float64, device=trainer.device)
            counted = torch.zeros((), dtype=torch.float64, device=trainer.device)
            valid: Any = trainer.data.valid
            for tokens, labels, mask, docs, positions, images in self.on_device(
                valid.micro_batches(0)
            ):
                batch = (tokens, labels, mask, docs, positions)
                with trainer.autocast:
                    # mean over this micro-batch's counted tokens
                    loss = trainer.forward(*batch, *([images] if images is not None else []))
                    loss = loss.float()
                # Weighted by the tokens each micro-batch counts (Megatron sums loss and token count
                # over the eval batches): with EOD masked they differ, and a mean of means would not
                # be the loss per token. Counted over the cp group: the share's divisor.
                n = token_count(model.context, mask)
                total += loss.double() * n
                counted += n
        model.train()
        # each cp rank's loss was its share: their weighted sum is the micro-batch's
        if mesh.cp > 1:
            total = mappings.all_reduce(total, mesh.group("cp"))
        if mesh.dp > 1:  # each dp rank evaluated its share of the eval batches
            sums = mappings.all_reduce(torch.stack([total, counted]), mesh.group("dp"))
            total, counted = sums[0], sums[1]
        return (total / counted.clamp(min=1.0)).item()  # identical on every rank

    def _pipeline_eval_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-weighted loss sum, tokens counted) of this dp rank's eval batches through the
        pipeline: computed on the last stage, shared with the others over pp."""
        trainer, t = self.trainer, self.trainer.job.train
        pipeline = trainer.pipeline
        assert pipeline is not None
        n = t.eval_iters * t.global_batch_size // (t.micro_batch_size * self.mesh.dp)
        valid: Any = trainer.data.valid
        micro = valid.micro_batches(0) if pipeline.reads_data else None
        total, counted = pipeline.runtime.forward_only(list(self.inputs(micro, n)))
        sums = mappings.all_reduce(torch.stack([total, counted]), self.mesh.group("pp"))
        return sums[0], sums[1]
