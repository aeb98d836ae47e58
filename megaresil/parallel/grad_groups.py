"""Gradient groups: the parameters whose gradients are averaged over the same
data-parallel mesh axes (their `ShardSpec.replicated_over`), each with its
process group, its grad buffers and reducer, and its own ZeRO-1 decision.

A dense parameter is replicated over ("dp",): one group, whose buckets,
collectives and their order are those of a single set of grad buffers.
Parameters replicated over other axes (experts over ("edp", "cp"), a dp x cp
group over ("dp", "cp")) form a group of their own through the same code.
Every group's grads are the mean over all data-parallel batches: an
expert's grads arrive summed over its ep group's batches (the all-to-all),
so its group divides by dp, not by its own size. The norm of the clipped
gradient is counted per group and summed (train/optim.reduce_grad_norm),
a group's squares over the data axes its parameters are cut along (ep).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.config import OptimizerConfig
from megaresil.parallel.data_parallel import AllReduceMean, GradBuffers, Mean, Reducer
from megaresil.parallel.distributed_optimizer import DistributedOptimizer
from megaresil.parallel.layout import DATA_AXES, ParallelLayout
from megaresil.parallel.sharding import ShardSpec, spec_of

# The data-parallel axes of a parameter whose spec names no others.
DEFAULT_AXES = ShardSpec().replicated_over

# (param, the grad this rank steps on: the whole grad, or its ZeRO-1 rows)
Held = list[tuple[nn.Parameter, torch.Tensor]]


def zero1(cfg: OptimizerConfig, size: int) -> bool:
    """The ZeRO-1 rule: a group's optimizer shards its state over the group's
    data-parallel ranks when optimizer.distributed is on and there are several."""
    return cfg.distributed and size > 1


def shards_its_group(param: nn.Parameter, cfg: OptimizerConfig, layout: ParallelLayout) -> bool:
    """Whether `param`'s gradient group shards its optimizer state (ZeRO-1):
    the answer before the groups exist (bf16 chooses its main copies by it)."""
    return zero1(cfg, layout.size(*spec_of(param).replicated_over))


def shards_over_dp(cfg: OptimizerConfig, layout: ParallelLayout) -> bool:
    """Whether the group over the default data-parallel axes (every parameter
    today) shards its optimizer state: the answer before a model exists."""
    return zero1(cfg, layout.size(*DEFAULT_AXES))


@dataclass(eq=False)  # its lists hold tensors, which compare elementwise
class GradGroup:
    """Parameters (model order) averaged over mesh axes `axes`; `targets`: what
    the optimizer steps for each (the parameter, or its fp32 main copy);
    `group`, `size`, `rank`: the process group over `axes` and this rank's
    place in it (`group` is None without a mesh); `batches`: the data-parallel
    batches its summed grads hold (the mean's divisor); `split_over`: the
    data axes its parameters are cut along, not replicated over."""

    axes: tuple[str, ...]
    params: list[nn.Parameter]
    targets: list[nn.Parameter]
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    batches: int
    split_over: tuple[str, ...] = ()

    @classmethod
    def over(cls, axes: tuple[str, ...], params: list[nn.Parameter],
             targets: list[nn.Parameter], layout: ParallelLayout) -> "GradGroup":
        replicas = layout.shape.expand(axes)
        split = tuple(a for a in layout.shape.expand(DATA_AXES) if a not in replicas)
        return cls(axes, params, targets, layout.group(*axes), layout.size(*axes),
                   layout.index_over(axes), layout.data_size, split)

    def zero1(self, cfg: OptimizerConfig) -> bool:
        return zero1(cfg, self.size)

    def reducer(self, optimizer: object) -> Optional[Reducer]:
        """How the group's grads are reduced: a reduce-scatter per bucket into
        its distributed `optimizer`, an all-reduce mean, or nothing (size 1)."""
        if isinstance(optimizer, DistributedOptimizer):
            return optimizer
        if self.size == 1:
            return Mean(self.batches) if self.batches > 1 else None
        assert self.group is not None, "only a layout without a mesh has no group, and it has 1 rank"
        return AllReduceMean(self.group, self.batches)


def grad_groups(params: list[nn.Parameter], targets: list[nn.Parameter],
                layout: ParallelLayout) -> list[GradGroup]:
    """`params` (with their `targets`) grouped by the data-parallel axes of
    their specs: groups in order of first appearance, model order within."""
    by_axes: dict[tuple[str, ...], list[tuple[nn.Parameter, nn.Parameter]]] = {}
    for param, target in zip(params, targets):
        by_axes.setdefault(spec_of(param).replicated_over, []).append((param, target))
    return [GradGroup.over(axes, [p for p, _ in pairs], [t for _, t in pairs], layout)
            for axes, pairs in by_axes.items()]


GroupOptimizer = Union[torch.optim.Optimizer, DistributedOptimizer]


class StepGrads(Protocol):
    """What a step drives its gradients through: `GroupedGrads`, or under
    sharded data parallelism FSDP2's (parallel/fsdp.ShardedGrads)."""

    def arm(self) -> None: ...
    def fold_all(self, divisor: int = 1) -> None: ...
    def finish(self) -> None: ...
    def zero(self) -> None: ...
    def close(self) -> None: ...
    def held(self) -> list[Held]: ...
    def sharded_over(self) -> list[tuple[str, ...]]: ...


class GroupedGrads:
    """The grad buffers of every group, each reduced by its group's reducer
    (`optimizers`: each group's, in group order), driven as one."""

    def __init__(self, groups: list[GradGroup], optimizers: Sequence[GroupOptimizer], *,
                 grad_dtype: Optional[torch.dtype] = None):
        self.groups, self.optimizers = groups, list(optimizers)
        self.buffers = [GradBuffers(g.params, g.targets, g.reducer(o), grad_dtype=grad_dtype)
                        for g, o in zip(groups, self.optimizers)]

    def arm(self) -> None:
        for buffers in self.buffers:
            buffers.arm()

    def fold_all(self, divisor: int = 1) -> None:
        for buffers in self.buffers:
            buffers.fold_all(divisor)

    def finish(self) -> None:
        for buffers in self.buffers:
            buffers.finish()

    def zero(self) -> None:
        for buffers in self.buffers:
            buffers.zero()

    def close(self) -> None:
        for buffers in self.buffers:
            buffers.close()

    def held(self) -> list[Held]:
        """Per group, after `finish`: (param, the grad this rank steps on), its
        row shards' under ZeRO-1 (in the optimizer's order), else every target's."""
        held = [[(s.param, s.view.grad) for s in o.shards] if isinstance(o, DistributedOptimizer)
                else [(t, t.grad) for t in g.targets]
                for g, o in zip(self.groups, self.optimizers)]
        return cast(list[Held], held)  # after `finish` every grad is a buffer's view

    def sharded_over(self) -> list[tuple[str, ...]]:
        """Per group, the axes its held grads are cut along, whose squares
        the norm sums: its data axes when they are row shards (ZeRO-1), and
        the data axes its parameters are split along (experts: ep)."""
        return [(g.axes if isinstance(o, DistributedOptimizer) else ()) + g.split_over
                for g, o in zip(self.groups, self.optimizers)]
