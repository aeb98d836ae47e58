"""`ShardSpec`: how one parameter is laid out over the mesh, set where the
parameter is made and read by everything that needs to know (init,
checkpoint rects, grad reductions, norm counting).

A parameter's spec says which tensor dims are cut along which named mesh axis
(recorded at every size, 1 included: init draws units along the first cut dim
even when nothing is cut), which data-parallel axes hold replicas of it, which
axes its grads are summed over because each rank saw only part of the input,
and whether it is one copy of a tied parameter. It is the one place that knows
the attribute the spec is stored under; the spec survives `materialize`, the
TE conversion and fp32 main copies through `carry_spec`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# The tie of the token embedding with its copy on the last pipeline stage.
EMBEDDING_TIE = "embedding"

# The mesh axis a stack of experts is cut along, dim 0 of its parameters
# (size 1 until expert parallelism carves it from dp).
EXPERT_AXIS = "ep"

# The axes a dense parameter is replicated over: the data-parallel ranks and
# the context-parallel ones, which hold the same tensors and see different
# slices of the same sequences (cp is no mesh axis at cp = 1).
DENSE_REPLICAS = ("dp", "cp")
# A stack of experts cut along ep: alike on the ranks of one ep coordinate
# (edp) and their context-parallel peers.
EXPERT_REPLICAS = ("edp", "cp")
# Under sharded data parallelism (parallel.dp_shard > 1) FSDP2 shards each
# parameter over the dp_shard and cp ranks together (TorchTitan's
# dp_shard_cp): cp ranks see slices of the same sequences, so the shard's
# reduce-scatter also sums their grads. A cp peer holds other rows, so a
# shard is alike only on the ranks of one dp_shard_cp coordinate: its
# replica group, dp_replicate.
SHARDED_OVER = "dp_shard_cp"
SHARDED_REPLICAS = ("dp_replicate",)
# A stack of experts, already cut along ep, is sharded over the rest of
# dp_shard (dp_shard / ep ranks, TorchTitan's dp_shard_mod_ep) and cp.
EXPERTS_SHARDED_OVER = "efsdp"

# Not `_`-prefixed: copies of a parameter's attributes skip private ones.
_ATTRIBUTE = "shard_spec"


@dataclass(frozen=True)
class AxisShard:
    """Dim `dim` of the tensor is cut into `size` equal blocks along mesh axis
    `axis`; this rank holds block `rank`."""

    dim: int
    axis: str
    size: int
    rank: int


@dataclass(frozen=True)
class ShardSpec:
    """`shards`: outermost first (two on one dim nest: the first picks the
    block, the second a block of that). `replicated_over`: the data-parallel
    axes holding replicas (its gradient group). `grad_sum_axes`: axes whose
    ranks each saw a shard of the input (sequence parallelism: "tp"), so the
    grads are summed there. `tie`: grads are summed with the copies of the
    same tie. `pipeline_copy`: the last stage's copy of a tie, loaded but
    never saved nor counted."""

    shards: tuple[AxisShard, ...] = ()
    replicated_over: tuple[str, ...] = DENSE_REPLICAS
    grad_sum_axes: tuple[str, ...] = ()
    tie: Optional[str] = None
    pipeline_copy: bool = False

    def global_shape(self, local: torch.Size) -> torch.Size:
        """The whole tensor's shape (padded as the local blocks are)."""
        shape = list(local)
        for shard in self.shards:
            shape[shard.dim] *= shard.size
        return torch.Size(shape)

    def offset(self, local: torch.Size) -> tuple[int, ...]:
        """Where this rank's block starts in the whole tensor."""
        blocks = [0] * len(local)
        for shard in self.shards:
            blocks[shard.dim] = blocks[shard.dim] * shard.size + shard.rank
        return tuple(block * size for block, size in zip(blocks, local))

    @property
    def unit_dim(self) -> int:
        """The dim init draws its units along: the first cut one, else 0."""
        return self.shards[0].dim if self.shards else 0

    @property
    def stacks_experts(self) -> bool:
        """Whether dim 0 indexes experts: each is a tensor of its own."""
        return bool(self.shards) and self.shards[0].axis == EXPERT_AXIS and self.shards[0].dim == 0

    @property
    def sharded_data_axis(self) -> str:
        """The (joined) mesh axis FSDP2 shards the parameter's rows over."""
        return EXPERTS_SHARDED_OVER if self.stacks_experts else SHARDED_OVER

    def per_expert(self) -> ShardSpec:
        """The spec of one expert of a stack: the expert cut left out, the
        dims after it one lower."""
        if not self.stacks_experts or any(s.dim == 0 for s in self.shards[1:]):
            raise ValueError(f"{self} does not stack experts along dim 0 alone")
        inner = tuple(dataclasses.replace(s, dim=s.dim - 1) for s in self.shards[1:])
        return dataclasses.replace(self, shards=inner)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(shard.axis for shard in self.shards)

    def counted_on(self, coordinate: Callable[[str], int], model_axes: tuple[str, ...]) -> bool:
        """Whether this rank counts the parameter in a model-wide sum (the
        grad norm) so every element counts once: not a pipeline copy, and at
        coordinate 0 of every model axis the parameter is replicated over."""
        if self.pipeline_copy:
            return False
        return all(coordinate(axis) == 0 for axis in model_axes if axis not in self.sharded_axes)


def has_spec(param: torch.Tensor) -> bool:
    return hasattr(param, _ATTRIBUTE)


def spec_of(param: torch.Tensor) -> ShardSpec:
    """The parameter's spec; a parameter made without one is a layer that
    does not say how it is laid out."""
    spec = getattr(param, _ATTRIBUTE, None)
    if spec is None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no ShardSpec; set one "
                         "where it is made (parallel/sharding.set_spec, or tensor_parallel's "
                         "mark_sharded / mark_replicated)")
    return spec


def set_spec(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    setattr(param, _ATTRIBUTE, spec)
    return param


def with_spec(param: torch.Tensor, **changes) -> torch.Tensor:
    """Change some fields of the parameter's spec."""
    return set_spec(param, dataclasses.replace(spec_of(param), **changes))


def carry_spec(old: torch.Tensor, new: torch.Tensor) -> None:
    """Give `new` (a parameter replacing `old`) the spec of `old`, if it has one."""
    if has_spec(old):
        set_spec(new, spec_of(old))
