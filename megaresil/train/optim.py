"""AdamW, the warmup + cosine LR schedule, and global-norm gradient clipping."""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn

from megaresil.config import OptimizerConfig


def fused_adam_class() -> type | None:
    """NVIDIA apex's FusedAdam when it is built (CUDA only). PyPI's `apex` is an
    unrelated package, hence the import of `apex.optimizers` and the broad except."""
    if not torch.cuda.is_available():
        return None
    try:
        from apex.optimizers import FusedAdam
    except Exception:
        return None
    return FusedAdam


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; leave biases, norms (all 1-D tensors) undecayed, as GPT-2 does."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    apex_adam = fused_adam_class()
    if apex_adam is not None:
        return apex_adam(groups, adam_w_mode=True, **kwargs)
    # The fused kernel exists for CPU and CUDA tensors in current PyTorch.
    return torch.optim.AdamW(groups, fused=True, **kwargs)


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """LR for optimizer step `step` (1-based): linear warmup, then cosine to min_lr.

    A pure function of the step, so a resumed run needs no scheduler state to
    land on the same LR."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = cfg.decay_steps or max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm_squared(params: Iterable[torch.Tensor]) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(grads, 2)
    return torch.stack([n.float() for n in norms]).pow(2).sum()


def clip_gradients(params: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads so the global norm is at most `max_norm` (0 disables)."""
    if max_norm <= 0:
        return
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    torch._foreach_mul_(grads, scale.to(grads[0].device))
