"""Process-wide CUDA options: the FLOP-count shim the overlap scheduler needs on torch 2.11.
(Their refusals off CUDA go through the Trainer: test_train.py; their GPU runs: test_gpu.py.)"""

import pytest
import torch
from torch.utils import flop_counter

from meshtrain.services.trainer.cuda_options import _count_gqa_attention_flops


def test_gqa_attention_flops_are_counted_where_torch_refuses_them(monkeypatch):
    """torch 2.11's SDPA FLOP formulas (which the overlap scheduler's estimates use) assert equal
    query and key/value heads; the shim counts GQA as the kernel runs it, key/value broadcast."""

    def strict(forward):
        def count(*shapes):
            q, k = shapes[-3], shapes[-2]
            assert q[1] == k[1], "shapes are incompatible"
            return forward(*shapes)
        return count

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", strict(flop_counter.sdpa_flop_count))
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", strict(flop_counter.sdpa_backward_flop_count))
    q, kv, full = (2, 8, 16, 32), (2, 2, 16, 32), (2, 8, 16, 32)
    with pytest.raises(AssertionError):
        flop_counter.sdpa_flop_count(q, kv, kv)
    _count_gqa_attention_flops()
    assert flop_counter.sdpa_flop_count(q, kv, kv) == flop_counter.sdpa_flop_count(q, full, full) > 0
    assert flop_counter.sdpa_backward_flop_count(q, q, kv, kv) == flop_counter.sdpa_backward_flop_count(
        q, q, full, full) > 0
    # and through the registry, as the scheduler's estimate reaches it
    flash = flop_counter.flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]
    assert flash(q, kv, kv, out_val=None) == flash(q, full, full, out_val=None) > 0
