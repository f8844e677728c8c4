"""Overlap schedules in compiled code: `parallel.tp_batch_split` (and what it refuses) and
`parallel.tp_async_grad_reduce`.

Gradient equivalence with the unsharded model is in test_tensor.py (fp64, odd batches, with
and without sequence parallelism) and the trainer's in test_equivalence.py. Here: the point of
each option, read from the code Inductor generates (after its fusion, which can move a wait
up to the first fused kernel that needs it): with the split, each half's row-parallel
reduction in the forward is launched before the other half's matmuls and waited for after
them; with the async reduce, the backward's input-gradient reductions have the weight-gradient
matmul in flight. Without either, no collective has a matmul in flight.
"""

import pytest
import torch

from benchmarks.compile_graph_breaks import inductor_order
from meshtrain.services.common.errors import ConfigError
from meshtrain.services.trainer.config import ModelConfig, load_config
from meshtrain.services.trainer.model import GPT
from meshtrain.services.trainer.parallel.mappings import PendingReduction
from meshtrain.services.trainer.parallel.mesh import Mesh
from meshtrain.services.trainer.parallel.tensor import parallelize
from tests.dist_utils import run_ranks

CFG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 16,
       "vocab_size": 203, "normalization": "rmsnorm", "activation": "swiglu", "position_embedding_type": "rope",
       "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def _schedule(rank, world, sp, batch_split, async_grad):
    torch.manual_seed(0)
    model = parallelize(GPT(ModelConfig(**CFG)), Mesh.build(tp=world), sp, batch_split=batch_split,
                        async_grad_reduce=async_grad)
    tokens = torch.randint(0, 203, (4, 16), generator=torch.Generator().manual_seed(1))
    return inductor_order(model, tokens, tokens)


def _overlapped(inflight, kind):
    return sum(1 for k, n in inflight if k == kind and n)


@pytest.mark.dist
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_each_halfs_reduction_is_in_flight_during_the_other_halfs_matmuls(sp):
    kind = "RS" if sp else "AR"
    split = run_ranks(_schedule, 2, sp, True, False)[0]["forward"][1]
    plain = run_ranks(_schedule, 2, sp, False, False)[0]["forward"][1]
    # 2 blocks x 2 branches x 2 halves row-parallel reductions: all but the very last one have
    # the other half's matmuls between their launch and their wait. (The embedding's and the
    # loss's all-reduces have nothing to overlap with.) Without the halves' private norm
    # weights and RoPE tables, Inductor fused their kernels and this was 4.
    assert _overlapped(split, kind) == 7, split
    assert sum(1 for k, _ in split if k == kind) == sum(1 for k, _ in plain if k == kind) + 4  # each twice
    assert _overlapped(plain, kind) == 0, plain


@pytest.mark.dist
def test_async_input_gradient_reduction_has_the_weight_gradient_matmul_in_flight():
    overlapped = run_ranks(_schedule, 2, False, False, True)[0]["backward"][1]
    plain = run_ranks(_schedule, 2, False, False, False)[0]["backward"][1]
    # 2 blocks x 2 column-parallel linears; Inductor keeps the launch-dW-wait order for most.
    assert _overlapped(overlapped, "AR") >= 2, overlapped
    assert _overlapped(plain, "AR") == 0, plain


def test_a_pending_reduction_cannot_be_used_as_a_tensor():
    pending = PendingReduction(torch.ones(2), False, None, inflight=False)
    with pytest.raises(TypeError):
        _ = pending + 1  # it must fail, not read an unfinished buffer
    assert torch.equal(pending.wait(), torch.ones(2))


def test_batch_split_needs_tp_and_excludes_comm_overlap_param_gather_overlap_and_full_recompute():
    with pytest.raises(ConfigError, match="tp_batch_split needs parallel.tp > 1"):
        load_config(["--parallel.tp_batch_split=true"])
    with pytest.raises(ConfigError, match="choose one"):
        load_config(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap",
                     "--parallel.tp_batch_split=true"])
    with pytest.raises(ConfigError, match="recompute_granularity='full' is not supported"):
        load_config(["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
                     "--parallel.tp_batch_split=true"])
    with pytest.raises(ConfigError, match="overlap_param_gather"):
        load_config(["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-param-gather",
                     "--parallel.tp_batch_split=true"])
    assert load_config(["--tensor-model-parallel-size", "2", "--parallel.tp_batch_split=true"]).parallel.tp_batch_split
