"""AdamW (decoupled weight decay) over parameter groups, and gradient clipping.

Weight decay applies to matrices only: never to norms or biases, and to embedding tables only
when `decay_embeddings` is set. Parameters stay fp32 (the master weights); bf16 is an
autocast of the forward, so no separate master copy is needed on one device. On CUDA the
fused AdamW kernel is used. With optim.optimizer_cpu_offload the moments and an fp32 master
copy live in host memory and the update runs on the CPU (`offload.OffloadedAdamW`).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.services.trainer.config.sections import OptimConfig
from meshtrain.services.trainer.optim.offload import OffloadedAdamW


def is_decayed(name: str, param: nn.Parameter, config: OptimConfig) -> bool:
    """Whether `name` gets weight decay: matrices yes; norms, biases no; embeddings if
    configured."""
    if param.ndim < 2 or name.endswith(".bias") or "norm" in name:
        return False
    if name.startswith("embedding."):
        return config.decay_embeddings
    return True


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with two groups (decay / no decay); lr is set every step by the schedule."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if is_decayed(name, p, config) else no_decay).append(p)
    return adamw([decay, no_decay], config)


def adamw(groups: list[list[nn.Parameter]], config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over (decayed, not decayed) parameters: fused on CUDA, or offloaded to the CPU
    with optim.optimizer_cpu_offload."""
    decay, no_decay = groups
    param_groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (config.adam_beta1, config.adam_beta2)
    if config.optimizer_cpu_offload:
        return OffloadedAdamW(
            param_groups,
            lr=config.lr,
            betas=betas,
            eps=config.adam_eps,
            overlap=config.overlap_cpu_optimizer_d2h_h2d,
            chunk_numel=config.cpu_offload_chunk_numel,
        )
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(
        param_groups, lr=config.lr, betas=betas, eps=config.adam_eps, fused=on_cuda or None
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (a device tensor, no host sync); clips when max_norm > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
