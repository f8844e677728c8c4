"""Pipeline stages: which blocks each virtual stage holds, and the part of a GPT one rank keeps.

With pp ranks and v model chunks per rank there are pp·v virtual stages; stage s is chunk
s // pp of rank s % pp (Megatron's interleaving: rank r holds stages r, r+pp, r+2pp, ...).
Blocks are split over the virtual stages evenly, or unevenly with
`first`/`last` (Megatron's --decoder-first/last-pipeline-num-layers: the first and the last
virtual stage get that many, the others share the rest evenly), or by an explicit list of
block counts per virtual stage. The first stage also holds the embedding (and a vision-language
model's encoder and projector: the images enter there); the last the final norm, the output
layer and the loss.

`PipelineStage` is what one rank keeps of a built (and tensor-parallel) GPT. Its parameter
names are the GPT's own, global layer numbers included (`layers.<i>` with i global), so
checkpoints, the optimizer and data parallelism see the canonical names. With tied embeddings
and pp > 1 the last rank keeps a copy of the word embedding for its output layer, marked
`pipeline_copy`: initialized equal to the first stage's (every rank builds the same full model
from the same seed), its gradient summed with the first stage's before the update so the two
stay identical, and neither saved nor counted twice in the gradient norm.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.utils.checkpoint
from torch import nn

from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config.parallel import ParallelConfig
from meshtrain.services.trainer.model.attention import documents
from meshtrain.services.trainer.model.embedding import Embedding
from meshtrain.services.trainer.model.gpt import GPT, rope_tables, token_positions
from meshtrain.services.trainer.model.vision import image_features


def stage_layers(
    num_layers: int,
    pp: int,
    virtual: int = 1,
    first: int | None = None,
    last: int | None = None,
    explicit: list[int] | None = None,
) -> list[range]:
    """The global blocks of each virtual stage, in stage order (pp·virtual ranges, contiguous).

    Raises:
        ConfigError: a split that does not add up (naming the setting to change).
    """
    n_stages = pp * virtual
    if explicit is not None:
        if len(explicit) != n_stages or any(k < 0 for k in explicit) or sum(explicit) != num_layers:
            raise ConfigError(
                f"parallel.pipeline_layout={list(explicit)} must list {n_stages} block counts >= 0 "
                f"(pp={pp} x {virtual} virtual stages) adding up to model.num_layers={num_layers}"
            )
        counts = list(explicit)
    else:
        fixed = {0: first} if first is not None else {}
        if last is not None:
            if n_stages == 1:
                raise ConfigError(
                    "parallel.decoder_last_pipeline_num_layers needs more than one pipeline stage"
                )
            fixed[n_stages - 1] = last
        if any(k < 0 for k in fixed.values()):
            raise ConfigError(f"decoder first/last pipeline block counts must be >= 0, got {fixed}")
        rest, others = num_layers - sum(fixed.values()), n_stages - len(fixed)
        if rest < 0 or (others and rest % others) or (not others and rest):
            what = f" after {sum(fixed.values())} blocks on the first/last stage" if fixed else ""
            raise ConfigError(
                f"model.num_layers={num_layers} does not split evenly over {others} pipeline "
                f"stages{what} (pp={pp} x {virtual} virtual stages): change num_layers, the "
                "degrees, or set parallel.decoder_first_pipeline_num_layers / "
                "decoder_last_pipeline_num_layers / pipeline_layout"
            )
        counts = [fixed.get(s, rest // others if others else 0) for s in range(n_stages)]
    out, start = [], 0
    for k in counts:
        out.append(range(start, start + k))
        start += k
    return out


class _TiedHeadWeight(nn.Module):
    """The last stage's `embedding` when tied: only the word embedding, used as the output
    weight."""

    def __init__(self, word_embeddings: nn.Embedding):
        super().__init__()
        self.word_embeddings = word_embeddings
        word_embeddings.weight.pipeline_copy = True  # type: ignore[attr-defined]


class PipelineStage(nn.Module):
    """One rank's chunks of a GPT (see the module docstring).

    Args:
        model: the full GPT, tensor-parallel already; its modules are taken, not copied.
        pp_rank, pp: this rank's pipeline coordinate and the degree.
        stages: `stage_layers(...)` for every virtual stage.
        parallel: the recompute plan (applied per chunk, as Megatron applies it per stage).
    """

    def __init__(
        self, model: GPT, pp_rank: int, pp: int, stages: list[range], parallel: ParallelConfig
    ):
        super().__init__()
        if len(stages) % pp:
            raise ValueError(f"{len(stages)} virtual stages do not divide over pp={pp}")
        self.config, self.vocab_size = model.config, model.vocab_size
        self.pp, self.pp_rank, self.virtual = pp, pp_rank, len(stages) // pp
        self.chunk_layers = [stages[c * pp + pp_rank] for c in range(self.virtual)]
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp - 1
        self.layers = nn.ModuleDict({str(i): model.layers[i] for r in self.chunk_layers for i in r})
        self.embedding: Embedding | _TiedHeadWeight | None = (
            model.embedding if self.is_first else None
        )
        self.vision = model.vision if self.is_first else None
        self.projector = model.projector if self.is_first else None
        self.final_norm = self.output_layer = None
        self.head = model.head
        if self.is_last:
            self.final_norm, self.output_layer = model.final_norm, model.output_layer
            if self.output_layer is None and not self.is_first:
                self.embedding = _TiedHeadWeight(model.embedding.word_embeddings)
        if model.rope_cos is not None:
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.context = model.context  # context parallelism: positions and the loss share
        self.runs = [self._recompute_runs(r, parallel) for r in self.chunk_layers]
        self.num_layers_total = model.config.num_layers

    @staticmethod
    def _recompute_runs(layers: range, parallel: ParallelConfig) -> list[tuple[list[int], bool]]:
        """(blocks, recomputed) runs of one chunk: Megatron's plan, counted within the chunk."""
        ids = list(layers)
        if parallel.recompute_granularity != "full" or not ids:
            return [(ids, False)] if ids else []
        k = parallel.recompute_num_layers
        assert k is not None  # ParallelConfig sets it with granularity 'full'
        if parallel.recompute_method == "uniform":
            return [(ids[i : i + k], True) for i in range(0, len(ids), k)]
        return [([i], True) for i in ids[:k]] + ([(ids[k:], False)] if ids[k:] else [])

    @property
    def output_weight(self) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer.weight
        assert self.embedding is not None  # tied: the last stage holds the word embedding
        return self.embedding.word_embeddings.weight

    def chunk_is_first(self, chunk: int) -> bool:
        """Whether `chunk` is virtual stage 0 (it reads tokens)."""
        return self.is_first and chunk == 0

    def chunk_is_last(self, chunk: int) -> bool:
        """Whether `chunk` is the last virtual stage (it computes the loss)."""
        return self.is_last and chunk == self.virtual - 1

    def _run(self, ids: list[int], x: torch.Tensor, rope, docs) -> torch.Tensor:
        for i in ids:
            x = self.layers[str(i)](x, rope, docs)
        return x

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """`forward_chunk`, called through the module: a fully sharded stage gathers the
        parameters it holds outside its blocks (embedding, final norm, output layer) in its
        forward hooks."""
        return self.forward_chunk(*args, **kwargs)

    def forward_chunk(
        self,
        chunk: int,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Chunk `chunk` of this rank: tokens or the previous stage's activations in; the next
        stage's activations, or on the last stage the mean token loss (logits without labels),
        out. `document_ids` and `position_ids` (batch, seq): the micro-batch's packed documents,
        which every chunk's attention and RoPE need (`GPT.forward`); `images`: the micro-batch's
        images, which the first chunk encodes."""
        # training sequences are whole: under cp this rank's share of seq_length
        local = self.config.seq_length // (self.context.cp if self.context is not None else 1)
        positions = token_positions(self.context, position_ids, local, x.device)
        if self.chunk_is_first(chunk):
            if x.shape[1] > self.config.seq_length:
                raise ValueError(
                    f"sequence of {x.shape[1]} tokens exceeds "
                    f"model.seq_length={self.config.seq_length}"
                )
            assert isinstance(self.embedding, Embedding)
            features = None
            if images is not None and images.shape[0]:
                if self.vision is None or self.projector is None:
                    raise ValueError("images given to a text-only model (model.vision is unset)")
                features = image_features(self.vision, self.projector, images)
            image_token = self.config.vision.image_token_id if self.config.vision else None
            x = self.embedding(x, positions, features, image_token)
        rope = rope_tables(self.rope_cos, self.rope_sin, positions)
        docs = documents(document_ids)
        for ids, recompute in self.runs[chunk]:
            if recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    self._run, ids, x, rope, docs, use_reentrant=False
                )
            else:
                x = self._run(ids, x, rope, docs)
        if not self.chunk_is_last(chunk):
            return x
        assert self.final_norm is not None
        h = self.final_norm(x)
        if labels is not None:
            loss = self.head.loss(h, self.output_weight, labels, loss_mask)
            return (
                loss if self.context is None else self.context.loss_share(loss, labels, loss_mask)
            )
        return self.head.logits(h, self.output_weight)

    def forward_units(self) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """(module, parameters) in forward order, for the data-parallel all-gather waits."""
        units: list[tuple[nn.Module, list[nn.Parameter]]] = []
        if self.is_first:
            assert self.embedding is not None
            for m in (self.vision, self.projector):  # the images are encoded first
                if m is not None:
                    units.append((m, list(m.parameters())))
            units.append((self.embedding, list(self.embedding.parameters())))
        units += [(layer, list(layer.parameters())) for layer in self.layers.values()]
        if self.is_last:
            head = [
                p
                for m in (self.final_norm, self.output_layer)
                if m is not None
                for p in m.parameters()
            ]
            if not self.is_first and self.output_layer is None:
                # tied: the word embedding's weight, a Parameter
                head.append(cast(nn.Parameter, self.output_weight))
            assert self.final_norm is not None
            units.append((self.final_norm, head))
        return units
