"""AdamW, its state as a checkpoint holds it, setting its LR (the schedule:
train/lr_schedule.py), and global-norm gradient clipping."""
from __future__ import annotations

from collections import ChainMap
from typing import Mapping, Optional, Sequence, TypeGuard

import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.checkpoint.keys import MOMENTS, HeldMoments, MainRowsOf, MomentsOf
from megaresil.compat import foreach_mul_, foreach_norm
from megaresil.config import OptimizerConfig
from megaresil.parallel.distributed_optimizer import DistributedOptimizer, RowShard
from megaresil.parallel.fsdp import local_part
from megaresil.parallel.grad_groups import GradGroup, GroupOptimizer
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
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
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


def group_optimizer(group: GradGroup, cfg: OptimizerConfig, *,
                    separate_main: bool = False) -> GroupOptimizer:
    """AdamW over a gradient group's targets (the model's parameters, or their
    fp32 main copies), sharded over the group's data-parallel ranks under its
    ZeRO-1 rule (`separate_main`: its shards keep fp32 main rows of params
    about to become bf16)."""
    groups = param_groups(group.targets, cfg.weight_decay)
    cls, kwargs = adamw_class_and_kwargs(cfg)
    if group.zero1(cfg):
        return DistributedOptimizer(groups, cls, kwargs, group=group.group, dp=group.size,
                                    dp_rank=group.rank, separate_main=separate_main,
                                    mean_over=group.batches)
    return cls(groups, **kwargs)


class ChainedOptimizer:
    """The optimizers of several gradient groups, stepped as one in group order."""

    def __init__(self, parts: list[GroupOptimizer]):
        self.parts = parts

    @property
    def sharded(self) -> list[DistributedOptimizer]:
        return [p for p in self.parts if isinstance(p, DistributedOptimizer)]

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    @property
    def shards(self) -> list:
        return [shard for part in self.sharded for shard in part.shards]

    @property
    def state(self) -> ChainMap:
        """The unsharded parts' state by parameter, read only."""
        # Plain dicts: a lookup in a ChainMap tries each map in turn, and a
        # part's defaultdict would make an empty entry for another part's
        # parameter (which its step count then lacks) and answer with it.
        return ChainMap(*(dict(p.state) for p in self.parts
                          if not isinstance(p, DistributedOptimizer)))

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def gather_params(self) -> None:
        for part in self.sharded:
            part.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The sharded parts' grads; the others' are the grad buffers' views."""
        for part in self.sharded:
            part.zero_grad(set_to_none)


def build_optimizer(groups: list[GradGroup], cfg: OptimizerConfig, *,
                    separate_main: bool = False):
    """One optimizer per gradient group (`group_optimizer`): with one group,
    that optimizer itself, else a `ChainedOptimizer` of them."""
    parts = [group_optimizer(g, cfg, separate_main=separate_main) for g in groups]
    return parts[0] if len(parts) == 1 else ChainedOptimizer(parts)


def group_parts(optimizer) -> list[GroupOptimizer]:
    """Each gradient group's optimizer, in group order."""
    return optimizer.parts if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def shards_state(optimizer) -> bool:
    """Whether some of `optimizer`'s state is row-sharded (ZeRO-1)."""
    return any(isinstance(p, DistributedOptimizer) for p in group_parts(optimizer))


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


def like(tensor: Optional[torch.Tensor], param: torch.Tensor) -> TypeGuard[torch.Tensor]:
    """Whether `tensor` can stand in for `param`'s storage: same shape,
    dtype and device, contiguous."""
    return (tensor is not None and tensor.shape == param.shape and tensor.dtype == param.dtype
            and tensor.device == param.device and tensor.is_contiguous())


class AdamState:
    """The checkpoint's view of this run's AdamW (checkpoint.state.OptimizerState),
    whichever implementation steps and wherever it counts steps: the moments
    by parameter (under the distributed optimizer, this rank's row shard of
    them) and one step count. With several gradient groups (a
    `ChainedOptimizer`), each group's optimizer holds its parameters' state."""

    def __init__(self, optimizer, param_shards: Optional[Mapping[int, RowShard]] = None):
        """`param_shards`: under sharded data parallelism (FSDP2), each
        parameter's rows on this rank, whose moments and weights its local
        shards are (parallel/fsdp.row_shards)."""
        parts = group_parts(optimizer)
        sharded = [p for p in parts if isinstance(p, DistributedOptimizer)]
        self.param_shards = dict(param_shards or {})
        self.sharded = bool(sharded) or bool(self.param_shards)
        self.separate_main = any(p.separate_main for p in sharded)
        self.inners: list[torch.optim.Optimizer] = [
            p.inner if isinstance(p, DistributedOptimizer) else p for p in parts]
        self.shards = {id(s.param): s for p in sharded for s in p.shards}
        self.step_in_groups = keeps_step_in_groups(self.inners[0])
        # id(what an optimizer steps) -> the optimizer holding its state
        self.inner_of = {id(p): inner for inner in self.inners
                         for group in inner.param_groups for p in group["params"]}

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer that steps a one-group model."""
        inner, = self.inners
        return inner

    def state_of(self, stepped: torch.Tensor) -> dict:
        return self.inner_of.get(id(stepped), self.inners[0]).state[stepped]

    def moments(self) -> MomentsOf:
        self._ensure_state()

        def held(param: nn.Parameter) -> Optional[HeldMoments]:
            rows = self.param_shards.get(id(param))
            if rows is not None:
                state = self.state_of(param)
                return (None if rows.stop <= rows.start else
                        ({m: local_part(state[m]) for m in MOMENTS}, rows))
            shard = self.shards.get(id(param))
            if shard is None:
                return self.state_of(param), None
            return None if shard.stop <= shard.start else (self.state_of(shard.view), shard)

        return held

    def main_rows(self) -> MainRowsOf:
        """Under bf16 with ZeRO-1 the shards' fp32 rows are the weights this
        rank holds (train/precision.shard_main_params); under sharded data
        parallelism every parameter's local rows are."""
        if self.param_shards:
            return lambda param: self.param_shards.get(id(param))
        if not (self.sharded and self.separate_main):
            return lambda param: None
        return lambda param: self.shards.get(id(param))

    def _ensure_state(self) -> None:
        """Zero state for every parameter that has none yet (both
        implementations create it at their first step), so that a
        checkpoint can be loaded into it."""
        for inner in self.inners:
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        self._start_state(p, torch.zeros_like(p), torch.zeros_like(p))

    def _start_state(self, param: nn.Parameter, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor) -> None:
        state = self.state_of(param)
        state.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        if not self.step_in_groups:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)

    def adopt(self, param: nn.Parameter, moments: dict[str, Optional[torch.Tensor]]) -> None:
        """Take `moments` (by name, whole tensors shaped like `param`) as the
        state of a parameter that has none yet, instead of zeros a load then
        overwrites; nothing where they do not fit (live replacement keeps a
        rank's own moments this way: handover.py)."""
        if (id(param) in self.shards or id(param) not in self.inner_of
                or self.state_of(param)):
            return
        exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
        if like(exp_avg, param) and like(exp_avg_sq, param):
            self._start_state(param, exp_avg, exp_avg_sq)

    def step_count(self) -> int:
        if self.step_in_groups:
            counts = [group["step"] for inner in self.inners for group in inner.param_groups
                      if "step" in group]
        else:
            counts = [state["step"] for inner in self.inners for state in inner.state.values()
                      if "step" in state]
        return int(counts[0]) if counts else 0

    def set_step_count(self, steps: int) -> None:
        if self.step_in_groups:
            for inner in self.inners:
                for group in inner.param_groups:
                    group["step"] = steps
            return
        self._ensure_state()
        for inner in self.inners:
            for state in inner.state.values():
                state["step"].fill_(float(steps))


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


def reduce_grad_norm(squares: Sequence[torch.Tensor], layout: ParallelLayout, *,
                     sharded_over: Sequence[tuple[str, ...]] = (), loss: torch.Tensor,
                     loss_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 norm of the whole model's gradient from every rank's
    `local_grad_norm_squared` of each gradient group (`squares`; a group
    whose grads are row shards over mesh axes names them in `sharded_over`,
    so its squares are summed over those axes too), and the loss of this
    rank's data-parallel replica (`loss` is this rank's; zero on stages that
    do not compute it).
    Both ride in one all-reduce: the loss, from TP rank 0 only, plus zeros
    (exact), so every stage learns it (the spike check); and 0 * loss in the
    norm, which adds exactly zero when the loss is finite and NaN when it is
    not, so one reduction checks both (resilience/numerics.py) and a finite
    run is bit-identical. `loss_factor` (an injected spike on any rank of
    the replica) rides along as factor - 1: 0 and an exact 1 without one."""
    first, *others = squares
    loss_dtype, loss = loss.dtype, loss.detach().to(first.dtype)
    # Group 0's square, the loss, the spike; then the other groups' squares.
    packed = torch.stack([first + loss * 0.0, loss if layout.tp_rank == 0 else loss * 0.0,
                          torch.full_like(first, loss_factor - 1.0), *others])
    for dim in ("tp", "pp"):
        if layout.size(dim) > 1:
            dist.all_reduce(packed, group=layout.group(dim))
    # Exact without a spike: the loss was of this dtype, and x * (1 + 0) is x.
    stage_loss = (packed[1] * (1.0 + packed[2])).to(loss_dtype)
    if sharded_over:
        sum_over_shards(packed, list(sharded_over), layout)
    return (packed[0] + packed[3:].sum() if others else packed[0]).sqrt().float(), stage_loss


def sum_over_shards(packed: torch.Tensor, sharded_over: list[tuple[str, ...]],
                    layout: ParallelLayout) -> None:
    """Sum each ZeRO-1 group's square in `packed` over the axes its rows are
    sharded along: one all-reduce per set of axes, of the whole vector when
    every group shares them (the loss is read already)."""
    slots = [0] + list(range(3, 2 + len(sharded_over)))
    for axes in dict.fromkeys(a for a in sharded_over if a):
        if layout.size(*axes) == 1:
            continue
        mine = [slot for slot, a in zip(slots, sharded_over) if a == axes]
        if len(mine) == len(slots):
            dist.all_reduce(packed, group=layout.group(*axes))
            continue
        part = packed[mine]
        dist.all_reduce(part, group=layout.group(*axes))
        packed[mine] = part


def clip_gradients(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads so the global norm is at most `max_norm` (0 disables)."""
    if max_norm <= 0 or not grads:
        return
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    foreach_mul_(grads, scale.to(grads[0].device))
