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


# (tp, pp, dp, ep): expert-parallel layouts.
EXPERT_LAYOUTS = [(1, 1, 2, 2), (2, 1, 4, 2), (1, 2, 4, 4), (2, 2, 4, 2), (1, 3, 8, 2)]


def expert_shape(tp: int, pp: int, dp: int, ep: int) -> MeshShape:
    return MeshShape.of(ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep))


@pytest.mark.parametrize("tp,pp,dp,ep", EXPERT_LAYOUTS)
def test_expert_parallelism_cuts_dp_and_renumbers_nothing(tp, pp, dp, ep):
    g, mesh = grid(tp, pp, dp), expert_shape(tp, pp, dp, ep)
    assert mesh.names == ("pp", "edp", "ep", "tp") and mesh.size("dp") == dp
    assert mesh.groups(("dp",)) == shape(tp, pp, dp).groups(("dp",))
    assert mesh.groups(("dp", "tp")) == shape(tp, pp, dp).groups(("dp", "tp"))
    for rank in range(tp * pp * dp):
        p, d, t = (int(x) for x in (g == rank).nonzero()[0])
        assert mesh.coords_of(rank) == {"pp": p, "edp": d // ep, "ep": d % ep, "tp": t}
        assert mesh.index_of(rank, ("dp",)) == d
    # ep: consecutive dp indices; edp: every ep-th, at the same ep index
    assert sorted(mesh.groups(("ep",))) == sorted(line[i:i + ep] for line in mesh.groups(("dp",))
                                                  for i in range(0, dp, ep))
    assert sorted(mesh.groups(("edp",))) == sorted(line[i::ep] for line in mesh.groups(("dp",))
                                                   for i in range(ep))


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_without_expert_parallelism_edp_is_dp_and_ep_is_one_rank(tp, pp, dp):
    mesh = shape(tp, pp, dp)
    assert mesh.names == ("pp", "dp", "tp")
    assert mesh.groups(("edp",)) == mesh.groups(("dp",)) and mesh.size("ep") == 1
    assert all(mesh.group_of(("ep",), mesh.coords_of(r)) == [r] for r in range(mesh.size()))


def test_a_planned_expert_layout_names_its_ep_and_its_data_rank():
    cfg = ParallelConfig(tp=2, pp=1, dp=4, ep=2)
    layout = ParallelLayout.planned(cfg, 5)  # pp 0, dp 2 (edp 1, ep 0), tp 1
    assert (layout.dp_rank, layout.coordinate("edp"), layout.coordinate("ep")) == (2, 1, 0)
    assert (layout.data_rank, layout.data_size, layout.tp_rank) == (2, 4, 1)
    assert layout.describe()["ep"] == 2 and layout.group("ep") is None


def test_experts_are_replicas_within_edp_and_a_ranks_whole_state_too():
    """dp4 ep2: dense parameters alike over dp, experts (and so a rank's
    whole state) only on ranks of one ep coordinate; at ep=1 both are dp."""
    layout = ParallelLayout.planned(ParallelConfig(tp=1, pp=1, dp=4, ep=2), 0)
    assert layout.replica_axes() == [("dp", "cp"), ("edp", "cp")]  # cp is no axis here
    assert layout.replica_groups(("edp",)) == layout.whole_state_groups() == [[0, 2], [1, 3]]
    dense = ParallelLayout.planned(ParallelConfig(tp=2, pp=1, dp=2), 0)
    assert dense.replica_axes() == [("dp", "cp")]
    assert dense.whole_state_groups() == dense.replica_groups() == [[0, 2], [1, 3]]


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
