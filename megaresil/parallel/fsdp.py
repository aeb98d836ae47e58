"""Sharded data parallelism (parallel.dp_shard > 1) through PyTorch's FSDP2
`fully_shard`: each transformer block one unit, the chunk's embedding, final
norm and head the root's, so a tied embedding and its head stay one
parameter. FSDP2 shards over dp_shard and cp together (dp_shard_cp: the
context-parallel ranks' grads are summed in the same reduce-scatter); under
HSDP (dp_shard < dp) it also all-reduces over dp_replicate. Stacks of
experts, cut along ep, are units of their own over dp_shard / ep (efsdp).

FSDP2 shards dim 0 of each parameter's tensor-parallel block in ceil-sized
rows, as the distributed optimizer does (`shard_rows`), so a shard is a
`RowShard` of the block and checkpoints, norms and the replica check take
it through the seams ZeRO-1 built: the checkpoint writes the same
layout-free rects, and a run moves between plain DP, ZeRO-1, HSDP and full
sharding at any tp x pp.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from megaresil.config import Precision
from megaresil.parallel.distributed_optimizer import RowShard, make_shard, shard_rows
from megaresil.parallel.grad_groups import Held
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import (
    EXPERTS_SHARDED_OVER,
    SHARDED_OVER,
    SHARDED_REPLICAS,
    set_spec,
    spec_of,
)


def policy_for(precision: Precision) -> MixedPrecisionPolicy:
    """bf16: the sharded fp32 parameters are the main weights, gathered in
    bf16 for compute, gradients reduced in fp32 (TorchTitan's default);
    otherwise compute in the parameters' own dtype."""
    if precision == Precision.bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_chunks(chunks: Sequence[nn.Module], layout: ParallelLayout, precision: Precision) -> None:
    """Apply `fully_shard` over the layout's sharded data mesh to each
    chunk's blocks and then the chunk; first, over the experts' own mesh,
    each module holding stacks of experts (TorchTitan's order: the block's
    unit leaves them to theirs). Each parameter keeps its spec (FSDP2
    makes new DTensor parameters), now replicated over dp_replicate only.
    Under pipelining the gathered parameters stay until backward
    (TorchTitan's choice: each micro-batch's forward would gather them
    again), and the schedule's entry point, `stage_forward`, gathers the
    root's parameters as `forward` does."""
    policy = policy_for(precision)
    reshard = layout.pp == 1

    def shard(unit: nn.Module, axis: str) -> None:
        sharded = fully_shard(unit, mesh=layout.sharded_data_mesh(axis), mp_policy=policy,
                              reshard_after_forward=reshard)
        divide_as_data_parallel(sharded, layout, layout.size(axis))

    for chunk in chunks:
        specs = {name: spec_of(p) for name, p in chunk.named_parameters()}
        for block in chunk.get_submodule("layers").children():
            for experts in expert_holders(block):
                shard(experts, EXPERTS_SHARDED_OVER)
            shard(block, SHARDED_OVER)
        shard(chunk, SHARDED_OVER)
        register_fsdp_forward_method(chunk, "stage_forward")
        for name, param in chunk.named_parameters():
            set_spec(param, dataclasses.replace(specs[name], replicated_over=SHARDED_REPLICAS))


def expert_holders(block: nn.Module) -> list[nn.Module]:
    """The modules of `block` whose own parameters are stacks of experts."""
    return [module for module in block.modules()
            if any(spec_of(p).stacks_experts for p in module.parameters(recurse=False))]


def divide_as_data_parallel(unit: FSDPModule, layout: ParallelLayout, shards: int) -> None:
    """Make the unit's grads the mean over the data-parallel batches, summed
    over cp (as a gradient group's are, parallel/grad_groups.py): each cp
    rank's loss is its part of the sequences' mean, while FSDP2 would divide
    by its whole mesh, dp x cp. `shards`: the size of the unit's shard dim."""
    unit.set_gradient_divide_factor(float(layout.data_size))
    # Gloo has no PREMUL_SUM, which a custom factor asks of a reduce-scatter:
    # sum, then divide. Over one shard FSDP2 runs no reduce-scatter and
    # divides as it copies, so summing there would divide twice (torch 2.13).
    unit.set_force_sum_reduction_for_comms(layout.device.type != "cuda" and shards > 1)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded parameter (or its state), the tensor
    itself otherwise: a view of the shard's storage, writable in place."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def planned_rows(param: nn.Parameter, layout: ParallelLayout) -> RowShard:
    """This rank's rows of `param` (its whole tensor-parallel block) as
    FSDP2 cuts them, for tools that plan a rank's share without sharding
    (the offline converter, plan --memory)."""
    axis = spec_of(param).sharded_data_axis
    return make_shard(param, layout.size(axis), layout.coordinate(axis))


def row_shards(params: Sequence[nn.Parameter], layout: ParallelLayout) -> dict[int, RowShard]:
    """By id(parameter), each sharded parameter's rows on this rank: a
    shape-only stand-in of its tensor-parallel block (with its spec, for the
    checkpoint's rects) and the local shard as the view."""
    shards = {}
    for param in params:
        block = nn.Parameter(torch.empty(param.shape, device="meta"), requires_grad=False)
        set_spec(block, spec_of(param))
        axis = spec_of(param).sharded_data_axis
        start, stop, per_rank = shard_rows(param.shape[0], layout.size(axis),
                                           layout.coordinate(axis))
        # The shard's storage, as the optimizer's RowShard views are
        # Parameters over theirs.
        view = nn.Parameter(local_part(param.data), requires_grad=False)
        shards[id(param)] = RowShard(block, start, stop, per_rank, view)
    return shards


class ShardedGrads:
    """The gradients FSDP2 reduce-scatters into each parameter's shard,
    driven as `GroupedGrads` are: FSDP2 launches the reductions during
    backward and has waited for them when it returns."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.params = list(params)

    def arm(self) -> None:
        pass  # every backward reduces: the shards accumulate the micro-batches' means

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    def fold_all(self, divisor: int = 1) -> None:
        """Divide the summed grads by a pipeline's micro-batch count."""
        if divisor != 1:
            for grad in self._local_grads():
                grad.div_(divisor)

    def zero(self) -> None:
        for param in self.params:
            param.grad = None

    def held(self) -> list[Held]:
        """One group: (param, its grad's local shard); a parameter that got
        no grad this step steps on zeros, as a grad buffer's view would be."""
        return [[(param, grad) for param, grad in zip(self.params, self._local_grads())]]

    def sharded_over(self) -> list[tuple[str, ...]]:
        return [(SHARDED_OVER,)]

    def _local_grads(self) -> list[torch.Tensor]:
        grads = []
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(local_part(param.grad))
        return grads
