"""The chaos drill's notion of a rank's replicas: the peers that hold its
whole state (ParallelLayout.whole_state_groups) and how many ranks the
replica check compares, data-parallel and context-parallel alike."""
import pytest

from megaresil.config import load_recipe, no_live_copy
from megaresil.drills.chaos import check_fits, replicas, whole_state_peer
from megaresil.drills.scenarios import scenarios
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.replicas import ReplicaCheck
from tests.harness.cli import ROOT

TINY = ROOT / "recipes" / "gpt-tiny.yaml"


def recipe(**degrees):
    return load_recipe(TINY, [f"parallel.{k}={v}" for k, v in
                              {"tp": 1, "pp": 1, "dp": 1, **degrees}.items()]
                       + ["data.seq_len=32", "train.global_batch_size=48"])


@pytest.mark.parametrize("degrees,peers,count", [
    # cp = 1: the next data-parallel replica, at the last the one before.
    ({"dp": 2}, [1, 0], 2),
    ({"dp": 3}, [1, 2, 1], 3),
    ({"tp": 2, "dp": 2}, [2, 3, 0, 1], 2),
    ({"pp": 2, "dp": 2}, [1, 0, 3, 2], 2),
    # cp = 2 (mesh (pp, dp, cp, tp)): the context-parallel peer holds the same state.
    ({"cp": 2}, [1, 0], 2),
    ({"dp": 2, "cp": 2}, [1, 2, 3, 2], 4),
    ({"tp": 2, "cp": 2}, [2, 3, 0, 1], 2),
    ({"pp": 2, "cp": 2}, [1, 0, 3, 2], 2),  # never a rank of the other stage
    # HSDP (mesh (pp, dp_replicate, dp_shard, tp)): the dp_replicate peer
    # holds the same shard.
    ({"dp": 4, "dp_shard": 2}, [2, 3, 0, 1], 2),
    ({"dp": 4, "dp_shard": 2, "tp": 2}, [4, 5, 6, 7, 0, 1, 2, 3], 2),
])
def test_a_ranks_peer_holds_its_whole_state(degrees, peers, count):
    cfg = recipe(**degrees)
    assert [whole_state_peer(cfg, r) for r in range(cfg.parallel.world_size)] == peers
    assert replicas(cfg) == count


def test_context_parallel_peers_are_replicas_to_compare_and_to_copy():
    """At cp = 2, dp = 1 the bit-flip scenarios have two replicas to compare
    and live replacement a live copy; at dp = cp = 1 neither."""
    bitflip = scenarios(1, 5, 4)["bitflip-param"]
    check_fits(bitflip, recipe(cp=2), 5)
    assert no_live_copy(recipe(cp=2)) is None
    assert load_recipe(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
                              "parallel.cp=2", "data.seq_len=32",
                              "resilience.replacement.enabled=true"]).parallel.cp == 2
    with pytest.raises(ValueError, match="needs data-parallel replicas"):
        check_fits(bitflip, recipe(), 5)
    assert "at dp=1 no data-parallel peer" in no_live_copy(recipe()).why


def test_sharded_data_replicas_are_dp_replicate_peers_and_full_sharding_has_none():
    """Under HSDP the bit-flip scenarios compare the dp_replicate replicas
    and live replacement has a live copy; at full sharding (dp_shard = dp)
    neither, and the refusal names dp_shard, not dp, as what to change."""
    bitflip = scenarios(1, 5, 4)["bitflip-param"]
    check_fits(bitflip, recipe(dp=4, dp_shard=2), 5)
    assert no_live_copy(recipe(dp=4, dp_shard=2)) is None
    full = recipe(dp=2, dp_shard=2)
    assert replicas(full) == 1
    with pytest.raises(ValueError, match=r"parallel.dp_shard=2 of dp=2 leaves 1; set "
                                         r"parallel.dp to 2 x parallel.dp_shard"):
        check_fits(bitflip, full, 5)
    gap = no_live_copy(full)
    assert gap is not None and not gap.refused and "dp_shard = dp = 2" in gap.why
    # The trainer's replica check: due under HSDP, never at full sharding
    # (one "replica" compared with itself would prove nothing).
    for cfg, due in [(recipe(dp=4, dp_shard=2), True), (full, False)]:
        check = ReplicaCheck(1, ParallelLayout.planned(cfg.parallel, 0), lambda full: {},
                             None, lambda step, reason: None, None)
        assert check.due(4, saving=True) is due
