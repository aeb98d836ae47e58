"""`MeshShape` and the layout's mesh arithmetic (parallel/mesh.py,
parallel/layout.py): rank numbering, the groups every rank creates and their
order, and planned (process-free) layouts, against the DeviceMesh grid the
layout is built over (`torch.arange(world).view(pp, dp, tp)`)."""
from __future__ import annotations

import pytest
import torch

from megaresil.config import ParallelConfig
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.mesh import MeshShape
from megaresil.resilience.stragglers import peers

# (tp, pp, dp): the layouts of tests/multirank/test_parallel_equivalence.py and more.
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2),
           (2, 2, 2), (4, 1, 2), (1, 4, 2), (2, 3, 2)]


def grid(tp: int, pp: int, dp: int) -> torch.Tensor:
    return torch.arange(tp * pp * dp).view(pp, dp, tp)


def shape(tp: int, pp: int, dp: int) -> MeshShape:
    return MeshShape.of(ParallelConfig(tp=tp, pp=pp, dp=dp))


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_ranks_and_coordinates_are_the_grids(tp, pp, dp):
    mesh = shape(tp, pp, dp)
    assert mesh.size() == tp * pp * dp and mesh.size("pp", "tp") == pp * tp
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                rank = int(grid(tp, pp, dp)[p, d, t])
                assert rank == (p * dp + d) * tp + t
                assert mesh.coords_of(rank) == {"pp": p, "dp": d, "tp": t}
                assert mesh.rank_of({"tp": t, "pp": p, "dp": d}) == rank


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_groups_are_todays_grid_slices_in_todays_order(tp, pp, dp):
    g, mesh = grid(tp, pp, dp), shape(tp, pp, dp)
    assert mesh.groups(("dp",)) == [g[p, :, t].tolist() for p in range(pp) for t in range(tp)]
    assert mesh.groups(("dp", "tp")) == [stage.flatten().tolist() for stage in g]
    assert ([[line[0], line[-1]] for line in mesh.groups(("pp",))]
            == [[int(g[0, d, t]), int(g[-1, d, t])] for d in range(dp) for t in range(tp)])
    assert mesh.groups(("tp", "dp")) == mesh.groups(("dp", "tp"))  # mesh order, whatever asked


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_a_planned_layout_has_every_ranks_coordinates_and_no_group(tp, pp, dp):
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, vpp=1)
    for rank in range(cfg.world_size):
        layout = ParallelLayout.planned(cfg, rank)
        p, d, t = (int(x) for x in (grid(tp, pp, dp) == rank).nonzero()[0])
        assert (layout.rank, layout.pp_rank, layout.dp_rank, layout.tp_rank) == (rank, p, d, t)
        assert layout.coords == {"pp": p, "dp": d, "tp": t}
        assert (layout.data_rank, layout.data_size) == (d, dp)
        assert layout.group("tp") is None and layout.tensor_parallel().rank == t
        assert layout.replica_groups() == shape(tp, pp, dp).groups(("dp",))
        assert layout.describe() == {"tp": tp, "pp": pp, "dp": dp, "vpp": 1,
                                     "sequence_parallel": False, "world_size": tp * pp * dp}


def test_a_layout_without_a_mesh_is_rank_0_of_one():
    layout = ParallelLayout(device=torch.device("cpu"))
    assert (layout.rank, layout.coords, layout.world_size) == (0, {"pp": 0, "dp": 0, "tp": 0}, 1)
    assert layout.replica_groups() == [[0]] and layout.group("dp") is None


def test_the_model_parallel_size_is_every_axis_but_dp():
    cfg = ParallelConfig(tp=2, pp=3, dp=4)
    assert cfg.model_parallel_size == 6 and cfg.world_size == 24


def old_peers(rank: int, world: int, pp: int) -> list[int]:
    per_stage = world // pp if pp and world % pp == 0 else world
    return [r for r in range(world) if r // per_stage == rank // per_stage]


@pytest.mark.parametrize("world,pp", [(1, 1), (4, 1), (4, 2), (8, 4), (6, 3), (5, 2), (3, 0)])
def test_straggler_peers_are_the_ranks_of_one_stage(world, pp):
    assert [peers(r, world, pp) for r in range(world)] == [old_peers(r, world, pp)
                                                            for r in range(world)]
