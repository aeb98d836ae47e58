"""Silent data corruption at dp=3 on gloo: a bit flipped in one replica's
parameter or gradient is found by the replica checksum, the odd one out is
named and restored from a healthy replica, and the run goes on bit-equal to
the fault-free run; a gradient flip under the distributed optimizer reaches
every replica alike, which the checksum cannot see (docs/numerics.md). At
dp=4 ep=2 the experts are compared within their edp pairs: a flip in one
is found, told by a replay and gone, while a dense weight's is outvoted by
the other three replicas."""
from __future__ import annotations

import pytest

from tests.harness.dist import MOE
from tests.harness.faulted import events, losses, run_cases

DP3 = ["parallel.dp=3", "train.global_batch_size=6"]
ZERO1 = DP3 + ["optimizer.distributed=true"]
PARAM_AT_4 = 'faults=[{kind: bitflip, rank: 2, step: 4, bit: 21, seed: 3}]'
GRAD_AT_6 = 'faults=[{kind: bitflip, rank: 1, step: 6, bit: 22, target: grad}]'
CASES = {
    "reference": DP3,
    "param": DP3 + [PARAM_AT_4],
    "grad": DP3 + [GRAD_AT_6],
    "reference_zero1": ZERO1,
    "param_zero1": ZERO1 + [PARAM_AT_4],
    "grad_zero1": ZERO1 + [GRAD_AT_6],
    "unchecked": DP3 + [PARAM_AT_4, "resilience.numerics.check_interval=0"],
}


# Experts over edp pairs ([0, 2] hold experts 0-1, [1, 3] experts 2-3).
EP2 = MOE + ["parallel.dp=4", "parallel.ep=2", "checkpoint.interval=2"]
EXPERT_CASES = {
    "reference": EP2,
    # seed 7 picks layers.1.mlp.experts.up, seed 1 layers.0.attn.proj.weight
    "expert": EP2 + ['faults=[{kind: bitflip, rank: 2, step: 5, bit: 22, seed: 7}]'],
    "dense": EP2 + ['faults=[{kind: bitflip, rank: 1, step: 5, bit: 22, seed: 1}]'],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_cases(CASES, 3, tmp_path_factory.mktemp("replicas"))


@pytest.fixture(scope="module")
def expert_runs(tmp_path_factory):
    return run_cases(EXPERT_CASES, 4, tmp_path_factory.mktemp("expert_replicas"))


@pytest.mark.parametrize("case, rank, step", [("param", 2, 4), ("grad", 1, 6),
                                              ("param_zero1", 2, 4)])
def test_the_odd_replica_is_named_and_restored(runs, case, rank, step):
    run = runs / case
    flipped, = events(run, "fault_injected")
    assert flipped["rank"] == rank and flipped["bit"] in (21, 22), flipped
    detected, = events(run, "silent_corruption_detected")
    assert detected["step"] == step and detected["culprit"] == [rank], detected
    assert detected["how"] == "majority" and detected["tensors"], detected
    if case == "grad":  # its grad norm, so its clipping and every update differed
        assert detected["differing_tensors"] > 8 and len(detected["tensors"]) == 8, detected
    assert not events(run, "rolled_back")  # no replay: restored in place
    reference = "reference_zero1" if case.endswith("zero1") else "reference"
    assert losses(run) == losses(runs / reference)
    assert not events(runs / reference, "silent_corruption_detected")


def test_a_flip_reaching_every_replica_alike_is_beyond_the_checksum(runs):
    """Under the distributed optimizer a rank's grad rows update the weights
    every replica gathers: the replicas stay equal, the run differs."""
    run = runs / "grad_zero1"
    assert events(run, "fault_injected") and not events(run, "silent_corruption_detected")
    assert losses(run)[10] != losses(runs / "reference_zero1")[10]


def test_unchecked_a_flip_stays(runs):
    run = runs / "unchecked"
    assert not events(run, "silent_corruption_detected")
    assert losses(run)[10] != losses(runs / "reference")[10]


def test_a_flipped_expert_is_found_within_its_edp_pair_and_told_by_a_replay(expert_runs):
    run = expert_runs / "expert"
    flipped, = events(run, "fault_injected")
    assert flipped["tensor"] == "layers.1.mlp.experts.up", flipped
    detected, = events(run, "silent_corruption_detected")
    assert detected["step"] == 5 and detected["replicas"] == [[0, 2]], detected
    rolled, = events(run, "rolled_back")
    assert rolled["reason"] == "silent_corruption" and rolled["to_step"] == 4
    attributed, = events(run, "silent_corruption_attributed")
    assert attributed["culprit"] == [2], attributed
    assert losses(run) == losses(expert_runs / "reference")
    assert not events(expert_runs / "reference", "silent_corruption_detected")


def test_a_flipped_dense_weight_at_ep2_is_outvoted_by_every_dp_replica(expert_runs):
    run = expert_runs / "dense"
    detected, = events(run, "silent_corruption_detected")
    assert detected["culprit"] == [1] and detected["how"] == "majority", detected
    assert detected["tensors"] == ["layers.0.attn.proj.weight"], detected
    assert not events(run, "rolled_back")
    assert losses(run) == losses(expert_runs / "reference")
