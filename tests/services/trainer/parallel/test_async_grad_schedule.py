"""The schedule `parallel.tp_async_grad_reduce` is for, read from the code Inductor generates.

Gradient equivalence with the unsharded model is in test_tensor.py (fp64, with and without
sequence parallelism) and the trainer's in test_equivalence.py. Here: the point of the option.
After Inductor's fusion and scheduling (which can move a wait up to the first kernel that needs
its result), the backward's input-gradient reductions still have the weight-gradient matmul in
flight; without the option no collective has a matmul in flight.
"""

import pytest
import torch

from benchmarks.compile_graph_breaks import inductor_order
from meshtrain.services.common.model_config import ModelConfig
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor import parallelize
from tests.dist_utils import run_ranks

CFG = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "seq_length": 16,
    "vocab_size": 203,
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
}


def _schedule(rank, world, async_grad):
    torch.manual_seed(0)
    model = parallelize(GPT(ModelConfig(**CFG)), Mesh.build(tp=world), async_grad_reduce=async_grad)
    tokens = torch.randint(0, 203, (4, 16), generator=torch.Generator().manual_seed(1))
    return inductor_order(model, tokens, tokens)


def _overlapped(inflight, kind):
    return sum(1 for k, n in inflight if k == kind and n)


@pytest.mark.slow  # compiles the block on 2 ranks: a minute
@pytest.mark.dist
def test_async_input_gradient_reduction_has_the_weight_gradient_matmul_in_flight():
    overlapped = run_ranks(_schedule, 2, True)[0]["backward"][1]
    plain = run_ranks(_schedule, 2, False)[0]["backward"][1]
    # 2 blocks x 2 column-parallel linears; Inductor keeps the launch-dW-wait order for most.
    assert _overlapped(overlapped, "AR") >= 2, overlapped
    assert _overlapped(plain, "AR") == 0, plain
