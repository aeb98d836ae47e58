"""`ParallelLayout`: this rank's place in the pp x dp x cp x tp grid, over a DeviceMesh.

The layout is an explicit object handed to whatever needs a process group; no
module keeps one in a global, so a restart can drop a layout and build another.
The arithmetic of ranks and coordinates is its `MeshShape`'s (parallel/mesh.py:
axes (pp, dp, tp), tp innermost, dp cut into (edp, ep) under expert
parallelism, cp before tp under context parallelism); a planned layout (`ParallelLayout.planned`)
has coordinates and no process group, for tools that describe ranks that do
not run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megaresil.config import ContextComm, ParallelConfig
from megaresil.parallel.context_parallel import CPGroup
from megaresil.parallel.expert_parallel import EPGroup
from megaresil.parallel.mesh import MeshShape
from megaresil.parallel.sharding import (
    DENSE_REPLICAS,
    EXPERT_REPLICAS,
    EXPERTS_SHARDED_OVER,
    SHARDED_OVER,
    SHARDED_REPLICAS,
)
from megaresil.parallel.tensor_parallel import TPGroup

# The axes that split the data: a rank's data shard is its index over them.
# Context-parallel peers read the same samples, each its own slice of them.
DATA_AXES = ("dp",)
# Groups over several axes, created by every rank in this order at start.
GROUPS_NEEDED: tuple[tuple[str, ...], ...] = ()


def pick_device(local_rank: int = 0) -> torch.device:
    """CUDA device of this local rank when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def visible_gpus() -> int:
    """CUDA devices this process sees (0 on a CPU machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's CUDA device: first thing on every
    thread that touches CUDA. A new thread starts on GPU 0, where its copies,
    allocations, events, synchronize() and NCCL calls would otherwise go."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def backend_for(device: torch.device) -> str:
    """The backend string of the default group (and, inherited, of every group
    made from it). On CUDA each group carries gloo beside NCCL: NCCL accepts
    CUDA tensors only, and the control-plane collectives are CPU by nature
    (the preemption flag, object gathers such as the stragglers' table and
    DCP's metadata), so a CPU tensor goes to gloo instead of raising "No
    backend type associated with device type cpu" at the first step. The
    data plane (grads, TP activations, pipeline sends) stays on NCCL, and the
    watchdog's NCCL abort still frees it; TorchTitan and Megatron-Core keep
    gloo groups beside NCCL for the same CPU-side traffic."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


@dataclass
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Optional[DeviceMesh] = None
    embedding_group: Optional[dist.ProcessGroup] = None
    planned_rank: int = 0  # the rank of a layout without a mesh
    groups_over: dict[tuple[str, ...], Optional[dist.ProcessGroup]] = field(default_factory=dict)
    ep: int = 1
    cp: int = 1
    cp_comm: ContextComm = ContextComm.allgather
    dp_shard: int = 1
    # By shard axis, the meshes FSDP2's are slices of (sharded_data_mesh).
    data_shard_meshes: dict[str, DeviceMesh] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, device: torch.device) -> "ParallelLayout":
        """Build the mesh over the already-initialised default process group."""
        layout = cls(cfg.tp, cfg.pp, cfg.dp, cfg.vpp, cfg.sequence_parallel, device, ep=cfg.ep,
                     cp=cfg.cp, cp_comm=cfg.cp_comm_type, dp_shard=cfg.dp_shard)
        if dist.is_initialized():
            layout.mesh = init_device_mesh(device.type, layout.shape.sizes,
                                           mesh_dim_names=layout.shape.names)
            layout.embedding_group = layout._new_embedding_group()
            layout.groups_over = {axes: layout._new_group_over(axes)
                                  for axes in layout._groups_over_several_axes()}
            if layout.dp_shard > 1:
                layout.data_shard_meshes = layout._new_data_shard_meshes()
        elif layout.world_size != 1:
            raise RuntimeError("a multi-rank layout needs torch.distributed to be initialised")
        return layout

    @classmethod
    def planned(cls, cfg: ParallelConfig, rank: int) -> "ParallelLayout":
        """Rank `rank` of `cfg`'s layout, without processes: coordinates and
        shapes only, `group()` is None."""
        return cls(cfg.tp, cfg.pp, cfg.dp, cfg.vpp, cfg.sequence_parallel, planned_rank=rank,
                   ep=cfg.ep, cp=cfg.cp, cp_comm=cfg.cp_comm_type, dp_shard=cfg.dp_shard)

    @property
    def shape(self) -> MeshShape:
        return MeshShape.of(self)

    @property
    def world_size(self) -> int:
        return self.shape.size()

    def size(self, *axes: str) -> int:
        return self.shape.size(*axes)

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.mesh is not None else self.planned_rank

    @property
    def coords(self) -> dict[str, int]:
        return self.shape.coords_of(self.rank)

    def coordinate(self, axis: str) -> int:
        """This rank's index along mesh axis `axis` (or joined name, as "dp")."""
        return self.index_over((axis,))

    @property
    def tp_rank(self) -> int:
        return self.coordinate("tp")

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")

    def index_over(self, axes: tuple[str, ...]) -> int:
        """This rank's index in its group over `axes` (its rank in `group(*axes)`)."""
        return self.shape.index_of(self.rank, axes)

    @property
    def data_rank(self) -> int:
        """This rank's data shard: its index over DATA_AXES."""
        return self.index_over(DATA_AXES)

    @property
    def data_size(self) -> int:
        return self.size(*DATA_AXES)

    def group(self, *axes: str) -> Optional[dist.ProcessGroup]:
        """Process group over mesh axes `axes` (one, a joined name such as
        "dp", or a GROUPS_NEEDED combination); None when there is no mesh."""
        if self.mesh is None:
            return None
        spanned = self.shape.expand(axes)
        if not spanned:
            raise ValueError(f"{axes} spans no mesh axis in this layout (size 1): no group to use")
        return self.mesh.get_group(spanned[0]) if len(spanned) == 1 else self.groups_over[spanned]

    def replica_groups(self, axes: tuple[str, ...] = ("dp",)) -> list[list[int]]:
        """Every group of ranks that hold replicas of one another over `axes`
        (rank lists, in mesh order)."""
        return self.shape.groups(axes)

    def replica_axes(self) -> list[tuple[str, ...]]:
        """The axes parameters are replicated over here
        (ShardSpec.replicated_over), widest first: dp and cp, and under
        expert parallelism edp (the experts, alike only on ranks of the same
        ep coordinate)."""
        if self.dp_shard > 1:
            return [SHARDED_REPLICAS]
        return [DENSE_REPLICAS, EXPERT_REPLICAS] if self.ep > 1 else [DENSE_REPLICAS]

    def whole_state_groups(self) -> list[list[int]]:
        """The groups of ranks whose whole state (dense parameters and
        experts) is alike: those that differ in edp (dp at ep = 1) and cp
        alone; under sharded data parallelism, in dp_replicate alone (a cp
        peer holds other rows of each parameter)."""
        return self.replica_groups(SHARDED_REPLICAS if self.dp_shard > 1 else EXPERT_REPLICAS)

    def _groups_over_several_axes(self) -> list[tuple[str, ...]]:
        """GROUPS_NEEDED and the joined names (as dp over (edp, ep)) that span
        several mesh axes, in that order: the groups the DeviceMesh lacks."""
        named = (GROUPS_NEEDED + tuple((name,) for name, _ in self.shape.joined)
                 + tuple(self.replica_axes()) + (EXPERT_REPLICAS,))
        spans = [self.shape.expand(axes) for axes in named]
        return list(dict.fromkeys(axes for axes in spans if len(axes) > 1))

    def _new_group_over(self, axes: tuple[str, ...]) -> Optional[dist.ProcessGroup]:
        return self._own_group(self.shape.groups(axes))

    def _own_group(self, groups: list[list[int]]) -> Optional[dist.ProcessGroup]:
        """Create a process group for each rank list, in order (every rank
        takes part in creating every group, as new_group requires); this
        rank's, if it is in one."""
        mine = None
        for ranks in groups:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _new_embedding_group(self) -> Optional[dist.ProcessGroup]:
        """Group of the first and last pipeline stage at this rank's (dp, tp)
        coordinates: they hold the two copies of a tied embedding."""
        if self.pp == 1:
            return None
        return self._own_group([[line[0], line[-1]] for line in self.shape.groups(("pp",))])

    def stage_group(self) -> Optional[dist.ProcessGroup]:
        """Group of every TP and DP rank of this rank's pipeline stage (FP8's
        amax reduction)."""
        if self.mesh is None:
            return None
        return self._own_group(self.shape.groups(("dp", "tp")))

    def sharded_data_mesh(self, axis: str = SHARDED_OVER) -> DeviceMesh:
        """The DeviceMesh FSDP2 shards over along `axis` (SHARDED_OVER, or
        the experts' EXPERTS_SHARDED_OVER): (dp_replicate, axis) under HSDP,
        `axis` alone under full sharding."""
        mesh = self.data_shard_meshes.get(axis)
        assert mesh is not None, "sharded data parallelism needs a mesh"
        if self.dp_shard == self.dp:
            return mesh[axis]
        return mesh["dp_replicate", axis]

    def data_shard_grid(self, axis: str) -> torch.Tensor:
        """The world's ranks as (the other axes, dp_replicate, `axis`): a
        rank's index along the last dim is `coordinate(axis)`, the axes
        `axis` joins taken in mesh order, as FSDP2 places its rows."""
        shape = self.shape
        shards = shape.expand((axis,))
        replicas = shape.expand(SHARDED_REPLICAS)
        others = [name for name in shape.names if name not in shards + replicas]
        order = [shape.names.index(name) for name in others + list(replicas + shards)]
        grid = torch.arange(self.world_size).reshape(shape.sizes).permute(order)
        return grid.reshape(-1, self.size(*SHARDED_REPLICAS), self.size(axis))

    def _new_data_shard_meshes(self) -> dict[str, DeviceMesh]:
        """`data_shard_grid` as a DeviceMesh through its public constructor,
        for the dense parameters and, under expert parallelism, the
        experts. Collective: every rank creates every dim's groups, in the
        same order."""
        axes = [SHARDED_OVER] + ([EXPERTS_SHARDED_OVER] if self.ep > 1 else [])
        return {axis: DeviceMesh(self.device.type, self.data_shard_grid(axis),
                                 mesh_dim_names=("others", "dp_replicate", axis))
                for axis in axes}

    def tensor_parallel(self) -> TPGroup:
        return TPGroup(self.group("tp"), self.tp, self.tp_rank, self.sequence_parallel)

    def context_parallel(self) -> CPGroup:
        group = self.group("cp") if self.cp > 1 else None
        return CPGroup(group, self.cp, self.coordinate("cp"), self.cp_comm)

    def expert_parallel(self) -> EPGroup:
        group = self.group("ep") if self.ep > 1 else None
        return EPGroup(group, self.ep, self.coordinate("ep"))

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that writes metrics: first TP/DP rank of the last stage,
        since only the last stage computes the loss."""
        return (self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0
                and self.coordinate("cp") == 0)

    def describe(self) -> dict:
        # ep only where it is used, so a dense layout's description (kept in
        # every checkpoint) is the one it always was.
        expert = {"ep": self.ep} if self.ep > 1 else {}
        context = {"cp": self.cp} if self.cp > 1 else {}
        sharded = {"dp_shard": self.dp_shard} if self.dp_shard > 1 else {}
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, **sharded, **expert, **context,
                "vpp": self.vpp,
                "sequence_parallel": self.sequence_parallel, "world_size": self.world_size}
