"""Sharded data parallelism's arithmetic and refusals (parallel.dp_shard):
the mesh it cuts dp into, what each rank holds by the memory estimate and
by the converter's plan of its checkpoint rects, and the recipes it
refuses (config/sharded_data.py): one line naming the key and the fix,
from `megaresil train` before any worker starts."""
from __future__ import annotations

import pytest

from megaresil.checkpoint.offline.planning import planned_rects, recipe_layout
from megaresil.config import ConfigError, ParallelConfig, load_recipe
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.mesh import MeshShape
from megaresil.train.memory_census import estimate
from tests.harness.cli import ROOT

TINY = ROOT / "recipes" / "gpt-tiny.yaml"
DP4 = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=4", "train.global_batch_size=16"]


@pytest.mark.parametrize("tp,pp,dp,dp_shard", [(1, 1, 4, 2), (2, 2, 4, 4), (2, 1, 8, 2)])
def test_the_shard_axes_cut_dp_and_number_ranks_as_before(tp, pp, dp, dp_shard):
    """dp is (dp_replicate, dp_shard), dp_shard innermost: every rank's
    number and dp index are the unsharded mesh's, and a replica group
    holds the ranks of one dp_shard coordinate."""
    plain = MeshShape.of(ParallelConfig(tp=tp, pp=pp, dp=dp))
    cut = MeshShape.of(ParallelConfig(tp=tp, pp=pp, dp=dp, dp_shard=dp_shard))
    assert cut.names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert cut.size("dp") == dp and cut.size("dp_shard") == dp_shard
    for rank in range(tp * pp * dp):
        assert cut.index_of(rank, ("dp",)) == plain.index_of(rank, ("dp",))
        assert cut.index_of(rank, ("dp_shard",)) == plain.index_of(rank, ("dp",)) % dp_shard
    layout = ParallelLayout.planned(ParallelConfig(tp=tp, pp=pp, dp=dp, dp_shard=dp_shard), 0)
    for group in layout.whole_state_groups():
        assert len(group) == dp // dp_shard
        assert len({cut.index_of(r, ("dp_shard",)) for r in group}) == 1


@pytest.mark.parametrize("tp,pp,dp,dp_shard,cp", [(1, 1, 2, 2, 2), (1, 1, 4, 2, 2), (2, 2, 2, 2, 2),
                                                  (1, 1, 4, 4, 2), (1, 2, 2, 2, 4)])
def test_fsdp_shards_over_dp_shard_and_cp_together(tp, pp, dp, dp_shard, cp):
    """Under cp, FSDP2's shard slot is (dp_shard, cp) in mixed radix, cp
    inner, which is each rank's place in the grid its DeviceMesh is built
    from; a shard's replicas are its dp_replicate peers only, as a cp peer
    holds other rows."""
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, dp_shard=dp_shard, cp=cp)
    shape = MeshShape.of(cfg)
    assert shape.names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert shape.size("dp_shard_cp") == dp_shard * cp
    grid = ParallelLayout.planned(cfg, 0).data_shard_grid("dp_shard_cp")
    for rank in range(shape.size()):
        coords = shape.coords_of(rank)
        slot = coords["dp_shard"] * cp + coords["cp"]
        assert shape.index_of(rank, ("dp_shard_cp",)) == slot
        assert grid[coords["pp"] * tp + coords["tp"], coords["dp_replicate"], slot] == rank
    layout = ParallelLayout.planned(cfg, 0)
    assert layout.replica_axes() == [("dp_replicate",)]
    for group in layout.whole_state_groups():
        assert len(group) == dp // dp_shard
        assert len({shape.index_of(r, ("dp_shard_cp",)) for r in group}) == 1


@pytest.mark.parametrize("tp,dp,dp_shard,ep", [(1, 4, 4, 2), (1, 4, 2, 2), (2, 8, 4, 2), (1, 8, 8, 4)])
def test_experts_shard_over_dp_shard_mod_ep(tp, dp, dp_shard, ep):
    """Under ep, dp_shard is (dp_shard_mod_ep, ep): ranks, dp and ep
    indices are the unsharded expert-parallel mesh's; dense rows go over
    dp_shard, an expert stack's (cut along ep) over dp_shard_mod_ep, each a
    rank's place in the grid its DeviceMesh is built from."""
    plain = MeshShape.of(ParallelConfig(tp=tp, dp=dp, ep=ep))
    cfg = ParallelConfig(tp=tp, dp=dp, ep=ep, dp_shard=dp_shard)
    cut = MeshShape.of(cfg)
    assert cut.names == ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
    layout = ParallelLayout.planned(cfg, 0)
    dense, experts = layout.data_shard_grid("dp_shard_cp"), layout.data_shard_grid("efsdp")
    assert experts.shape[-1] == dp_shard // ep and dense.shape[-1] == dp_shard
    for rank in range(cut.size()):
        for axes in (("dp",), ("ep",), ("edp",)):
            assert cut.index_of(rank, axes) == plain.index_of(rank, axes)
        coords = cut.coords_of(rank)
        slot = cut.index_of(rank, ("efsdp",))
        assert slot == coords["dp_shard_mod_ep"]
        assert cut.index_of(rank, ("dp_shard_cp",)) == cut.index_of(rank, ("dp",)) % dp_shard
        assert rank in experts[:, coords["dp_replicate"], slot].tolist()


def test_without_sharding_the_mesh_is_unchanged():
    cfg = ParallelConfig(tp=2, pp=2, dp=2)
    assert MeshShape.of(cfg).names == ("pp", "dp", "tp")
    assert MeshShape.of(cfg).expand(("dp_replicate",)) == ("dp",)
    assert MeshShape.of(cfg).expand(("dp_shard",)) == ()
    assert "dp_shard" not in ParallelLayout.planned(cfg, 0).describe()


@pytest.mark.parametrize("dp_shard", [2, 4])
def test_each_rank_estimates_a_dp_shard_share_of_its_state(dp_shard):
    """plan --memory: moments and grads 1/dp_shard of the replicated run's
    (within the uneven rows), and no separate main copies."""
    (whole,) = estimate(load_recipe(TINY, DP4 + ["train.precision=bf16"]), "cpu")
    kinds = estimate(load_recipe(TINY, DP4 + ["train.precision=bf16",
                                              f"parallel.dp_shard={dp_shard}"]), "cpu")
    assert sorted(r for k in kinds for r in k.ranks) == [0, 1, 2, 3]
    assert sum(k.optimizer * len(k.ranks) for k in kinds) == whole.optimizer * 4 // dp_shard
    for kind in kinds:
        assert kind.main == 0 and kind.grads <= 1.1 * whole.grads / dp_shard


def test_under_cp_each_rank_estimates_a_dp_shard_x_cp_share():
    """cp ranks hold the same parameters: FSDP2 shards them over cp too."""
    (whole,) = estimate(load_recipe(TINY, DP4 + ["parallel.cp=2", "data.seq_len=64"]), "cpu")
    kinds = estimate(load_recipe(TINY, DP4 + ["parallel.cp=2", "data.seq_len=64",
                                              "parallel.dp_shard=2"]), "cpu")
    assert sorted(r for k in kinds for r in k.ranks) == list(range(8))
    assert sum(k.optimizer * len(k.ranks) for k in kinds) == whole.optimizer * 8 // 4


@pytest.mark.parametrize("dp_shard,cp", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_the_converters_plan_covers_every_element_once_per_replica(dp_shard, cp):
    cfg = load_recipe(TINY, DP4 + [f"parallel.dp_shard={dp_shard}", f"parallel.cp={cp}",
                                   "data.seq_len=64"])
    per_rank = planned_rects(cfg, weights_only=False)
    covered: dict[str, int] = {}
    for rank in range(4 * cp):
        for rect in per_rank[rank]:
            covered[rect.key] = covered.get(rect.key, 0) + rect.tensor.numel()
    shapes = {r.key: r.global_shape for rects in per_rank for r in rects}
    for key, shape in shapes.items():
        whole = 1
        for size in shape:
            whole *= size
        assert covered[key] == whole * (4 // dp_shard), key
    assert recipe_layout(cfg)["dp_shard"] == dp_shard and recipe_layout(cfg)["distributed_optimizer"]


@pytest.mark.parametrize("dp_shard", [2, 4])
def test_the_plan_covers_every_expert_once_per_replica(dp_shard):
    cfg = load_recipe(TINY, DP4 + [f"parallel.dp_shard={dp_shard}", "parallel.ep=2",
                                   "model.flavour=llama", "model.moe.num_experts=4"])
    per_rank = planned_rects(cfg, weights_only=False)
    covered: dict[str, int] = {}
    for rects in per_rank:
        for rect in rects:
            covered[rect.key] = covered.get(rect.key, 0) + rect.tensor.numel()
    shapes = {r.key: r.global_shape for rects in per_rank for r in rects}
    assert any("experts" in key for key in shapes)
    for key, shape in shapes.items():
        whole = 1
        for size in shape:
            whole *= size
        assert covered[key] == whole * (4 // dp_shard), key


@pytest.mark.parametrize("overrides,key,fix", [
    (["parallel.dp_shard=3"], "parallel.dp_shard", "choose a divisor of 4, or 1"),
    (["parallel.dp_shard=2", "optimizer.distributed=true"], "optimizer.distributed",
     "set optimizer.distributed=false, or parallel.dp_shard=1 for ZeRO-1"),
    (["parallel.dp_shard=2", "parallel.ep=4", "model.flavour=llama", "model.moe.num_experts=4"],
     "parallel.ep", "choose parallel.ep dividing 2, or parallel.dp_shard=1"),
    (["parallel.dp_shard=2", "model.backend=te"], "parallel.dp_shard",
     "set model.backend=local and train.fp8=none, or parallel.dp_shard=1"),
])
def test_what_sharding_does_not_take_is_refused(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, DP4 + overrides)
    assert err.value.key == key and f"Fix: {fix}" in str(err.value) and "\n" not in str(err.value)


def test_train_refuses_it_before_any_worker_starts(cli_main, tmp_path):
    run = tmp_path / "run"
    result = cli_main("train", str(TINY), *DP4, "parallel.dp_shard=3", f"run.dir={run}",
                      check=False)
    assert result.returncode == 2, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert "parallel.dp_shard: 3 does not divide dp=4" in error and "Fix: choose" in error
    assert not (run / "events.jsonl").exists()  # no worker started


@pytest.mark.parametrize("dp_shard,world,expected", [(4, 2, 2), (2, 6, 2), (4, 6, 2), (4, 1, 1)])
def test_a_shrunk_job_keeps_full_sharding_or_the_widest_shard_group(dp_shard, world, expected):
    """Elastic membership at dp=8: full sharding stays full; a shard group
    keeps its size where it divides the new dp, else the largest that does."""
    from megaresil.launch.worker import adapt_to_world

    cfg = load_recipe(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=8",
                             f"parallel.dp_shard={dp_shard}", "train.global_batch_size=48",
                             "train.micro_batch_size=1"])
    shrunk = adapt_to_world(cfg, world).parallel
    assert (shrunk.dp, shrunk.dp_shard) == (world, expected)
    full = load_recipe(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=8",
                              "parallel.dp_shard=8", "train.global_batch_size=48",
                              "train.micro_batch_size=1"])
    assert adapt_to_world(full, 6).parallel.dp_shard == 6


@pytest.mark.parametrize("dp,dp_shard,cp,ep,said", [
    (4, 4, 1, 2, "sharded over all 4; experts cut along ep=2, their rows over 2"),
    (2, 2, 2, 2, "sharded over all 4 (dp_shard 2 x cp 2); experts cut along ep=2, their rows "
                 "over 2"),
    (4, 2, 1, 2, "HSDP, 2 replicas each sharded over 2; experts cut along ep=2, not sharded "
                 "further"),
])
def test_the_start_line_says_how_each_rank_holds_the_model(dp, dp_shard, cp, ep, said):
    from megaresil.train.story import sharding

    assert sharding(dp, dp_shard, cp, ep).endswith(said)
