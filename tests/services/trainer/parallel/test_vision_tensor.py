"""A vision-language model over tp=2 (with and without sequence parallelism) computes the same
loss, logits and every gradient as one device, in fp64: the encoder split by heads and MLP
width, the projector column- then row-parallel, the encoder's replicated weights (patch
convolution, positions, norms) with whole gradients on every rank, never summed over tp."""

import pytest
import torch

from meshtrain.services.common.model_config import ModelConfig, VisionConfig
from meshtrain.services.trainer.model.gpt import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor import parallelize
from meshtrain.services.trainer.parallel.tensor_layers import gather_tp
from tests.dist_utils import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

VOCAB = 203
VISION = dict(
    image_size=8,
    patch_size=4,
    hidden_size=24,
    num_layers=3,
    num_attention_heads=4,
    ffn_hidden_size=48,
    image_token_id=5,
)
CFG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    seq_length=16,
    vocab_size=VOCAB,
    make_vocab_size_divisible_by=8,
    normalization="rmsnorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _model(variant: str) -> GPT:
    """fp64; biases and norm weights random too, so the split of each one is exercised."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG, vision=VisionConfig(**VISION, variant=variant))).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "norm.weight")):
                p.copy_(torch.randn_like(p) * 0.3 + (name.endswith(".weight")))
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(6, VOCAB, (2, 16), generator=g)
    tokens[0, 1:5] = 5
    tokens[1, 8:12] = 5
    labels = torch.randint(6, VOCAB, (2, 16), generator=g)
    return tokens, labels, torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64)


def _grads(rank, world, variant, sequence_parallel):
    model = _model(variant)
    tokens, labels, images = _batch()
    mesh = Mesh.build(tp=world)
    parallelize(model, mesh, sequence_parallel)
    model(tokens, labels, images=images).backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if getattr(p, "sequence_parallel", False):  # what DataParallel does for SP params
            torch.distributed.all_reduce(g)
        full = gather_tp(g, p, mesh)
        grads[name] = full[:VOCAB] if name in ROWS else full
    return grads


@pytest.mark.parametrize("variant", ["clip", "siglip"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_sharded_vision_gradients_equal_unsharded(variant, sp):
    ref = _model(variant)
    tokens, labels, images = _batch()
    ref(tokens, labels, images=images).backward()
    want = {n: (p.grad[:VOCAB] if n in ROWS else p.grad) for n, p in ref.named_parameters()}
    want = {n: g for n, g in want.items() if g is not None}
    assert any(n.startswith("vision.layers.") for n in want) and "projector.fc1.weight" in want
    for grads in run_ranks(_grads, 2, variant, sp):
        assert sorted(grads) == sorted(want)
        for name, g in want.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-10, msg=name)
