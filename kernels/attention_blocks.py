"""Attention of one block of queries against one block of keys, returning the log-sum-exp.

Context parallelism splits attention into blocks and merges their partial outputs by their
row log-sum-exp (`merge`); its backward feeds each block the *final* output and log-sum-exp
(`attention_lse_backward` in `kernels/reference.py` says why that is exact). These are the two
entry points, dispatched like the other ops:

- CUDA, bf16/fp16, head_dim a multiple of 8 up to 256: PyTorch's flash-attention ops
  (`aten::_scaled_dot_product_flash_attention` and its backward): tiled, never an (sq, sk)
  matrix in memory.
- CPU: PyTorch's tiled CPU flash-attention ops (`..._flash_attention_for_cpu`).
- Anything else (fp32 on CUDA, odd head sizes, `MESHTRAIN_KERNELS=reference` or `impl="math"`),
  and any block given a boolean `mask` (packed documents): the reference in
  `kernels/reference.py`, which materializes one block's scores in fp32.

Grouped-query attention: k/v may have fewer heads than q; the kernels get them expanded and
the gradients folded back (`reference._expand_kv` / `_fold_kv`).
"""

from __future__ import annotations

if not __name__.startswith("meshtrain."):  # one name per file: the folder installs under meshtrain
    raise ImportError(
        f"import meshtrain.{__name__}, not {__name__}: the repository's {__name__.split('.')[0]}/ "
        f"folder is the package meshtrain.{__name__.split('.')[0]}"
    )

import torch

from meshtrain.kernels import dispatch, reference
from meshtrain.kernels.reference import _expand_kv, _fold_kv

IMPLS = ("auto", "flash", "math")
"""'auto'/'flash': the fastest op for the device and dtype; 'math': the reference."""


def _use_reference(q: torch.Tensor, impl: str) -> bool:
    if impl == "math" or dispatch.mode() == "reference":
        return True
    if q.is_cuda:
        d = q.shape[-1]
        return q.dtype not in (torch.bfloat16, torch.float16) or d % 8 != 0 or d > 256
    return q.device.type != "cpu"


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    impl: str = "auto",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q (b, heads, sq, d), k/v (b, groups, sk, d) -> out (b, heads, sq, d) in q's
    dtype, lse (b, heads, sq) fp32. `causal` masks keys after each query (sq == sk); `mask`
    (b, sq, sk) bool, True where a query sees a key, masks more (a row seeing no key: out 0,
    lse -inf)."""
    if mask is not None or _use_reference(q, impl):
        return reference.attention_lse(q, k, v, causal, mask=mask)
    heads = q.shape[1]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    if (
        q.is_cuda
    ):  # the kernel reads its operands as dense (b, h, s, d): a strided slice would be misread
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse.float()


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    impl: str = "auto",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's gradients given the final `out` (q's dtype) and `lse` (fp32) of its query
    rows: dq (b, heads, sq, d), dk/dv (b, groups, sk, d), in q's dtype (the reference: fp32).
    `mask` as in `attention_forward`."""
    if mask is not None or _use_reference(q, impl):
        return reference.attention_lse_backward(dout, q, k, v, out, lse, causal, mask=mask)
    heads, groups = q.shape[1], k.shape[1]
    ke, ve = _expand_kv(k, heads), _expand_kv(v, heads)
    if q.is_cuda:
        dout, q, ke, ve, out, lse = (t.contiguous() for t in (dout, q, ke, ve, out, lse))
        # no variable-length offsets, no dropout RNG state: None, as the forward returns them
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, None, None
        )
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal
        )
    return dq, _fold_kv(dk, groups), _fold_kv(dv, groups)


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's partial attention into the running (out, lse), in place, in fp32.

    out (b, h, s, d) fp32 and lse (b, h, s) fp32 start as zeros and -inf; after every key block
    of a query row has been merged they hold the row's softmax attention and log-sum-exp. A row
    whose block saw no key (block_lse -inf, block_out 0) is left as it was; one that has seen
    none yet stays 0 and -inf (its weights are 0, not exp(-inf - (-inf)) = NaN).
    """
    new = torch.logaddexp(lse, block_lse)
    base = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).add_(
        block_out.float() * torch.exp(block_lse - base).unsqueeze(-1)
    )
    lse.copy_(new)
