"""`parallel.tp_batch_split`: where the collectives sit in the compiled graph, and what is refused.

Gradient equivalence with the unsharded model is in test_tensor.py (fp64, odd batches, with
and without sequence parallelism) and the trainer's in test_equivalence.py. Here: the point of
the split, that in the compiled forward graph each half's row-parallel reduction is launched
before the other half's matmuls and waited for after them (without the split, none is).
"""

import pytest
import torch

from benchmarks.compile_graph_breaks import op_order
from services.common.errors import ConfigError
from services.trainer.config import ModelConfig, load_config
from services.trainer.model import GPT
from services.trainer.parallel.mappings import PendingReduction
from services.trainer.parallel.mesh import Mesh
from services.trainer.parallel.tensor import parallelize
from tests.dist_utils import run_ranks

CFG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 16,
       "vocab_size": 203, "normalization": "rmsnorm", "activation": "swiglu", "position_embedding_type": "rope",
       "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def _forward_collectives(rank, world, batch_split, sp):
    torch.manual_seed(0)
    model = parallelize(GPT(ModelConfig(**CFG)), Mesh.build(tp=world), sp, batch_split=batch_split)
    tokens = torch.randint(0, 203, (4, 16), generator=torch.Generator().manual_seed(1))
    _, inflight = op_order(model, tokens, tokens)["forward"]
    return inflight


@pytest.mark.dist
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_each_halfs_reduction_is_in_flight_during_the_other_halfs_matmuls(sp):
    kind = "RS" if sp else "AR"
    split = run_ranks(_forward_collectives, 2, True, sp)[0]
    plain = run_ranks(_forward_collectives, 2, False, sp)[0]
    # 2 blocks x 2 branches x 2 halves row-parallel reductions: all but the very last one have
    # the other half's matmuls between their launch and their wait. (The embedding's and the
    # loss's all-reduces have nothing to overlap with.)
    assert sum(1 for k, n in split if k == kind and n) == 7, split
    assert sum(1 for k, _ in split if k == kind) == sum(1 for k, _ in plain if k == kind) + 4  # each reduction now twice
    assert all(n == 0 for k, n in plain if k == kind), plain


def test_a_pending_reduction_cannot_be_used_as_a_tensor():
    pending = PendingReduction(torch.ones(2), False, None, inflight=False)
    with pytest.raises(TypeError):
        _ = pending + 1  # it must fail, not read an unfinished buffer
    assert torch.equal(pending.wait(), torch.ones(2))


def test_batch_split_needs_tp_and_excludes_comm_overlap_and_param_gather_overlap():
    with pytest.raises(ConfigError, match="tp_batch_split needs parallel.tp > 1"):
        load_config(["--parallel.tp_batch_split=true"])
    with pytest.raises(ConfigError, match="choose one"):
        load_config(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap",
                     "--parallel.tp_batch_split=true"])
    with pytest.raises(ConfigError, match="overlap_param_gather"):
        load_config(["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-param-gather",
                     "--parallel.tp_batch_split=true"])
    assert load_config(["--tensor-model-parallel-size", "2", "--parallel.tp_batch_split=true"]).parallel.tp_batch_split
