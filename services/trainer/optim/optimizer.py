"""AdamW (decoupled weight decay) over parameter groups, and gradient clipping.

Weight decay applies to matrices only: never to norms or biases, and to embedding tables only
when `decay_embeddings` is set. Parameters stay fp32 (the master weights); bf16 is an
autocast of the forward, so no separate master copy is needed on one device. On CUDA the
fused AdamW kernel is used. With optim.optimizer_cpu_offload the moments and an fp32 master
copy live in host memory and the update runs on the CPU (`offload.OffloadedAdamW`); with
train.bf16 and optim.offload_bf16_params as well, the device parameters become bf16 with fp32
`main_grad`s (`main_grads.py`), the fp32 masters living on the host only.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.services.trainer.config.sections import OptimConfig, TrainConfig
from meshtrain.services.trainer.optim.main_grads import attach_main_grads, grad_of, to_bf16
from meshtrain.services.trainer.optim.offload import OffloadedAdamW


def offload_bf16_params(optim: OptimConfig, train: TrainConfig) -> bool:
    """Whether the offloaded optimizer keeps bf16 device parameters (fp32 masters on the host):
    optim.optimizer_cpu_offload with train.bf16, unless optim.offload_bf16_params is off."""
    return optim.optimizer_cpu_offload and optim.offload_bf16_params and train.bf16


def is_decayed(name: str, param: nn.Parameter, config: OptimConfig) -> bool:
    """Whether `name` gets weight decay: matrices yes; norms, biases no; embeddings if
    configured."""
    if param.ndim < 2 or name.endswith(".bias") or "norm" in name:
        return False
    if name.startswith("embedding."):
        return config.decay_embeddings
    return True


def build_optimizer(
    model: nn.Module, config: OptimConfig, bf16_params: bool = False
) -> torch.optim.Optimizer:
    """AdamW with two groups (decay / no decay); lr is set every step by the schedule.

    Args:
        model: its trainable parameters (fp32) are optimized.
        config: the optimizer's settings.
        bf16_params: with optim.optimizer_cpu_offload (`offload_bf16_params`): once the host
            masters are read, the model's trainable parameters become bf16 with fp32
            `main_grad`s (one flat buffer, unless data parallelism's buckets hold them) that
            their backward adds into.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if is_decayed(name, p, config) else no_decay).append(p)
    optimizer = adamw([decay, no_decay], config, bf16_params)
    if bf16_params:
        to_bf16(decay + no_decay)
        # plain data parallelism gave them main_grads already: views of its buckets
        bare = [p for p in decay + no_decay if getattr(p, "main_grad", None) is None]
        if bare:
            attach_main_grads(bare)
    return optimizer


def adamw(
    groups: list[list[nn.Parameter]], config: OptimConfig, bf16_params: bool = False
) -> torch.optim.Optimizer:
    """AdamW over (decayed, not decayed) parameters: fused on CUDA, or offloaded to the CPU
    with optim.optimizer_cpu_offload (`bf16_params`: the caller casts the parameters to bf16
    after, see `OffloadedAdamW`)."""
    if bf16_params and not config.optimizer_cpu_offload:
        raise ValueError("bf16 parameters with fp32 masters need optim.optimizer_cpu_offload")
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
            bf16_params=bf16_params,
        )
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(
        param_groups, lr=config.lr, betas=betas, eps=config.adam_eps, fused=on_cuda or None
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (a device tensor, no host sync); clips when max_norm > 0.
    A bf16 parameter's gradient is its fp32 `main_grad` (`main_grads.grad_of`)."""
    grads = [g for g in map(grad_of, model.parameters()) if g is not None]
    if max_norm > 0:
        # clip_grad_norm_'s arithmetic, on the gradients themselves (it reads .grad only)
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coeff)
        return norm
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
