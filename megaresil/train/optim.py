"""AdamW, its state as a checkpoint holds it, the warmup + cosine LR
schedule, and global-norm gradient clipping."""
# mypy: ignore-errors
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.checkpoint.keys import HeldMoments, MainRowsOf, MomentsOf
from megaresil.compat import foreach_mul_, foreach_norm
from megaresil.config import OptimizerConfig
from megaresil.parallel.distributed_optimizer import DistributedOptimizer
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import spec_of

# The mesh axes that cut the model (the pipeline's cut is the tie's
# `pipeline_copy`): a parameter replicated over one counts at its coordinate 0.
MODEL_AXES = ("tp",)


def fused_adam_class() -> type | None:
    """NVIDIA apex's FusedAdam when it is built (CUDA only). PyPI's `apex` is an
    unrelated package, hence the import of `apex.optimizers` and the broad except."""
    if not torch.cuda.is_available():
        return None
    try:
        from apex.optimizers import FusedAdam
    except Exception:  # noqa: BLE001 (an unbuilt apex fails in many ways)
        return None
    return FusedAdam


def param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay matrices; leave biases, norms (all 1-D tensors) undecayed, as GPT-2 does."""
    decay, no_decay = [], []
    for param in params:
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def adamw_class_and_kwargs(cfg: OptimizerConfig) -> tuple[type, dict]:
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    apex_adam = fused_adam_class()
    if apex_adam is not None:
        return apex_adam, {**kwargs, "adam_w_mode": True}
    # The fused kernel exists for CPU and CUDA tensors in current PyTorch.
    return torch.optim.AdamW, {**kwargs, "fused": True}


def shards_over_dp(cfg: OptimizerConfig, layout: ParallelLayout) -> bool:
    return cfg.distributed and layout.dp > 1


def build_optimizer(params: list[nn.Parameter], cfg: OptimizerConfig, layout: ParallelLayout, *,
                    separate_main: bool = False):
    """AdamW over `params` (the model's, or their fp32 main copies), sharded
    over data parallelism when optimizer.distributed is on (`separate_main`:
    its shards keep fp32 main rows of params about to become bf16)."""
    groups = param_groups(params, cfg.weight_decay)
    cls, kwargs = adamw_class_and_kwargs(cfg)
    if shards_over_dp(cfg, layout):
        return DistributedOptimizer(groups, cls, kwargs, group=layout.group("dp"),
                                    dp=layout.dp, dp_rank=layout.dp_rank,
                                    separate_main=separate_main)
    return cls(groups, **kwargs)


def keeps_step_in_groups(optimizer: torch.optim.Optimizer) -> bool:
    """Where an AdamW implementation used here counts its steps: torch's in
    each parameter's state (`state[p]["step"]`), apex's FusedAdam in each
    param group (`group["step"]`)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    apex_adam = fused_adam_class()
    if apex_adam is not None and isinstance(optimizer, apex_adam):
        return True
    raise TypeError(f"checkpointing does not know where {type(optimizer).__name__} keeps its "
                    "step count; it knows torch's Adam/AdamW and apex's FusedAdam. Fix: teach "
                    "train/optim.keeps_step_in_groups about it")


def like(tensor: Optional[torch.Tensor], param: torch.Tensor) -> bool:
    """Whether `tensor` can stand in for `param`'s storage: same shape,
    dtype and device, contiguous."""
    return (tensor is not None and tensor.shape == param.shape and tensor.dtype == param.dtype
            and tensor.device == param.device and tensor.is_contiguous())


class AdamState:
    """The checkpoint's view of this run's AdamW (checkpoint.state.OptimizerState),
    whichever implementation steps and wherever it counts steps: the moments
    by parameter (under the distributed optimizer, this rank's row shard of
    them) and one step count."""

    def __init__(self, optimizer):
        self.sharded = isinstance(optimizer, DistributedOptimizer)
        self.separate_main = self.sharded and optimizer.separate_main
        self.inner: torch.optim.Optimizer = optimizer.inner if self.sharded else optimizer
        self.shards = {id(s.param): s for s in optimizer.shards} if self.sharded else {}
        self.step_in_groups = keeps_step_in_groups(self.inner)
        self.stepped = {id(p) for group in self.inner.param_groups for p in group["params"]}

    def moments(self) -> MomentsOf:
        self._ensure_state()
        state = self.inner.state
        if not self.sharded:
            return lambda param: (state[param], None)

        def row_shard(param: nn.Parameter) -> Optional[HeldMoments]:
            shard = self.shards[id(param)]
            return None if shard.stop <= shard.start else (state[shard.view], shard)

        return row_shard

    def main_rows(self) -> MainRowsOf:
        """Under bf16 with ZeRO-1 the shards' fp32 rows are the weights this
        rank holds (train/precision.shard_main_params)."""
        if not (self.sharded and self.separate_main):
            return lambda param: None
        return lambda param: self.shards.get(id(param))

    def _ensure_state(self) -> None:
        """Zero state for every parameter that has none yet (both
        implementations create it at their first step), so that a
        checkpoint can be loaded into it."""
        for group in self.inner.param_groups:
            for p in group["params"]:
                if not self.inner.state[p]:
                    self._start_state(p, torch.zeros_like(p), torch.zeros_like(p))

    def _start_state(self, param: nn.Parameter, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor) -> None:
        state = self.inner.state[param]
        state.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        if not self.step_in_groups:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)

    def adopt(self, param: nn.Parameter, moments: dict[str, Optional[torch.Tensor]]) -> None:
        """Take `moments` (by name, whole tensors shaped like `param`) as the
        state of a parameter that has none yet, instead of zeros a load then
        overwrites; nothing where they do not fit (live replacement keeps a
        rank's own moments this way: handover.py)."""
        if self.sharded or id(param) not in self.stepped or self.inner.state[param]:
            return
        if all(like(m, param) for m in moments.values()):
            self._start_state(param, moments["exp_avg"], moments["exp_avg_sq"])

    def step_count(self) -> int:
        if self.step_in_groups:
            counts = [group["step"] for group in self.inner.param_groups if "step" in group]
        else:
            counts = [state["step"] for state in self.inner.state.values() if "step" in state]
        return int(counts[0]) if counts else 0

    def set_step_count(self, steps: int) -> None:
        if self.step_in_groups:
            for group in self.inner.param_groups:
                group["step"] = steps
            return
        self._ensure_state()
        for state in self.inner.state.values():
            state["step"].fill_(float(steps))


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


def local_norm_squared(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared grad norms: each tensor's norm in fp32 (one fused pass at
    full speed; fp64 per element costs ~10x), the squares summed in fp64, so
    the sum does not depend on how many pieces the layout cut the model into
    beyond fp32 rounding of each piece."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)  # NCCL reduces on the GPU
    norms = torch.stack(foreach_norm(grads, torch.float32)).double()
    return norms.pow(2).sum()


def counted_here(param: nn.Parameter, layout: ParallelLayout) -> bool:
    """Count every gradient element of the model once in the global norm:
    TP-replicated params only on TP rank 0, a tied embedding only on the first
    pipeline stage (not its copy on the last)."""
    return spec_of(param).counted_on(layout.coordinate, MODEL_AXES)


def local_grad_norm_squared(entries: list[tuple[nn.Parameter, torch.Tensor]],
                            layout: ParallelLayout) -> torch.Tensor:
    """This rank's part of the squared global grad norm. `entries` pairs each
    param with this rank's grad of it (a row shard when the optimizer is
    distributed)."""
    return local_norm_squared([g for p, g in entries if counted_here(p, layout)], layout.device)


def reduce_grad_norm(squared: torch.Tensor, layout: ParallelLayout, *, sharded_over_dp: bool,
                     loss: torch.Tensor, loss_factor: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm of the whole model's gradient from every rank's
    `local_grad_norm_squared`, and the loss of this rank's data-parallel
    replica (`loss` is this rank's; zero on stages that do not compute it).
    Both ride in one all-reduce: the loss, from TP rank 0 only, plus zeros
    (exact), so every stage learns it (the spike check); and 0 * loss in the
    norm, which adds exactly zero when the loss is finite and NaN when it is
    not, so one reduction checks both (resilience/numerics.py) and a finite
    run is bit-identical. `loss_factor` (an injected spike on any rank of
    the replica) rides along as factor - 1: 0 and an exact 1 without one."""
    loss_dtype, loss = loss.dtype, loss.detach().to(squared.dtype)
    packed = torch.stack([squared + loss * 0.0, loss if layout.tp_rank == 0 else loss * 0.0,
                          torch.full_like(squared, loss_factor - 1.0)])
    for dim in ("tp", "pp"):
        if getattr(layout, dim) > 1:
            dist.all_reduce(packed, group=layout.group(dim))
    # Exact without a spike: the loss was of this dtype, and x * (1 + 0) is x.
    stage_loss = (packed[1] * (1.0 + packed[2])).to(loss_dtype)
    if sharded_over_dp and layout.dp > 1:
        dist.all_reduce(packed, group=layout.group("dp"))  # its loss is no longer one replica's
    return packed[0].sqrt().float(), stage_loss


def clip_gradients(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads so the global norm is at most `max_norm` (0 disables)."""
    if max_norm <= 0 or not grads:
        return
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    foreach_mul_(grads, scale.to(grads[0].device))
